"""The engine: the control plane's ``TickConsumer`` and ``collective_rpc`` (vLLM's engine core).

Owns: the event-loop side of the runtime -- affinity (a session's ticks reach the
worker holding its state), continuous batching (one
:class:`~worldserve.runtime.scheduler.BatchQueue` per worker, one step in flight per
worker), driving each worker's tick gathering (:mod:`~worldserve.runtime.gathering`: the
chunk clock its paced sessions issue ticks at, stretched when the worker falls behind,
and the step times admission weighs against the period), tick deadlines (a late tick
fails at once, its session fails closed), hung-worker kills, worker deaths (only the
dead worker's sessions fail, with ``worker_died``, and a replacement starts),
cancelling a tick (``cancel_tick``: a
queued one leaves its queue; a running one's result is discarded and its worker told
to roll the state back before any later call), a tick's chunk parts (``execute_tick``'s
``on_part``: the frames of a model with ``spec.frame_parts`` as its worker makes them, each
heard on the loop before the chunk; none once the tick is done, failed or cancelled), lifecycle RPCs in the shape
:class:`~worldserve.lifecycle.WorkerLifecycle` accepts, and the engine counters. It
delegates placing sessions to :class:`~worldserve.runtime.admission.Admission`.

Nothing here computes or blocks: model work runs behind the executor.
Must not know: how workers are reached (the executor's), what a state holds (the
runner's), events and their ordering (the session's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from worldserve.errors import (
    CancelUnsupportedError,
    ChunkCancelledError,
    NothingToCancelError,
    RuntimeFailure,
    SessionExistsError,
)
from worldserve.lifecycle import CLOSE_SESSION_RPC, RESET_SESSION_RPC
from worldserve.media import EncodedFrames, FrameEncoding
from worldserve.models.base import ModelSpec, SessionOptions
from worldserve.protocol import ChunkMetadata, TickRequest
from worldserve.runtime.admission import Admission
from worldserve.runtime.chunk import Chunk
from worldserve.runtime.errors import (
    DeadlineExceededError,
    RuntimeClosedError,
    TickFailedError,
    WorkerDiedError,
    error_from_code,
)
from worldserve.runtime.executor.abstract import Executor
from worldserve.runtime.gathering import Gathering
from worldserve.runtime.messages import ROLLBACK_SESSION_RPC, ChunkPart, StepReport, TickOutput
from worldserve.runtime.metrics import Capacity, EngineCounters, EngineStats
from worldserve.runtime.router import Router
from worldserve.runtime.runner import ADMIT, REQUEST_KEYFRAME_RPC, SET_EXTRA_ENCODINGS_RPC, STEP
from worldserve.runtime.scheduler import BatchQueue, Queued
from worldserve.session import SessionStateError

__all__ = ["Engine", "EngineConfig"]

_log = logging.getLogger(__name__)

#: Runner methods only the engine may call (they would bypass batching, affinity and admission).
_ENGINE_ONLY = frozenset({STEP, ADMIT, ROLLBACK_SESSION_RPC, REQUEST_KEYFRAME_RPC, SET_EXTRA_ENCODINGS_RPC})


def _optional_positive(value: float | None, name: str) -> None:
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be positive or None; got {value!r}.")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine schedules.

    ``batch_wait_s``: the longest an idle worker's tick waits for company;
    ``max_batch_size``: cap below the model's own limit (None: the model's);
    ``gather_wait_s``: on a worker whose chunk clock runs, the longest the batch of an
    instant waits for the sessions due at it (counted from the instant, or from the end
    of a step that ran past it); ``step_budget``: the share of the chunk
    period a clocked worker's predicted step (with one more session) may take for it to
    admit another session;
    ``tick_deadline_s``: a tick not done by then fails its session (None: never);
    ``hang_timeout_s``: a step running this long gets its worker killed and replaced
    (None: never); ``rpc_timeout_s``: the default timeout of admissions, resets and
    broadcasts; ``restart_workers``: replace a worker that died, retrying a failed start
    after ``restart_backoff_s``, doubling up to ``restart_backoff_max_s``, until it
    starts; ``stall_after_s``: a worker whose step has run longer than this (or past a
    tick's deadline) is *stalled*: placement skips it.
    """

    batch_wait_s: float = 0.002
    max_batch_size: int | None = None
    gather_wait_s: float = 0.02
    step_budget: float = 0.9
    tick_deadline_s: float | None = 30.0
    hang_timeout_s: float | None = None
    rpc_timeout_s: float | None = 60.0
    restart_workers: bool = True
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 10.0
    stall_after_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.batch_wait_s, bool) or not self.batch_wait_s >= 0:
            raise ValueError(f"batch_wait_s must be non-negative; got {self.batch_wait_s!r}.")
        if self.max_batch_size is not None and (
            isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1
        ):
            raise ValueError(f"max_batch_size must be a positive integer or None; got {self.max_batch_size!r}.")
        if isinstance(self.gather_wait_s, bool) or not self.gather_wait_s >= 0:
            raise ValueError(f"gather_wait_s must be non-negative; got {self.gather_wait_s!r}.")
        if isinstance(self.step_budget, bool) or not self.step_budget > 0:
            raise ValueError(f"step_budget must be positive; got {self.step_budget!r}.")
        _optional_positive(self.tick_deadline_s, "tick_deadline_s")
        _optional_positive(self.hang_timeout_s, "hang_timeout_s")
        _optional_positive(self.rpc_timeout_s, "rpc_timeout_s")
        for name in ("restart_backoff_s", "restart_backoff_max_s", "stall_after_s"):
            _optional_positive(getattr(self, name), name)


