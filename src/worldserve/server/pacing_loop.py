"""One world's pacing loop: the task that issues its ticks when the latency policy says, and preempts.

Owns: :class:`PacingLoop`, the generation task of one session and every decision of the latency
policy that needs time to pass: when each tick goes (:class:`~.pacing.Pacer`'s plan on the
worker's chunk clock, or on its own), when it waits (backpressure: the world says it is held
back; a failed session waits for a reset or close), how a chunk made is counted (late), and
preemption (:class:`~.pacing.Preempt`): an accepted event that finds the tick in flight without
it cancels that tick, or one that finds the chunk made last without it (sent, not yet playing)
has it undone and made again at once; the replacement names the chunk it supersedes. At most
once per chunk, never the epoch's first, and never a chunk whose inputs the new ones would hide
(:class:`~worldserve.session.EventReach`: the same track, or a prompt each): a key tapped and
released shows, but a camera move may join the chunk that holds a key. The chunk made again takes
exactly the events the decision saw (``next_chunk(through=...)``): one that comes meanwhile waits
for the next chunk, so it cannot hide them either.

The world around it (:class:`World`: in the server, :class:`~.host.WorldHost`) owns who watches:
its members' lag (``held_back``), when a member's acks say a chunk begins to play (``plays_at``),
whether a chunk sent may still be replaced (``replaceable``: no H.264 member, not sent in parts), whether
the chunk in flight has frames out (``parts_out``: then it is not cancelled), when a chunk made could
begin to play (``playable``: its commit, or sooner when it went out in parts), sending a chunk
made (``send``, which gives back its seq) and taking one back from members, encoders and the
replay buffer (``undo``). The loop calls those and nothing else of it, so tests drive it with
a recorder of those calls, a session and a clock they move (``tests/test_pacing_loop.py``).

Must not know: sockets, members, media, message types.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from worldserve.errors import (
    CancelUnsupportedError,
    ChunkCancelledError,
    NothingToCancelError,
)
from worldserve.runtime.chunk import Chunk
from worldserve.server.metrics import ServerMetrics
from worldserve.server.pacing import Lead, Pacer, Preempt
from worldserve.session import EventReach, Session, SessionError, SessionStateError, SessionStatus

__all__ = ["PacingLoop", "TickClock", "World"]

log = logging.getLogger("worldserve.server")

#: Recent chunks whose acks still tell the pacer when playback is.
_SENT_KEPT = 64


class TickClock(Protocol):
    """What the loop asks of the runtime: the worker's chunk clock and its headroom."""

    def tick_due(self, session_id: str, want: float | None, *, eager: bool = False, due: float | None = None) -> float:
        """When the session's next tick should be issued (its worker's chunk clock); ``due``: when its chunk plays."""
        ...

    def preempt_cost(self, session_id: str) -> float | None:
        """The step time of the session made once more, when its worker grants that extra step now
        (a preemption), else None."""
        ...


class World(Protocol):
    """What the loop asks of the world it paces (see the module docstring)."""

    def held_back(self) -> bool:
        """Backpressure: wait (nobody controlling is connected, or they lag)."""
        ...

    def plays_at(self, seq: int, paced: float | None) -> float | None:
        """When chunk ``seq`` begins to play, given the pacer's instant ``paced`` (None: not known, or
        someone shows it already)."""
        ...

    def replaceable(self) -> bool:
        """Whether a chunk already sent may still be replaced (an H.264 member may have decoded it)."""
        ...

    def report_failure(self) -> None:
        """The session failed (a tick, or an undo): tell its members."""
        ...

    def parts_out(self) -> bool:
        """Whether the chunk in flight has frames out already (sent in parts): it is not cancelled then."""
        ...

    def playable(self, epoch: int, chunk_index: int, committed: float) -> float:
        """When the chunk committed at ``committed`` could begin to play for every connected member (sooner
        where its frames went out in parts as they were made)."""
        ...

    async def send(self, chunk: Chunk, epoch: int, *, started: float, committed: float, supersedes: int | None) -> int:
        """Hand a committed chunk to the members; its seq."""
        ...

    def undo(self, seq: int) -> None:
        """Chunk ``seq``, the last sent, was undone: its events are pending again for the members, and
        nothing of it stays buffered or encoded."""
        ...

    def hold_chunk(self, seq: int) -> None:
        """Chunk ``seq`` is being undone: no member may begin to play it until it is replaced or released."""
        ...

    def release_chunk(self, seq: int) -> None:
        """The undo of chunk ``seq`` did not happen: it may play."""
        ...


@dataclass(frozen=True, slots=True)
class _Sent:
    """The chunk sent last, while a preemption may undo it."""

    seq: int
    epoch: int
    chunk_index: int
    reach: EventReach  # what its events change: newer ones that change the same keep out of it
    step_s: float  # its share of its batch's model time: the step-seconds an undo wastes


