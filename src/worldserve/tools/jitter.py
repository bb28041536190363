"""The player's adaptive jitter buffer, in simulated time: the rule the page (static/player.js,
"the jitter buffer") plays JPEG and raw frames by, so ``worldserve bench``'s key-to-photon is
what a viewer of the page sees.

The rule (WebRTC NetEq's idea, cut down to whole frames):

- ``target``: frames of slack the player wants. It starts at ``start`` (the page: 1 frame).
- A chunk that finds the player stopped (its first, or the first after an underrun) waits
  ``target`` frames after it arrives before its first frame plays; from there frames play one
  frame period apart.
- An *underrun*: a frame is due and none is queued while the stream is live. Playback stops,
  ``target`` grows by one frame (at most ``cap``: two chunks), and the next chunk waits the
  grown target.
- After ``shrink_after`` seconds of play with no underrun, ``target`` shrinks by one frame (not
  below ``start``), and the player takes that frame back by playing the next two frames half a
  period early each: nothing is dropped.
- The *level*: how long an arriving chunk waits before its first frame plays (the frames
  queued ahead of it, in time). When the least level of the last ``LEVEL_WINDOW`` chunks is
  above the target plus ``ahead`` (the frames the server keeps queued by design: its lead,
  ``lead_chunks`` whole chunks, told in ``session.started``; 0 just in time), the player
  takes the excess back the same way (at most a frame per chunk, played half a period early
  at a time), until the least level is the target: neither a stall's burst nor a slow start
  (a first chunk decoded late, which sets every later chunk's wait) leaves a lasting delay.
- :meth:`JitterBuffer.supersede` removes the frames of one chunk (by seq) that have not played
  yet (a chunk that a later one replaces); frames behind them move up.

Pure: the caller passes the time (seconds, any clock). Must not know: sockets, asyncio, the server.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

__all__ = ["LEVEL_WINDOW", "SHRINK_AFTER_S", "JitterBuffer", "Shown"]

#: Seconds of play with no underrun before the target shrinks by one frame (the page's too).
SHRINK_AFTER_S = 3.0
#: Chunks whose levels (frames queued when each arrived) decide whether the queue holds too much.
LEVEL_WINDOW = 4


@dataclass(frozen=True, slots=True)
class Shown:
    """One frame played: its chunk's seq, its index in that chunk, and when (seconds)."""

    seq: int
    index: int
    at: float


