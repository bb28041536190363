"""The executor base: how the engine reaches its workers (vLLM v1's ``Executor``).

Owns: the contract every executor keeps, whatever carries the calls (a thread, a
process, a Ray actor): a fixed number of workers, each running one
:class:`~worldserve.runtime.runner.ModelRunner` built from a
:class:`~worldserve.runtime.messages.WorkerConfig`; :meth:`Executor.call` queues one
runner method on one worker (:meth:`Executor.step` the batched model step), and calls
to one worker run in the order they were made. A step may name sessions whose frames are wanted as
they are made: the worker sends their :class:`~worldserve.runtime.messages.ChunkPart` s ahead of its
reply, and the step's ``on_part`` hears each on the event loop, before the step's future settles (an
executor that cannot carry them, Ray's, sends none: the chunk comes whole). And the parts every executor shares:
the registry of pending calls (request id -> future, per life of a worker), the
closed / not-running checks, the translation of a runner's reply ``(ok, payload)`` --
``payload`` a ``(code, message)`` pair when not ok -- back into the coded
:class:`~worldserve.runtime.errors.TickFailedError` (:func:`~worldserve.runtime.worker.answer`
builds that reply on the worker's side), and deaths: a worker's pending calls fail with
:class:`~worldserve.runtime.errors.WorkerDiedError` and the death is reported exactly
once to :attr:`Executor.on_worker_death`; the engine decides to :meth:`Executor.restart`.
An executor that can run no worker any more (its cluster is gone) reports every death and
then :attr:`Executor.on_lost`, once.

A concrete executor says only how calls are carried: :meth:`Executor.start`,
:meth:`Executor._send` (and optionally :meth:`Executor._send_step`),
:meth:`Executor.restart`, :meth:`Executor.kill`, :meth:`Executor._stop_workers`; it
calls :meth:`Executor._begin_life` / :meth:`Executor._life_ready` when a worker starts,
:meth:`Executor._deliver` with each reply and :meth:`Executor._life_lost` when one dies.

Must not know: sessions, batching, routing (the engine's), what the model computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import Any

from worldserve.models.base import ModelSpec
from worldserve.protocol import TickRequest
from worldserve.runtime.errors import RuntimeClosedError, TickFailedError, WorkerDiedError, error_from_code
from worldserve.runtime.messages import ChunkPart, WorkerConfig
from worldserve.runtime.runner import STEP

__all__ = ["DeathCallback", "Executor", "Life", "PartCallback", "Reply", "post"]

#: Called on the event loop with the worker's index and the error its calls failed with.
DeathCallback = Callable[[int, WorkerDiedError], None]
#: Hears a step's chunk parts on the event loop, as the worker sends them.
PartCallback = Callable[[ChunkPart], None]

#: A worker's answer to one call: ``(True, result)`` or ``(False, (code, message))``
#: (built on the worker's side by :func:`worldserve.runtime.worker.answer`).
Reply = tuple[bool, Any]


def post(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    """Run ``callback(*args)`` on ``loop`` from any thread (nothing, if the loop is closed)."""
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        loop.call_soon_threadsafe(callback, *args)


class Life:
    """One life of one worker: from its start until it dies or is stopped.

    Replies and deaths name the life they belong to, so a late reply or exit of a
    replaced worker never touches its successor's calls.
    """

    __slots__ = ("alive", "closing", "death", "ended", "index", "pending", "sinks")

    def __init__(self, index: int) -> None:
        self.index = index
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.sinks: dict[int, PartCallback] = {}  # the pending steps that want their chunks' parts
        self.alive = False  # started and answering calls
        self.ended = False  # died or stopped (set once)
        self.closing = False  # stopped on purpose: its calls fail with RuntimeClosedError, no death is reported
        self.death: WorkerDiedError | None = None


class Executor(ABC):
    """Runs runner calls on ``num_workers`` workers; FIFO per worker; reports each death once."""

    def __init__(self, config: WorkerConfig, num_workers: int) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer; got {num_workers!r}.")
        self.config = config
        self._num_workers = num_workers
        self._spec: ModelSpec | None = None
        self.on_worker_death: DeathCallback | None = None
        self._lives: list[Life | None] = [None] * num_workers
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        #: Set once the executor can run no worker any more (e.g. the Ray head is gone): every
        #: worker's death was reported with it, no restart can succeed; ``on_lost`` hears it once.
        self.lost: WorkerDiedError | None = None
        self.on_lost: Callable[[WorkerDiedError], None] | None = None

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def spec(self) -> ModelSpec:
        """The model's spec, as a worker reported it (after :meth:`start`)."""
        if self._spec is None:
            raise RuntimeClosedError("the executor has not started; its model spec is not known yet.")
        return self._spec

    # -- what every executor implements ------------------------------------------------------

    @abstractmethod
    async def start(self) -> None:
        """Start every worker and wait until each has built its model; raise if one cannot.

        Implementations call :meth:`_bind_loop` first.
        """

    @abstractmethod
    def _send(self, worker: int, request_id: int, method: str, args: tuple[Any, ...]) -> None:
        """Carry one call to the worker's current life; its reply goes to :meth:`_deliver`."""

    def _send_step(self, worker: int, request_id: int, ticks: Sequence[TickRequest], parted: frozenset[str]) -> None:
        """Carry one model step (the hot path; an executor may encode or route it specially); the worker
        sends the parts of ``parted`` sessions' chunks to :meth:`_part` ahead of the reply, where it can."""
        self._send(worker, request_id, STEP, (list(ticks), parted))

    @abstractmethod
    async def restart(self, worker: int) -> None:
        """Replace a dead worker with a fresh one (empty runner) and wait until it is ready."""

    @abstractmethod
    def kill(self, worker: int) -> None:
        """Stop a stuck worker at once; its death is reported like any other."""

    @abstractmethod
    async def _stop_workers(self) -> None:
        """Stop every worker (after :meth:`shutdown` marked the executor closed)."""

    def pid(self, worker: int) -> int | None:
        """The worker's process id, if it runs in a process of its own on this machine."""
        return None

    # -- calls (shared) ------------------------------------------------------------------------

    def call(self, worker: int, method: str, args: tuple[Any, ...] = ()) -> asyncio.Future[Any]:
        """Queue ``runner.call(method, args)`` on ``worker``; never blocks the event loop."""
        if method == STEP:
            return self.step(worker, *args)
        return self._submit(worker, method, args)

    def step(
        self,
        worker: int,
        ticks: Sequence[TickRequest],
        parted: Collection[str] = (),
        on_part: PartCallback | None = None,
    ) -> asyncio.Future[Any]:
        """Queue one batched model step of ``ticks`` on ``worker``; the future gets a ``StepReport``.

        With ``on_part``, the chunks of the sessions in ``parted`` are also handed to it in parts as the
        worker makes them (a model with ``spec.frame_parts``), each before the future settles.
        """
        wanted = frozenset(parted) if on_part is not None else frozenset()
        return self._submit(worker, STEP, (ticks, wanted), on_part if wanted else None)

    def _submit(
        self, worker: int, method: str, args: tuple[Any, ...], on_part: PartCallback | None = None
    ) -> asyncio.Future[Any]:
        loop = self._require_loop()
        future: asyncio.Future[Any] = loop.create_future()
        life = self._lives[worker]
        if self._closed:
            future.set_exception(RuntimeClosedError("the runtime is shut down."))
        elif life is None or not life.alive:
            future.set_exception((life and life.death) or WorkerDiedError(f"worker {worker} is not running."))
        else:
            request_id = next(self._ids)
            life.pending[request_id] = future
            if on_part is not None:
                life.sinks[request_id] = on_part
            if method == STEP:
                self._send_step(worker, request_id, args[0], args[1])
            else:
                self._send(worker, request_id, method, args)
        return future

    def is_alive(self, worker: int) -> bool:
        """Whether ``worker`` is started and has not died since."""
        life = self._lives[worker]
        return life is not None and life.alive

    # -- for executors: lives, replies, deaths (on the event loop) ----------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeClosedError("the executor has not started.")
        return self._loop

    def _begin_life(self, worker: int) -> Life:
        """A new life for ``worker`` (not yet answering calls); the previous one is stopped."""
        old = self._lives[worker]
        if old is not None and not old.ended:
            old.closing = True
        life = Life(worker)
        self._lives[worker] = life
        return life

    def _life_ready(self, life: Life, spec: ModelSpec | None = None) -> None:
        """The life's worker built its model: it answers calls from now on."""
        if self._spec is None and spec is not None:
            self._spec = spec
        if not life.ended:
            life.alive = True

    def _part(self, life: Life, request_id: int, part: ChunkPart) -> None:
        """Hand a part of a pending step's chunk to the step's ``on_part`` (a late one is dropped)."""
        sink = life.sinks.get(request_id)
        if sink is not None and request_id in life.pending:
            sink(part)

    def _deliver(self, life: Life, request_id: int, reply: Reply) -> None:
        """Settle one call with the worker's reply (a late reply of a dead life is dropped)."""
        life.sinks.pop(request_id, None)
        future = life.pending.pop(request_id, None)
        if future is None or future.done():
            return
        ok, payload = reply
        if ok:
            future.set_result(payload)
        else:
            future.set_exception(error_from_code(*payload))

    def _life_lost(self, life: Life, error: WorkerDiedError) -> None:
        """The life's worker is gone: fail its pending calls and report the death, once.

        A life stopped on purpose (:attr:`Life.closing`, or the executor shut down) fails its
        calls with ``RuntimeClosedError`` and reports nothing.
        """
        if life.ended:
            return
        life.ended = True
        was_alive = life.alive
        life.alive = False
        failure: TickFailedError
        if life.closing or self._closed:
            failure = RuntimeClosedError("the runtime is shut down.")
        else:
            life.death = error
            failure = error
        self._fail_pending(life, failure)
        if was_alive and failure is error:
            callback = self.on_worker_death
            if callback is not None:
                callback(life.index, error)

    def _executor_lost(self, error: WorkerDiedError) -> None:
        """Nothing can run any more: every live worker dies with ``error``, then ``on_lost`` hears it (once)."""
        if self.lost is not None or self._closed:
            return
        self.lost = error
        for life in self._lives:
            if life is not None:
                self._life_lost(life, error)
        if self.on_lost is not None:
            self.on_lost(error)

    @staticmethod
    def _fail_pending(life: Life, error: TickFailedError) -> None:
        pending, life.pending = life.pending, {}
        life.sinks.clear()
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    # -- stopping (shared) ----------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop every worker; calls still pending fail with ``RuntimeClosedError``."""
        if self._closed:
            return
        self._closed = True
        for life in self._lives:
            if life is not None:
                life.closing = True
        try:
            await self._stop_workers()
        finally:
            closed = RuntimeClosedError("the runtime is shut down.")
            for life in self._lives:
                if life is not None:
                    life.alive = False
                    self._fail_pending(life, closed)
