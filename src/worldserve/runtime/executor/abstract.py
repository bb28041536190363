"""The executor interface: how the engine reaches its workers (vLLM v1's ``Executor``).

Owns: the contract every executor keeps, whatever carries the calls (a thread, a
process, later a Ray actor): a fixed number of workers, each running one
:class:`~worldserve.runtime.runner.ModelRunner` built from a
:class:`~worldserve.runtime.messages.WorkerConfig`; :meth:`Executor.call` queues one
runner method on one worker, and calls to one worker run in the order they were made;
a call's future gets the result, the runner's coded error, or
:class:`~worldserve.runtime.errors.WorkerDiedError` when the worker dies first. A
death is reported once to :attr:`Executor.on_worker_death`; the engine decides to
:meth:`Executor.restart`.

Must not know: sessions, batching, routing (the engine's), what the model computes.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from worldserve.models.base import ModelSpec
from worldserve.runtime.errors import RuntimeClosedError, WorkerDiedError
from worldserve.runtime.messages import WorkerConfig

__all__ = ["DeathCallback", "Executor"]

#: Called on the event loop with the worker's index and the error its calls failed with.
DeathCallback = Callable[[int, WorkerDiedError], None]


class Executor(ABC):
    """Runs runner calls on ``num_workers`` workers; FIFO per worker; reports deaths."""

    def __init__(self, config: WorkerConfig, num_workers: int) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer; got {num_workers!r}.")
        self.config = config
        self._num_workers = num_workers
        self._spec: ModelSpec | None = None
        self.on_worker_death: DeathCallback | None = None

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def spec(self) -> ModelSpec:
        """The model's spec, as a worker reported it (after :meth:`start`)."""
        if self._spec is None:
            raise RuntimeClosedError("the executor has not started; its model spec is not known yet.")
        return self._spec

    @abstractmethod
    async def start(self) -> None:
        """Start every worker and wait until each has built its model; raise if one cannot."""

    @abstractmethod
    def call(self, worker: int, method: str, args: tuple[Any, ...] = ()) -> asyncio.Future[Any]:
        """Queue ``runner.call(method, args)`` on ``worker``; never blocks the event loop."""

    @abstractmethod
    def is_alive(self, worker: int) -> bool:
        """Whether ``worker`` is started and has not died since."""

    @abstractmethod
    async def restart(self, worker: int) -> None:
        """Replace a dead worker with a fresh one (empty runner) and wait until it is ready."""

    @abstractmethod
    def kill(self, worker: int) -> None:
        """Stop a stuck worker at once; its death is reported like any other."""

    @abstractmethod
    def pid(self, worker: int) -> int | None:
        """The worker's process id, if it runs in a process of its own."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop every worker; calls still pending fail with ``RuntimeClosedError``."""

    def _report_death(self, worker: int, error: WorkerDiedError) -> None:
        callback = self.on_worker_death
        if callback is not None:
            callback(worker, error)