class JitterBuffer:
    """Frames queued by chunk, played at ``frame`` seconds apart under the rule above."""

    def __init__(
        self,
        frame: float,
        frames_per_chunk: int,
        *,
        start: float = 1.0,
        cap: float | None = None,
        shrink_after: float = SHRINK_AFTER_S,
        ahead: int | None = None,
    ) -> None:
        if not frame > 0:
            raise ValueError(f"frame must be positive seconds; got {frame!r}.")
        if frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk must be at least 1; got {frames_per_chunk!r}.")
        if not start >= 0:
            raise ValueError(f"start must be non-negative frames; got {start!r}.")
        if ahead is not None and ahead < 0:
            raise ValueError(f"ahead must be non-negative frames; got {ahead!r}.")
        self.frame = float(frame)
        self.frames_per_chunk = frames_per_chunk
        self.start = float(start)
        self.cap = max(self.start, float(2 * frames_per_chunk if cap is None else cap))
        self.shrink_after = float(shrink_after)
        #: Frames the server keeps queued by design (its lead); None: one chunk (a server a chunk ahead).
        self.ahead = frames_per_chunk if ahead is None else ahead
        self.target = self.start  # frames of slack wanted now
        self.underruns = 0
        self.most = self.start  # the largest target so far
        self._queue: deque[tuple[int, int]] = deque()  # (seq, index) not yet played, in order
        self._playing = False
        self._hold_until: float | None = None  # stopped: when the queued chunk starts
        self._next_due = 0.0  # playing: when the next frame is due
        self._calm_since = 0.0  # the last underrun, shrink or start
        self._early = 0.0  # seconds still to take back (a shrink)
        self._live = True  # an empty queue is an underrun only while the stream is live
        self._levels: deque[float] = deque(maxlen=LEVEL_WINDOW)  # each of the last chunks' wait as it came (s)
        self.taken_back = 0  # chunks whose arrival took time back (a queue above target + ahead)
        self.shown: list[Shown] = []

    @property
    def queued(self) -> int:
        """Frames waiting to play."""
        return len(self._queue)

    def arrive(self, seq: int, frames: int, now: float, first: int = 0) -> float | None:
        """A chunk of ``frames`` frames is decoded at ``now``: queue it, and say when its first frame
        plays (None: it has none). Later arrivals never move that instant; a :meth:`supersede` may.

        ``first`` > 0: these are the chunk's frames from ``first`` on, the rest of a chunk that came in
        parts (its first part came with ``first`` 0); they queue behind its frames before them."""
        self.advance(now)
        if frames and self._playing and first == 0:
            # the wait of this chunk's first frame: behind every frame queued, less what is being taken back
            self._levels.append(self._next_due - now + len(self._queue) * self.frame - self._early)
            excess = min(self._levels) - (self.target + self.ahead) * self.frame
            if len(self._levels) == LEVEL_WINDOW and excess > 1e-9:
                self._early += min(excess, self.frame)
                self.taken_back += 1
        self._queue.extend((seq, first + index) for index in range(frames))
        if not self._playing and self._hold_until is None and self._queue:
            self._hold_until = now + self.target * self.frame
        return self.first_played(seq) if frames and first == 0 else None

    def set_live(self, live: bool, now: float) -> None:
        """The stream stops (a dropped socket: running dry then is no underrun) or goes on, at ``now``."""
        self.advance(now)
        self._live = live

    def supersede(self, seq: int, now: float) -> int:
        """Remove chunk ``seq``'s frames that have not played by ``now``; how many were removed."""
        self.advance(now)
        before = len(self._queue)
        self._queue = deque(item for item in self._queue if item[0] != seq)
        removed = before - len(self._queue)
        if not self._queue and not self._playing:
            self._hold_until = None
        return removed

    def first_played(self, seq: int) -> float | None:
        """When chunk ``seq``'s first queued frame plays if nothing else arrives (None: none queued)."""
        if all(item[0] != seq for item in self._queue):
            return None
        ahead = copy.copy(self)
        ahead._queue = deque(self._queue)
        ahead.shown = []
        while not ahead.shown or ahead.shown[-1].seq != seq:
            ahead._play_one()
        return ahead.shown[-1].at

    def advance(self, now: float) -> None:
        """Play every frame due by ``now`` (an empty queue at a due frame is an underrun)."""
        while True:
            if not self._playing:
                if self._hold_until is None or self._hold_until > now:
                    return
            elif self._next_due > now:
                return
            self._play_one()

    def _play_one(self) -> None:
        """The next thing that happens: the held chunk starts, a frame plays, or an underrun."""
        if not self._playing:
            assert self._hold_until is not None
            self._playing = True
            self._next_due = self._hold_until
            self._hold_until = None
            if not self.shown and not self.underruns:
                self._calm_since = self._next_due
        at = self._next_due
        if not self._queue:  # due, and nothing here: stop; the next chunk waits the grown target
            self._playing = False
            if not self._live:
                return
            self.underruns += 1
            self._levels.clear()
            self.target = min(self.cap, self.target + 1)
            self.most = max(self.most, self.target)
            self._calm_since = at
            self._early = 0.0
            return
        seq, index = self._queue.popleft()
        self.shown.append(Shown(seq, index, at))
        if at - self._calm_since >= self.shrink_after and self.target > self.start:
            self.target = max(self.start, self.target - 1)
            self._calm_since = at
            self._early += self.frame
        step = min(self._early, self.frame / 2)
        self._early -= step
        self._next_due = at + self.frame - step
