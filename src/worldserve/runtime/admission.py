"""Admission: placing sessions on workers and (re)creating, evicting and releasing their states.

Owns: the choice of worker for a new session (least loaded first, skipping at once the
workers that are down, stalled in a step, full of sessions it must not evict, or that the
engine says lack real-time headroom: their measured step time would outgrow the chunk
period), the ``admit`` call with the sessions the worker must not evict (a tick queued or
running there, or marked in use: :meth:`~worldserve.runtime.router.Router.mark_in_use`;
the runner evicts the others least recently used first), recording
evictions, resets (a fresh state on the session's own worker, or anywhere when it lost
its state), releases that never wait behind a step, and fail-closed clean-up when an
admission times out or is cancelled.

Must not know: batching, deadlines, how workers are reached (the executor's), sessions' events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from worldserve.lifecycle import CLOSE_SESSION_RPC
from worldserve.models.base import SessionOptions
from worldserve.runtime.errors import AdmissionRefusedError, RPCTimeoutError, RuntimeClosedError, WorkerDiedError
from worldserve.runtime.executor.abstract import Executor
from worldserve.runtime.metrics import EngineCounters
from worldserve.runtime.router import Router
from worldserve.runtime.runner import ADMIT

__all__ = ["Admission", "WorkerView"]

_log = logging.getLogger(__name__)


class WorkerView(Protocol):
    """What admission needs to know of a worker."""

    @property
    def index(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    def pinned(self) -> frozenset[str]:
        """Sessions with a tick queued for, or running on, this worker."""
        ...


class Admission:
    """Places sessions and keeps the router in step with what workers hold."""

    def __init__(
        self,
        executor: Executor,
        router: Router,
        counters: EngineCounters,
        workers: Sequence[WorkerView],
        *,
        rpc_timeout_s: float | None,
        stalled: Callable[[int], bool] = lambda index: False,
        retry_after_s: float | None = None,
        headroom: Callable[[int, int], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._executor = executor
        self._router = router
        self._counters = counters
        self._workers = workers
        self._rpc_timeout_s = rpc_timeout_s
        self._stalled = stalled
        self._retry_after_s = retry_after_s
        self._headroom = headroom
        self._clock = clock
        self._capacity = executor.config.limits.capacity(executor.spec.state_bytes)

    def free_slots(self) -> int | None:
        """Session slots no session holds on ready workers (None: no residency limit)."""
        ready = [worker.index for worker in self._workers if worker.ready]
        if self._capacity is None:
            return None if ready else 0
        return sum(max(0, self._capacity - self._router.load(index)) for index in ready)

    async def place(self, session_id: str, options: SessionOptions, timeout: float | None) -> int:
        """Create the session's state on the least loaded worker that takes it; return that worker.

        Admitted now or refused now: a worker that is down or restarting, stalled in a
        step, or surely full is skipped without a call; one that refuses, dies or times
        out while admitting is skipped for the next. When none takes the session,
        :class:`AdmissionRefusedError` (with a retry hint) says why for each worker.
        """
        refusals: list[str] = []
        ready = []
        for worker in self._workers:
            if worker.ready:
                ready.append(worker.index)
            else:
                refusals.append(f"worker {worker.index}: down, restarting")
        for index in self._router.placement_order(ready):
            unfit = self._unfit(index)
            if unfit is not None:
                refusals.append(unfit)
                continue
            try:
                await self.admit_on(index, session_id, options, timeout)
            except (AdmissionRefusedError, WorkerDiedError, RPCTimeoutError) as error:
                refusals.append(str(error))
                continue
            self._counters.admissions += 1
            return index
        self._counters.admissions_refused += 1
        raise AdmissionRefusedError(
            f"session {session_id!r} refused: no worker can make room ({'; '.join(refusals)}). "
            "Close a session or try again later.",
            retry_after_s=self._retry_after_s,
        )

    def slots(self) -> int | None:
        """Session slots on ready workers, held or not (None: no residency limit)."""
        ready = sum(worker.ready for worker in self._workers)
        return None if self._capacity is None else self._capacity * ready

    def has_room(self) -> bool:
        """Whether :meth:`place` would ask some worker to admit a session now (its checks that
        need no call): a cheap look for those waiting for room."""
        return any(worker.ready and self._unfit(worker.index) is None for worker in self._workers)

    def _unfit(self, index: int) -> str | None:
        """Why worker ``index`` is skipped without a call (stalled, surely full, no headroom), or None."""
        if self._stalled(index):
            return f"worker {index}: stalled in a step"
        if not self._may_take(index):
            return f"worker {index}: full, every session is in use or has a tick in flight"
        capacity = self._capacity
        evicts = capacity is not None and self._router.load(index) >= capacity  # one in, one out
        return self._lacks_headroom(index, 0 if evicts else 1)

    def _protected(self, index: int) -> frozenset[str]:
        """The sessions on worker ``index`` it must not evict: a tick queued or running there, or in use."""
        return self._workers[index].pinned() | self._router.in_use(index, self._clock())

    def _may_take(self, index: int) -> bool:
        """False when the worker is surely full of sessions it must not evict (refuse without asking it)."""
        capacity = self._capacity
        if capacity is None or self._router.load(index) < capacity:
            return True
        if capacity == 0:
            return False
        protected = self._protected(index)
        return any(session_id not in protected for session_id in self._router.resident(index))

    def _lacks_headroom(self, index: int, more: int) -> str | None:
        """Why the worker cannot hold real time with ``more`` sessions than now (its measured step
        time against the chunk period, from the engine; 0 more when the newcomer takes an evicted
        session's place), or None."""
        return None if self._headroom is None else self._headroom(index, more)

    async def admit_on(self, index: int, session_id: str, options: SessionOptions, timeout: float | None) -> None:
        """Create (or re-create: a reset) the session's state on worker ``index``."""
        pinned = self._protected(index)
        self._router.begin_admission(index)
        try:
            evicted = await self.call(index, ADMIT, (session_id, options, pinned), timeout)
        except AdmissionRefusedError:
            raise  # the runner refused before touching any state
        except BaseException:
            # A timeout, a cancellation or a failed new_state: whatever state the worker
            # may hold for this session is released, in order, before any later call.
            self.release(session_id, f"session {session_id!r} has no state: its admission failed.", worker=index)
            raise
        finally:
            self._router.end_admission(index)
        self._counters.evictions += len(evicted)
        self._router.evicted(evicted, index)
        self._router.placed(session_id, index)

    async def reset(self, session_id: str, timeout: float | None) -> None:
        """A fresh state from the session's options: on its worker if it has one, else anywhere."""
        route = self._router.find(session_id)
        if route is None:
            return  # unknown: nothing to reset
        index = route.worker
        if index is not None and self._workers[index].ready:
            await self.admit_on(index, session_id, route.options, timeout)
        else:
            await self.place(session_id, route.options, timeout)

    def release(self, session_id: str, why: str, *, worker: int | None = None) -> None:
        """Release the session's state; its worker applies it before any later call.

        Returns at once: it never waits behind a step in flight.
        """
        held = self._router.released(session_id, why)
        target = held if held is not None else worker
        if target is not None and self._executor.is_alive(target):
            self._executor.call(target, CLOSE_SESSION_RPC, (session_id,)).add_done_callback(_log_release_failure)

    async def call(self, index: int, method: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        limit = timeout if timeout is not None else self._rpc_timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self._executor.call(index, method, args)
        except TimeoutError:
            raise RPCTimeoutError(f"worker {index} did not answer {method} within {limit:g} s.") from None


def _log_release_failure(done: asyncio.Future[Any]) -> None:
    error = None if done.cancelled() else done.exception()
    if error is not None and not isinstance(error, (WorkerDiedError, RuntimeClosedError)):
        _log.warning("releasing a session's state failed: %s", error)
