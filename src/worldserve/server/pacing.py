"""One world's playback pacing: when its next tick should go, and when that chunk plays.

Owns: :class:`Lead` (how far ahead of playback a world generates: ``chunks`` whole periods,
today's rule, or ``jit``: just in time) and :class:`Pacer`, one session's pacing state per
epoch (the playout anchor, chunks made, late chunks), which :class:`~.host.WorldHost` asks
before every tick (:meth:`Pacer.plan`) and tells after every commit (:meth:`Pacer.made`).

The two leads, with C the chunk period and G the step (tick issued -> chunk committed):

- ``chunks=N`` (N >= 1): chunk k is wanted N periods before it plays; the N chunks right
  after the first go at once (``eager``: they build the lead). A key waits for the next
  tick (C/2 on average), then behind the N chunks made before it: about (N + 1/2) C + G
  from key to screen, and a step may be up to N C late before anyone sees it.
- ``jit``: no chunk is made ahead. Chunk k's tick goes at the first chunk's tick + k C (the
  worker's chunk-clock instants, so batching is unchanged) and plays one *margin* after it
  is due to be ready: the first chunk's commit + ``margin_s`` + k C. A key then waits C/2 +
  G + the margin. A chunk that still comes after its playout instant stalls the viewer by
  that much; the pacer moves the playout anchor by the same amount (the lead grows only
  as far as that step's jitter demanded) and counts it; the players' acks bring it back as
  their jitter buffers take the stall back (:meth:`Pacer.played`). A viewer that fell more than one
  period behind (a stall of the whole world) is re-anchored as with ``chunks``.

:class:`Preempt` is the third piece of the latency policy: an input that comes after the
tick of a chunk that does not have it, while that chunk has not begun to play, makes it
again with the input (undone if it was made and sent, cancelled while it is being made),
when the new one can still be ready ``margin_s`` before its playout instant and its worker
grants the extra step (its headroom; the engine's ``preempt_cost``). At most once per chunk:
fast input cannot keep one chunk from being made. A chunk is made again only when the new input
hides none of its own (:class:`~worldserve.session.EventReach`: no track set by both, not a
prompt each): a key tapped and released shows, never merged into one chunk with its release,
while a camera move may join the chunk that holds a key. With ``chunks=1`` a key then waits about
C/2 + G instead of 1.5 C + G, while the chunk it lands in has not begun to play.

Pure: the caller passes the time. Must not know: asyncio, sockets, sessions, the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lead", "Pacer", "Preempt", "TickPlan"]


@dataclass(frozen=True, slots=True)
class Lead:
    """How far ahead of playback a world generates: ``chunks`` periods, or just in time (``chunks`` 0)."""

    #: Whole chunk periods made ahead of playback; 0: just in time (``margin_s`` instead).
    chunks: int = 1
    #: ``jit``: how long after a chunk is due to be ready it plays (the viewer's jitter slack).
    margin_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 0:
            raise ValueError(f"lead chunks must be a non-negative integer; got {self.chunks!r}.")
        if not self.margin_s >= 0:
            raise ValueError(f"lead margin must be non-negative seconds; got {self.margin_s!r}.")

    @property
    def jit(self) -> bool:
        return self.chunks == 0

    def describe(self) -> str:
        if self.jit:
            return f"just in time (a margin of {self.margin_s * 1000:.0f} ms)"
        return f"{self.chunks} chunk{'s' if self.chunks != 1 else ''} ahead"


@dataclass(frozen=True, slots=True)
class Preempt:
    """Whether an input may have a chunk made without it made again (see the module docstring)."""

    #: ``--preempt auto`` and a model that can roll a session back.
    enabled: bool = True
    #: The new chunk must be ready this long before its playout instant (transfer and decode).
    margin_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.margin_s >= 0:
            raise ValueError(f"preempt margin must be non-negative seconds; got {self.margin_s!r}.")

    def worth(self, now: float, due: float | None, cost: float | None) -> bool:
        """Whether a chunk that plays at ``due`` can be made again (a step of ``cost`` seconds; None: its
        worker has no headroom) by then, starting ``now``."""
        return self.enabled and due is not None and cost is not None and now + cost + self.margin_s <= due


@dataclass(frozen=True, slots=True)
class TickPlan:
    """When the next tick should go (None: as soon as the worker's clock allows: the first of an
    epoch), when its chunk plays (None: not known yet), and whether it builds the lead (eager)."""

    want: float | None
    due: float | None
    eager: bool


class Pacer:
    """One session's pacing through its epochs (a reset starts a new one: its first chunk anchors it)."""

    __slots__ = ("_anchor", "_first_tick", "epoch", "late", "lead", "period", "produced", "stalled_s")

    def __init__(self, period: float, lead: Lead, epoch: int = 0) -> None:
        if not period > 0:
            raise ValueError(f"period must be positive; got {period!r}.")
        self.period = float(period)
        self.lead = lead
        self.epoch = epoch
        self.produced = 0  # chunks of this epoch so far
        self._anchor: float | None = None  # when chunk 0 of this epoch plays
        self._first_tick = 0.0  # jit: when chunk 0's tick went (the grid of later ticks)
        #: jit: chunks committed after their playout instant, and the seconds they stalled playback.
        self.late = 0
        self.stalled_s = 0.0

    def restart(self, epoch: int) -> None:
        """A new epoch (reset): the next chunk anchors playback again."""
        self.epoch, self._anchor, self.produced = epoch, None, 0

    def plan(self, now: float) -> TickPlan:
        """The next tick's plan; re-anchors playback first if the world fell a period behind."""
        if self._anchor is None:
            return TickPlan(None, None, eager=False)
        period, lead = self.period, self.lead
        if lead.jit:
            want = self._first_tick + self.produced * period
            due = self._anchor + self.produced * period
        else:
            due = self._anchor + self.produced * period
            want = due - lead.chunks * period
        behind = now - want
        if behind > period:  # fell behind real time (held back, a slow step): re-anchor playback
            self._anchor += behind
            self._first_tick += behind
            want += behind
            due += behind
        eager = not lead.jit and 0 < self.produced <= lead.chunks
        return TickPlan(want, due, eager)

    def due_of(self, index: int) -> float | None:
        """When this epoch's chunk ``index`` plays (None: before the first chunk anchored playback)."""
        return None if self._anchor is None else self._anchor + index * self.period

    def played(self, index: int, at: float) -> None:
        """A player showed this epoch's chunk ``index`` at ``at`` or before (its ack came then). ``jit``: playback
        is no later than that, so the anchor comes back to it where a late chunk pushed it further (a
        player's jitter buffer takes back its stall once the stream is steady): a chunk is late again
        when it comes after the instant its viewers play it, not after one that only ever grew."""
        if not self.lead.jit or self._anchor is None or index < 0:
            return
        self._anchor = min(self._anchor, at - index * self.period)

    def unmade(self) -> None:
        """The last chunk made was undone (a preemption): it is to be made again, at its own instant.
        Never the epoch's first (it anchors playback, which it begins on arrival: nothing to preempt)."""
        if self.produced < 2:
            raise ValueError("only a chunk after an epoch's first can be undone.")
        self.produced -= 1

    def made(self, epoch: int, started: float, finished: float) -> bool:
        """A chunk of ``epoch`` committed: its tick went at ``started``, its chunk was ready at ``finished``.
        True when it was late (``jit``: ready after its playout instant; the viewer stalled)."""
        late = False
        if self._anchor is None or epoch != self.epoch:
            self.epoch, self.produced = epoch, 0
            self._first_tick = started
            self._anchor = finished + (self.lead.margin_s if self.lead.jit else 0.0)
        elif self.lead.jit:
            due = self._anchor + self.produced * self.period
            late = finished > due
            if late:  # the viewer waited for it: playback goes on that much later
                self.late += 1
                self.stalled_s += finished - due
                self._anchor += finished - due
        self.produced += 1
        return late