class _Tick:
    """One tick from ``execute_tick`` until its chunk (or error) is delivered."""

    __slots__ = ("dispatched", "future", "on_part", "tick", "timer")

    def __init__(
        self, tick: TickRequest, future: asyncio.Future[Chunk], on_part: Callable[[ChunkPart], None] | None = None
    ) -> None:
        self.tick = tick
        self.future = future
        self.on_part = on_part
        self.dispatched = -1.0
        self.timer: asyncio.TimerHandle | None = None


class _Worker:
    """One worker as the engine sees it."""

    __slots__ = (
        "gathering",
        "hang_timer",
        "index",
        "overdue",
        "preempted",
        "queue",
        "ready",
        "running",
        "timer",
    )

    def __init__(self, index: int, queue: BatchQueue[_Tick], period: float) -> None:
        self.index = index
        self.queue = queue
        self.gathering = Gathering(period)  # its chunk clock, step times and paced sessions
        self.running: list[Queued[_Tick]] | None = None  # the batch in flight
        self.timer: asyncio.TimerHandle | None = None  # wakes a waiting batch
        self.hang_timer: asyncio.TimerHandle | None = None
        self.ready = False
        self.overdue = False  # a tick of the step in flight missed its deadline
        self.preempted: deque[float] = deque()  # when its recent steps made twice were made (preempt_cost)

    def stalled(self, now: float, stall_after_s: float) -> bool:
        """Whether the step in flight is overdue (an admission would wait behind it): one of its
        ticks missed its deadline, or it has run past ``stall_after_s``."""
        running = self.running
        return running is not None and (self.overdue or now - running[0].item.dispatched > stall_after_s)

    def pinned(self) -> frozenset[str]:
        """Sessions with a tick queued for, or running on, this worker (never evicted)."""
        ids = {entry.item.tick.session_id for entry in self.queue}
        if self.running is not None:
            ids.update(entry.item.tick.session_id for entry in self.running)
        return frozenset(ids)