class PacingLoop:
    """One session's generation task; see the module docstring."""

    def __init__(
        self,
        session: Session[Chunk],
        world: World,
        clock_of_ticks: TickClock,
        *,
        period: float,
        lead: Lead,
        preempt: Preempt,
        metrics: ServerMetrics,
        chunk_clock: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session = session
        self._world = world
        self._ticks = clock_of_ticks
        self._metrics = metrics
        self._chunk_clock = chunk_clock
        self._clock = clock
        #: Playback pacing (pacing.py): when each tick goes, when its chunk plays, late chunks.
        self.pacer = Pacer(period, lead, session.epoch)
        #: Preemption on input (pacing.py): whether an event makes the chunk without it again.
        self.preempt = preempt
        #: Called right before each tick is issued (after pacing): what the next chunk applies is
        #: decided there by a route that schedules events per chunk (``/v1/realtime/video``).
        self.before_tick: Callable[[Session[Chunk]], Awaitable[None]] | None = None
        self.stopping = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._tick_due: float | None = None  # when the chunk being made plays (None: not known)
        self._tick_started = 0.0
        self._tick_reach = EventReach()  # what the events of the tick in flight change
        self._last: _Sent | None = None  # the chunk sent last, while a preemption may undo it
        self._sent: OrderedDict[int, tuple[int, int]] = OrderedDict()  # recent seqs -> (epoch, chunk index)
        self._seq = -1  # the seq of the chunk sent last (an undone one too: its replacement gets the next)
        self._preempted: tuple[int, int] | None = None  # (epoch, chunk index) preempted last: once a chunk
        self._undo_wanted: int | None = None  # the seq of the chunk to undo between ticks (an event came for it)
        self._superseded: int | None = None  # the seq the next chunk sent replaces
        self._redo = False  # the next tick makes a preempted chunk again: at once ...
        self._redo_through: int | None = None  # ... with the events up to this id (what its decision saw)

    # -- the task --------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"generate-{self.session.session_id}")

    def wake(self) -> None:
        """Something the pacing depends on changed (an ack, a member, a reset, a drained socket): look again."""
        self._wake.set()

    async def stop(self, grace: float) -> None:
        """Stop after the tick in flight, within ``grace`` seconds; else cancel the task."""
        self.stopping = True
        self._wake.set()
        task, self._task = self._task, None
        if task is None:
            return
        if grace > 0:
            await asyncio.wait({task}, timeout=grace)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _wait(self, timeout: float | None) -> None:
        """Sleep until woken or ``timeout`` passes."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    def _tick_target(self, want: float | None, *, eager: bool, due: float | None) -> float:
        """When to issue the next tick: on the worker's chunk clock, or at ``want`` without it."""
        if self._chunk_clock:
            try:
                return self._ticks.tick_due(self.session.session_id, want, eager=eager, due=due)
            except Exception:  # the runtime is going away: pace alone; the tick reports why
                log.debug("no chunk clock for session %s", self.session.session_id, exc_info=True)
        return self._clock() if want is None else want

    async def _run(self) -> None:
        """Produce chunks paced to playback, with backpressure, until stopped."""
        session, pacer, world = self.session, self.pacer, self._world
        while not self.stopping:
            if session.status is not SessionStatus.ACTIVE:
                await self._wait(None)  # failed: wait for a reset (or close)
                continue
            if self._undo_wanted is not None:
                await self._undo_last()  # preemption: an event came for the chunk sent last
                continue
            if world.held_back():
                await self._wait(None)  # backpressure: the controllers lag, or none is connected
                continue
            if session.epoch != pacer.epoch:
                pacer.restart(session.epoch)
            plan = pacer.plan(self._clock())  # playback pacing (pacing.py): when to tick, when it plays
            through: int | None = None
            if self._redo:  # a preemption's chunk goes at once, off the clock's instants: it has a deadline
                self._redo, target = False, self._clock()
                through, self._redo_through = self._redo_through, None
            else:
                target = self._tick_target(plan.want, eager=plan.eager, due=plan.due)
            if target > self._clock():
                await self._wait(target - self._clock())
                if self.stopping or session.epoch != pacer.epoch or self._undo_wanted is not None:
                    continue
                if self._clock() < target:
                    continue  # woken early (an ack): wait out the rest
            if self.before_tick is not None:
                try:
                    await self.before_tick(session)
                except Exception:
                    log.exception("session %s: the route's before-tick step failed", session.session_id)
            started = self._tick_started = self._clock()
            self._tick_due, self._undo_wanted = plan.due, None  # this tick takes every event accepted so far
            if through is None:  # every event accepted so far, and no later one (the lock may be waited for)
                through = session.pending_event_ids[-1] if session.pending_event_count else -1
            self._tick_reach = session.pending_reach(through=through)
            try:
                chunk = await session.next_chunk(through=through)
            except SessionStateError:
                continue  # a reset or close got in first
            except ChunkCancelledError:
                continue  # chunk.cancel or a preemption: the session is back at its last commit; again
            except Exception:
                world.report_failure()
                continue
            epoch = session.epoch
            finished = self._clock()
            ready = world.playable(epoch, chunk.metadata.chunk_index, finished)
            if pacer.made(epoch, started, ready):
                self._metrics.late_chunks.inc()
            supersedes, self._superseded = self._superseded, None
            seq = self._seq = await world.send(chunk, epoch, started=started, committed=finished, supersedes=supersedes)
            metadata = chunk.metadata
            self._sent[seq] = (epoch, chunk.metadata.chunk_index)
            if len(self._sent) > _SENT_KEPT:
                self._sent.popitem(last=False)
            self._last = _Sent(
                seq,
                epoch,
                metadata.chunk_index,
                reach=self._tick_reach,
                step_s=chunk.compute_s / max(1, chunk.batch_size),
            )

    def played(self, seq: int, at: float) -> None:
        """A controller acked chunk ``seq`` (its first frame shown) at ``at``: the pacer learns when playback is."""
        sent = self._sent.get(seq)
        if sent is not None and sent[0] == self.pacer.epoch:
            self.pacer.played(sent[1], at)

    # -- preemption (pacing.py's Preempt) ------------------------------------------------

    async def consider_preempt(self) -> None:
        """An event was accepted: if the chunk made, or being made, without it has not begun to play
        and can be made again in time, have it made again with the event (once per chunk)."""
        session = self.session
        if not self.preempt.enabled or session.status is not SessionStatus.ACTIVE or self.stopping:
            return
        epoch, now = session.epoch, self._clock()
        in_flight = session.chunk_in_flight
        if in_flight is not None:
            if in_flight == 0 or self._preempted == (epoch, in_flight) or self._hides(self._tick_reach):
                return
            if self._world.parts_out():
                return  # its first frames are out: they may be playing
            due = self._world.plays_at(self._seq + 1, self._tick_due)
            if not self.preempt.worth(now, due, self._preempt_cost()):
                return
            through = session.pending_event_ids[-1]  # the events this decision saw (cancel awaits)
            try:
                await session.cancel_chunk()
            except SessionError:
                return  # done already, or it cannot be cancelled: the event goes into the next chunk
            self._preempted = (epoch, in_flight)
            self._redo, self._redo_through = True, through
            self._metrics.preempted_chunks.labels(how="cancelled").inc()
            self._metrics.preempt_wasted.inc(max(0.0, now - self._tick_started))
            return
        last = self._last
        if self._undo_wanted is not None or last is None or self._preempted == (epoch, last.chunk_index):
            return
        if not self._world.replaceable():
            return  # a fragment sent may be decoded already: an H.264 member's chunk is never replaced
        if self._undoable(last, now):
            self._undo_wanted = last.seq  # the loop undoes it between ticks (pacing stays its own)
            self._wake.set()

    def _undoable(self, last: _Sent, now: float) -> bool:
        """Whether ``last``, the chunk sent last, can still be undone and made again before it plays."""
        session = self.session
        if last.epoch != session.epoch or last.chunk_index == 0 or session.chunk_retractable != last.chunk_index:
            return False
        if self._hides(last.reach):
            return False
        due = self._world.plays_at(last.seq, self.pacer.due_of(last.chunk_index))
        return self.preempt.worth(now, due, self._preempt_cost())

    def _hides(self, reach: EventReach) -> bool:
        """Whether the events accepted since a chunk's tick would hide what that chunk's own events change, were
        they made one chunk (their controls win on a track both set: a key tapped and released would never show)."""
        session = self.session
        return reach.overlaps(session.pending_reach(above=session.event_floor))

    def _preempt_cost(self) -> float | None:
        try:
            return self._ticks.preempt_cost(self.session.session_id)
        except Exception:  # the runtime is going away: no preemption
            log.debug("no preemption cost for session %s", self.session.session_id, exc_info=True)
            return None

    async def _undo_last(self) -> None:
        """Undo the chunk sent last: the session, the pacer and the world go back to before it, so the
        next tick makes it again with the events since; that chunk supersedes it."""
        wanted, self._undo_wanted = self._undo_wanted, None
        last = self._last
        if last is None or last.seq != wanted or not self._undoable(last, self._clock()):
            return  # another chunk since, or too late by now (the loop was busy)
        pending = self.session.pending_event_ids
        through = pending[-1] if pending else None  # the events this decision saw (the retract awaits)
        self._world.hold_chunk(last.seq)  # no track starts it while the retract awaits the worker
        try:
            await self.session.retract_chunk()
        except (NothingToCancelError, CancelUnsupportedError, SessionStateError):
            self._world.release_chunk(last.seq)
            return
        except Exception:
            self._world.release_chunk(last.seq)
            self._world.report_failure()
            return
        except BaseException:  # cancelled (the world stops): nothing is undone for it
            self._world.release_chunk(last.seq)
            raise
        self._last = None
        self._preempted = (last.epoch, last.chunk_index)
        self.pacer.unmade()
        self._world.undo(last.seq)
        self._superseded = last.seq
        self._redo, self._redo_through = True, through
        self._metrics.preempted_chunks.labels(how="undone").inc()
        self._metrics.preempt_wasted.inc(last.step_s)