class Engine:
    """Schedules ticks of many sessions onto the executor's workers."""

    def __init__(self, executor: Executor, config: EngineConfig | None = None) -> None:
        self._executor = executor
        self.config = config or EngineConfig()
        self._router = Router(executor.num_workers)
        self._workers: list[_Worker] = []
        self._counters = EngineCounters()
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._admission: Admission | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = "new"
        self._lost = asyncio.Event()
        self._part_listeners: dict[str, Callable[[ChunkPart], None]] = {}

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def spec(self) -> ModelSpec:
        return self._executor.spec

    @property
    def num_workers(self) -> int:
        return self._executor.num_workers

    @property
    def lost(self) -> WorkerDiedError | None:
        """Why no worker can run any more (the executor's cluster is gone), or None."""
        return self._executor.lost

    async def wait_lost(self) -> WorkerDiedError:
        """Wait until no worker can run any more (every session of the engine failed ``worker_died``)."""
        await self._lost.wait()
        lost = self._executor.lost
        assert lost is not None
        return lost

    async def start(self) -> None:
        if self._state != "new":
            raise SessionStateError(f"the engine cannot start: it is {self._state}.")
        self._loop = asyncio.get_running_loop()
        self._executor.on_worker_death = self._on_worker_death
        self._executor.on_lost = lambda error: self._lost.set()
        self._state = "starting"
        await self._executor.start()
        limit = min(self.spec.max_batch_size, self.config.max_batch_size or self.spec.max_batch_size)
        self._workers = [
            _Worker(
                index, BatchQueue(batch_limit=limit, batch_wait_s=self.config.batch_wait_s), self.spec.chunk_seconds
            )
            for index in range(self.num_workers)
        ]
        for worker in self._workers:
            worker.ready = True
        self._admission = Admission(
            self._executor,
            self._router,
            self._counters,
            self._workers,
            rpc_timeout_s=self.config.rpc_timeout_s,
            stalled=self._stalled,
            retry_after_s=max(self.config.restart_backoff_s, self.spec.chunk_seconds),
            headroom=self._headroom_refusal,
        )
        self._state = "running"

    async def shutdown(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        for task in self._restarts.values():
            task.cancel()
        closed = RuntimeClosedError("the runtime is shut down.")
        for worker in self._workers:
            self._cancel_timers(worker)
            for entry in worker.queue.drain():
                _fail(entry.item, closed)
        await self._executor.shutdown()

    def _require_running(self) -> asyncio.AbstractEventLoop:
        if self._state != "running" or self._loop is None:
            raise RuntimeClosedError(f"the engine is {self._state}; start it first (or it was shut down).")
        return self._loop

    # -- the TickConsumer ----------------------------------------------------------------

    async def execute_tick(self, tick: TickRequest, on_part: Callable[[ChunkPart], None] | None = None) -> Chunk:
        """Run one tick on the worker holding its session's state; the chunk or a coded error.

        ``on_part`` hears the chunk's frames in parts while the worker makes them, where the model
        (``spec.frame_parts``), the session's encoding (none, JPEG or raw) and the executor allow; the
        parts joined are the chunk's frames. A part is no commit: the tick may still fail after one.
        Without ``on_part``, the session's listener (:meth:`listen_parts`) hears them, if it has one.
        """
        loop = self._require_running()
        self._counters.ticks += 1
        route = self._router.find(tick.session_id)
        if route is None or route.worker is None:
            error = self._router.unknown(tick.session_id) if route is None else route.not_resident_error()
            self._counters.tick_failures[error.code] += 1
            raise error
        worker = self._workers[route.worker]
        worker.gathering.arrived(tick.session_id)
        pending = _Tick(tick, loop.create_future(), on_part or self._part_listeners.get(tick.session_id))
        entry = worker.queue.push(pending, loop.time())
        deadline = self.config.tick_deadline_s
        if deadline is not None:
            pending.timer = loop.call_later(deadline, self._expire, worker, entry)
        self._schedule(worker)
        try:
            return await pending.future
        except asyncio.CancelledError:
            worker.queue.discard(entry)
            raise
        finally:
            if pending.timer is not None:
                pending.timer.cancel()

    def chunk_metadata(self, output: Chunk) -> ChunkMetadata:
        return output.metadata

    # -- the chunk clock -----------------------------------------------------------------

    def tick_due(self, session_id: str, want: float | None, *, eager: bool = False, due: float | None = None) -> float:
        """The instant (the event loop's clock) at which the session should issue its next tick.

        ``want``: when the session's own playback pacing would issue it; None for the first
        tick of a session or of an epoch, which waits for its worker's next instant (at most
        one chunk period; at once when no other session lives on the worker). ``eager``: the
        tick builds the session's lead (the chunk right after the first) and may go at once.
        ``due``: when the chunk plays (None: as soon as it can); the engine lets a tick off
        the instants (a lead chunk, a straggler) delay an instant's batch only as far as
        every session's chunk in it stays ready by its playout instant.
        Sessions that ask share their worker's chunk clock, so their ticks arrive together
        and run as one batch (:func:`~worldserve.runtime.clock.tick_instant`). A session that
        holds no state gets ``want`` (or now): its tick fails at once anyway.
        """
        loop = self._require_running()
        now = loop.time()
        route = self._router.find(session_id)
        if route is None or route.worker is None:
            return now if want is None else max(now, want)
        worker = self._workers[route.worker]
        alone = self._router.resident_count(worker.index) <= 1
        instant, waited = worker.gathering.ask(session_id, now, want, eager=eager, due=due, alone=alone)
        if waited:
            self._schedule(worker)  # a batch may have been waiting for this session
        return instant

    def _headroom_refusal(self, index: int, more: int = 1) -> str | None:
        """Why a clocked worker should not hold ``more`` sessions than now (its step would outgrow the
        period), or None."""
        worker = self._workers[index]
        load = self._router.load(index)
        clock = worker.gathering.clock
        if not clock.started or load == 0:
            return None  # an empty worker takes a session (and measures it)
        predicted = worker.gathering.steps.predict(load + more)
        budget = clock.nominal * self.config.step_budget
        if predicted is None or predicted <= budget:
            return None
        return (
            f"worker {index}: no real-time headroom (a step of {load + more} sessions is predicted at "
            f"{predicted * 1000:.0f} ms, over {budget * 1000:.0f} ms of the "
            f"{clock.nominal * 1000:.0f} ms period)"
        )

    def cancel_tick(self, tick: TickRequest) -> None:
        """Cancel ``tick`` (the control plane's :class:`~worldserve.session.TickCanceller`).

        Its ``execute_tick`` raises :class:`ChunkCancelledError` at once. A tick still
        queued just leaves the queue (its worker never saw it). A running one cannot be
        stopped mid-step: its result will be discarded, and its worker is told now to roll
        the session's state back to before it, which the worker does right after the step
        and before any later call (calls to a worker run in order). Refused, changing
        nothing: :class:`NothingToCancelError` when the tick is not waiting for its
        result here, :class:`CancelUnsupportedError` for a running tick when the model
        cannot roll back (``spec.can_rollback``).
        """
        self._require_running()
        route = self._router.find(tick.session_id)
        worker = None if route is None or route.worker is None else self._workers[route.worker]
        if worker is not None:
            for entry in worker.queue:
                if entry.item.tick is tick and not entry.item.future.done():
                    worker.queue.discard(entry)
                    self._cancelled(entry.item)
                    return
            for entry in worker.running or ():
                if entry.item.tick is tick and not entry.item.future.done():
                    if not self.spec.can_rollback:
                        raise CancelUnsupportedError(
                            f"model {self.spec.name!r} cannot roll a session back, so chunk {tick.chunk_index} of "
                            f"session {tick.session_id!r}, being made now, cannot be cancelled."
                        )
                    args = (tick.session_id, tick.chunk_index)
                    future = self._executor.call(worker.index, ROLLBACK_SESSION_RPC, args)
                    future.add_done_callback(self._on_rollback_done)
                    self._extra_step(tick.session_id)  # the step runs to its end for nothing
                    self._cancelled(entry.item)
                    return
        raise NothingToCancelError(
            f"chunk {tick.chunk_index} of session {tick.session_id!r} is not being made (it is done, or failed)."
        )

    async def retract_tick(self, tick: TickRequest) -> None:
        """Undo ``tick``, the session's last committed one (the control plane's
        :class:`~worldserve.session.TickRetracter`: a preemption makes its chunk again).

        The session's worker restores the snapshot it took before that step (it keeps one
        until the session's next step). Refused, changing nothing:
        :class:`CancelUnsupportedError` when the model cannot roll back or the session holds
        no state on a live worker (its next tick says why). Raises :class:`RuntimeFailure`
        when the worker could not undo it (the state is released: the session fails closed).
        """
        self._require_running()
        if not self.spec.can_rollback:
            raise CancelUnsupportedError(f"model {self.spec.name!r} cannot roll a session back.")
        route = self._router.find(tick.session_id)
        if route is None or route.worker is None or not self._executor.is_alive(route.worker):
            raise CancelUnsupportedError(f"session {tick.session_id!r} holds no state on a live worker.")
        undone = await self._executor.call(route.worker, ROLLBACK_SESSION_RPC, (tick.session_id, tick.chunk_index))
        if undone is not True:
            self._counters.rollbacks_failed += 1
            raise RuntimeFailure(
                f"chunk {tick.chunk_index} of session {tick.session_id!r} could not be undone on its worker."
            )
        self._counters.ticks_retracted += 1
        self._extra_step(tick.session_id)

    def preempt_cost(self, session_id: str) -> float | None:
        """The step time one more step of the session alone is expected to take, when its worker has the
        headroom for it, else None.

        A preemption makes a chunk twice. Its worker grants one only when, in its chunk period,
        its usual step (all its sessions' batch) and one lone step more for each step it made twice
        in the last period (a retract or a running tick cancelled), and this one, fit its step
        budget; and only once it measured both. So preemptions use only the headroom admission
        left, and fast input cannot starve the stream: they stop where real time would be lost.
        A query: asking changes nothing (the steps made twice are counted as they happen).
        """
        loop = self._require_running()
        route = self._router.find(session_id)
        if route is None or route.worker is None:
            return None
        worker = self._workers[route.worker]
        steps = worker.gathering.steps
        usual = steps.predict(max(1, self._router.load(worker.index)))
        extra = steps.predict(1)
        if usual is None or extra is None:
            return None
        now = loop.time()
        period = worker.gathering.clock.nominal
        granted = worker.preempted
        while granted and granted[0] <= now - period:
            granted.popleft()
        if usual + extra * (len(granted) + 1) > period * self.config.step_budget:
            return None
        return extra

    def _extra_step(self, session_id: str) -> None:
        """A step of the session is made twice (a preemption's retract, or a running tick cancelled):
        its worker counts it against its headroom for the next period (:meth:`preempt_cost`)."""
        route = self._router.find(session_id)
        if route is not None and route.worker is not None:
            self._workers[route.worker].preempted.append(self._require_running().time())

    def _cancelled(self, pending: _Tick) -> None:
        self._counters.ticks_cancelled += 1
        tick = pending.tick
        pending.future.set_exception(
            ChunkCancelledError(f"chunk {tick.chunk_index} of session {tick.session_id!r} was cancelled.")
        )

    def request_keyframe(self, session_id: str) -> bool:
        """Ask the session's worker to start its next encoded chunk with an IDR frame (H.264).

        Returns at once: the worker applies it before its next step (calls to a worker run
        in order), so the chunk after the one being made, at the latest, starts with it.
        ``False`` when the session holds no state on a live worker (its next chunk, after a
        reset or re-admission, starts a stream with an IDR frame anyway).
        """
        route = self._router.find(session_id)
        if self._state != "running" or route is None or route.worker is None:
            return False
        if not self._executor.is_alive(route.worker):
            return False
        future = self._executor.call(route.worker, REQUEST_KEYFRAME_RPC, (session_id,))
        future.add_done_callback(_log_media_failure)
        return True

    def set_extra_encodings(self, session_id: str, encodings: tuple[FrameEncoding, ...]) -> bool:
        """Have the session's chunks encoded in these other media too (``SessionOptions.extra_encodings``).

        Kept in the session's options (a reset or a re-admission on another worker encodes
        them too) and sent to its worker, which applies it before its next step, so the chunk
        after the one being made, at the latest, carries them. Returns at once; ``False``
        when the session is unknown or its chunks are not encoded by its worker (no
        ``encoding``).
        """
        route = self._router.find(session_id)
        if self._state != "running" or route is None or route.options.encoding is None:
            return False
        route.options = replace(route.options, extra_encodings=tuple(encodings))
        if route.worker is not None and self._executor.is_alive(route.worker):
            future = self._executor.call(
                route.worker, SET_EXTRA_ENCODINGS_RPC, (session_id, route.options.extra_encodings)
            )
            future.add_done_callback(_log_media_failure)
        return True

    def _on_rollback_done(self, done: asyncio.Future[Any]) -> None:
        # False or an error: the worker released the state (or lost it); the next tick says so.
        if done.cancelled() or done.exception() is not None or done.result() is not True:
            self._counters.rollbacks_failed += 1
            _log.warning("a cancelled chunk's state could not be rolled back: %r", done)

    # -- batching ------------------------------------------------------------------------

    def _schedule(self, worker: _Worker) -> None:
        if worker.running is not None or not worker.ready:
            return
        loop = self._require_running()
        now = loop.time()
        resident = self._router.resident_count(worker.index)
        if worker.gathering.clock.started:
            due = worker.gathering.batch_due(worker.queue, resident, now, self.config.gather_wait_s)
        else:
            due = worker.queue.due_at(resident)
        if due is None:
            return
        if due <= now:
            self._dispatch(worker)
        else:
            if worker.timer is not None:
                if worker.timer.when() <= due:
                    return
                worker.timer.cancel()
            worker.timer = loop.call_at(due, self._on_batch_timer, worker)

    def _on_batch_timer(self, worker: _Worker) -> None:
        worker.timer = None
        if self._state == "running":
            self._schedule(worker)

    def _dispatch(self, worker: _Worker) -> None:
        loop = self._require_running()
        if worker.timer is not None:
            worker.timer.cancel()
            worker.timer = None
        batch = worker.queue.take()
        now = loop.time()
        for entry in batch:
            entry.item.dispatched = now
        worker.running = batch
        worker.gathering.taken(now)
        self._counters.batches += 1
        self._counters.batch_size.observe(len(batch))
        ticks = [entry.item.tick for entry in batch]
        parted = {entry.item.tick.session_id: entry.item for entry in batch if entry.item.on_part is not None}
        future = self._executor.step(worker.index, ticks, parted, lambda part: _hand_on(parted, part))
        future.add_done_callback(lambda done: self._on_step_done(worker, batch, done))
        if self.config.hang_timeout_s is not None:
            worker.hang_timer = loop.call_later(self.config.hang_timeout_s, self._on_hang, worker, batch)

    def _on_step_done(self, worker: _Worker, batch: list[Queued[_Tick]], done: asyncio.Future[Any]) -> None:
        if worker.running is batch:
            worker.running = None
            worker.overdue = False
            if worker.hang_timer is not None:
                worker.hang_timer.cancel()
                worker.hang_timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        error = RuntimeClosedError("the runtime is shut down.") if done.cancelled() else done.exception()
        if error is not None:
            failure = error if isinstance(error, TickFailedError) else TickFailedError(f"step failed: {error!r}")
            worker.gathering.step_done((), None, now)
            for entry in batch:
                self._fail_tick(entry.item, failure)
        else:
            report: StepReport = done.result()
            worker.gathering.step_done(
                [entry.item.tick.session_id for entry in batch], now - batch[0].item.dispatched, now
            )
            overhead = max(0.0, (now - batch[0].item.dispatched) - report.compute_s - report.encode_s)
            self._counters.overhead.observe(overhead)
            for entry, result in zip(batch, report.results, strict=True):
                self._deliver(worker, entry, result, report, now)
        if self._state == "running":
            self._schedule(worker)

    def _deliver(self, worker: _Worker, entry: Queued[_Tick], result: Any, report: StepReport, now: float) -> None:
        pending = entry.item
        if isinstance(result, TickOutput):
            if pending.future.done():
                return  # expired or cancelled: its session fails closed and releases the state
            if not isinstance(result.frames, EncodedFrames):  # encoded frames are immutable bytes already
                result.frames.flags.writeable = False
            chunk = Chunk(
                frames=result.frames,
                metadata=result.metadata,
                worker=worker.index,
                batch_size=len(report.results),
                queued_s=pending.dispatched - entry.arrived,
                compute_s=report.compute_s,
                roundtrip_s=now - pending.dispatched,
                encode_s=report.encode_s,
            )
            self._counters.chunks += 1
            self._counters.tick_latency.observe(now - entry.arrived)
            pending.future.set_result(chunk)
            return
        error = error_from_code(result.code, result.message)
        # The runner released (or never had) this session's state.
        self._router.lost(pending.tick.session_id, worker.index, error)
        self._fail_tick(pending, error)

    def _fail_tick(self, pending: _Tick, error: BaseException) -> None:
        if pending.future.done():
            return
        code = getattr(error, "code", "runtime_error")
        self._counters.tick_failures[code] += 1
        pending.future.set_exception(_fresh(error))

    def _expire(self, worker: _Worker, entry: Queued[_Tick]) -> None:
        pending = entry.item
        loop = self._loop
        if pending.future.done() or loop is None or self._state != "running":
            return
        waiting = worker.queue.discard(entry)
        if not waiting:
            worker.overdue = True  # its step runs on past a deadline: place new sessions elsewhere
        where = (
            f"still queued for worker {worker.index}"
            if waiting
            else f"running on worker {worker.index} for {loop.time() - pending.dispatched:.3f} s"
        )
        self._counters.deadline_exceeded += 1
        tick = pending.tick
        self._fail_tick(
            pending,
            DeadlineExceededError(
                f"chunk {tick.chunk_index} of session {tick.session_id!r} missed its "
                f"{self.config.tick_deadline_s:g} s deadline ({where}); the session failed closed, reset it to go on."
            ),
        )

    def _on_hang(self, worker: _Worker, batch: list[Queued[_Tick]]) -> None:
        worker.hang_timer = None
        if worker.running is batch and self._state == "running":
            _log.error("worker %d: a step ran past %s s; killing it", worker.index, self.config.hang_timeout_s)
            self._counters.workers_killed_hung += 1
            self._executor.kill(worker.index)

    def _stalled(self, index: int) -> bool:
        loop = self._loop
        return loop is not None and self._workers[index].stalled(loop.time(), self.config.stall_after_s)

    def _cancel_timers(self, worker: _Worker) -> None:
        for timer in (worker.timer, worker.hang_timer):
            if timer is not None:
                timer.cancel()
        worker.timer = worker.hang_timer = None

    # -- worker deaths -------------------------------------------------------------------

    def _on_worker_death(self, index: int, error: WorkerDiedError) -> None:
        if self._state != "running":
            return
        worker = self._workers[index]
        worker.ready = False
        worker.running = None  # its step future fails with the same error
        worker.overdue = False
        self._cancel_timers(worker)
        self._counters.worker_deaths += 1
        worker.gathering.clear()
        lost = self._router.worker_died(index, error)
        for entry in worker.queue.drain():
            self._fail_tick(entry.item, error)
        _log.error("%s (%d sessions lost)", error, len(lost))
        if self.config.restart_workers and index not in self._restarts:
            self._restarts[index] = asyncio.ensure_future(self._restart(worker))

    async def _restart(self, worker: _Worker) -> None:
        """Replace a dead worker, retrying with backoff until it starts or the engine closes."""
        delay = self.config.restart_backoff_s
        try:
            while self._state == "running" and self._executor.lost is None:
                try:
                    await self._executor.restart(worker.index)
                except Exception as error:
                    if self._state != "running":
                        return
                    self._counters.worker_restart_failures += 1
                    _log.error(
                        "worker %d could not be restarted (%s: %s); trying again in %.1f s",
                        worker.index,
                        type(error).__name__,
                        error,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.config.restart_backoff_max_s)
                    continue
                if self._state == "running":
                    self._counters.worker_restarts += 1
                    worker.ready = True
                    self._schedule(worker)
                return
        finally:
            self._restarts.pop(worker.index, None)

    async def wait_workers_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker restart in progress has finished."""
        tasks = list(self._restarts.values())
        if tasks:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- sessions ------------------------------------------------------------------------

    async def add_session(self, session_id: str, options: SessionOptions, *, timeout: float | None = None) -> int:
        """Admit a new session: create its state on the least loaded worker that can take it.

        Returns the worker. Admitted now or refused now: raises
        :class:`AdmissionRefusedError` at once when no worker can make room (each keeps
        sessions with a tick queued or in flight, and those marked in use:
        :meth:`mark_in_use`), when every worker is down or restarting, or
        stalled in a step; a worker that dies or times out while admitting is skipped
        for the next. ``ValueError`` for options the model cannot take.
        """
        admission = self._require_admission()
        if session_id in self._router:
            raise SessionExistsError(f"session {session_id!r} is already admitted.")
        options.check_image(self.spec)
        self._router.add(session_id, options)
        try:
            return await admission.place(session_id, options, timeout)
        except BaseException:
            self._router.remove(session_id)
            raise

    async def reset_session(self, session_id: str, *, timeout: float | None = None) -> None:
        """A fresh state from the session's options, at chunk 0: on its worker if it still
        has one, else wherever there is room. An unknown session is fine."""
        await self._require_admission().reset(session_id, timeout)

    def release_session(self, session_id: str) -> None:
        """Release the session's state (a close); its worker applies it before any later call.

        Returns at once -- it never waits behind a step in flight, so failing a late tick
        closed cannot hang. The session stays admitted: a reset re-creates its state.
        """
        for worker in self._workers:
            worker.gathering.forget(session_id)
        self._require_admission().release(session_id, f"session {session_id!r} was released; reset it to go on.")

    def forget_session(self, session_id: str) -> None:
        """Release the session and drop its routing and options (it is closed for good)."""
        if self._admission is not None and self._state == "running":
            self.release_session(session_id)
        self._router.remove(session_id)
        self._part_listeners.pop(session_id, None)

    def listen_parts(self, session_id: str, listener: Callable[[ChunkPart], None] | None) -> bool:
        """Have ``listener`` hear the parts of the session's chunks from its next tick on (``None``: stop),
        as ``execute_tick``'s ``on_part`` would; ``False`` when none can come: the model makes its
        chunks whole (no ``spec.frame_parts``). The session's encoding decides the rest (H.264, or
        more than one media: whole chunks), and so does the executor (Ray's: whole chunks)."""
        if listener is None:
            self._part_listeners.pop(session_id, None)
            return True
        if not self._executor.spec.frame_parts:
            return False
        self._part_listeners[session_id] = listener
        return True

    def mark_in_use(self, session_id: str, seconds: float) -> None:
        """Someone is using the session: admission must not evict it for the next ``seconds``
        (0: from now on it may be, least recently used first, like any idle session).

        Without marks (a library user who never calls this) every session without a tick
        queued or in flight may be evicted when a full worker admits another. The server marks
        its sessions while a connected member plays or steers them (docs/sessions.md).
        """
        if isinstance(seconds, bool) or not seconds >= 0:
            raise ValueError(f"seconds must be zero or positive; got {seconds!r}.")
        until = time.monotonic() + seconds if seconds > 0 else float("-inf")
        self._router.mark_in_use(session_id, until)

    def worker_of(self, session_id: str) -> int | None:
        """The worker holding the session's state (None: it holds none, or is unknown)."""
        route = self._router.find(session_id)
        return None if route is None else route.worker

    def _require_admission(self) -> Admission:
        self._require_running()
        assert self._admission is not None
        return self._admission

    # -- collective RPC ------------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        stage_ids: list[int] | None = None,
    ) -> list[Any]:
        """One result per selected stage (this engine is stage 0).

        ``reset_ar_diffusion_session`` / ``close_ar_diffusion_session`` go to the worker
        holding the session and answer ``True``; any other method is broadcast to every
        running worker and answers the list of their results.
        """
        results: list[Any] = []
        for stage in [0] if stage_ids is None else stage_ids:
            if stage != 0:
                results.append({"supported": False, "error": f"this engine runs one stage (0), not stage {stage}."})
            else:
                results.append(await self._stage_rpc(method, timeout, args, kwargs or {}))
        return results

    async def _stage_rpc(
        self, method: str, timeout: float | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if method in (RESET_SESSION_RPC, CLOSE_SESSION_RPC):
            session_id = kwargs.get("session_id", args[0] if args else None)
            if not isinstance(session_id, str):
                return {"supported": False, "error": f"{method} takes a session id; got {args!r} {kwargs!r}."}
            if method == RESET_SESSION_RPC:
                await self.reset_session(session_id, timeout=timeout)
            else:
                self.release_session(session_id)
            return True
        if method in _ENGINE_ONLY:
            return {"supported": False, "error": f"{method} is the engine's own call; use the engine's API."}
        if kwargs:
            return {"supported": False, "error": f"{method}: workers take positional arguments only."}
        live = [worker.index for worker in self._workers if self._executor.is_alive(worker.index)]
        admission = self._require_admission()
        return list(await asyncio.gather(*(admission.call(index, method, args, timeout) for index in live)))

    # -- stats ---------------------------------------------------------------------------

    def capacity(self) -> Capacity:
        """Room for new sessions now (what ``/healthz`` reports to a balancer)."""
        if self._admission is None or self._state != "running":
            return Capacity(free=0, workers_alive=0)
        admission = self._admission
        alive = sum(worker.ready for worker in self._workers)
        return Capacity(
            free=admission.free_slots(), workers_alive=alive, slots=admission.slots(), room=admission.has_room()
        )

    def stats(self) -> EngineStats:
        return self._counters.snapshot(
            sessions=len(self._router),
            resident=tuple(self._router.resident_count(index) for index in range(self.num_workers)),
            queued_ticks=sum(len(worker.queue) for worker in self._workers),
            workers_alive=sum(self._executor.is_alive(index) for index in range(self.num_workers)),
            # a worker's clock period while it serves sessions (None: no clock running, or no one on it)
            chunk_periods=tuple(
                worker.gathering.clock.period
                if worker.gathering.clock.started and self._router.resident_count(worker.index) > 0
                else None
                for worker in self._workers
            ),
        )


def _hand_on(parted: dict[str, _Tick], part: ChunkPart) -> None:
    """A part of a chunk in flight, to its tick's ``on_part`` while the tick waits for it."""
    pending = parted.get(part.session_id)
    if pending is None or pending.on_part is None or pending.future.done():
        return
    if pending.tick.chunk_index == part.chunk_index:
        pending.on_part(part)


def _log_media_failure(done: asyncio.Future[Any]) -> None:
    if not done.cancelled() and done.exception() is not None:
        _log.warning("a keyframe or media request to a worker failed: %r", done.exception())


def _fresh(error: BaseException) -> BaseException:
    """A new instance per failed tick, so tracebacks of different awaiters do not pile up."""
    if isinstance(error, TickFailedError):
        copy = type(error)(str(error))
        copy.code = error.code
        return copy
    return error


def _fail(pending: _Tick, error: TickFailedError) -> None:
    if not pending.future.done():
        pending.future.set_exception(_fresh(error))
