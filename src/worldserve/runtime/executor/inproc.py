"""The in-process executor: each worker is a runner on a thread of its own.

Owns: one single-thread pool per worker (so calls to a worker run in order and model
compute never runs on the event loop), and the same death semantics as a process:
:meth:`InprocExecutor.kill` abandons a stuck worker's thread, fails its pending calls
with ``WorkerDiedError`` and reports the death. For tests and tiny models; the GIL is
shared, so a model that computes in pure Python slows the event loop.

Must not know: sessions, batching, routing, what the model computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

from worldserve.runtime.errors import RuntimeClosedError, TickFailedError, WorkerDiedError, WorkerStartError
from worldserve.runtime.executor.abstract import Executor
from worldserve.runtime.messages import WorkerConfig
from worldserve.runtime.runner import ModelRunner
from worldserve.runtime.worker import build_runner

__all__ = ["InprocExecutor"]


class _Thread:
    def __init__(self, index: int, generation: int) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"worldserve-worker-{index}.{generation}"
        )
        self.runner: ModelRunner | None = None
        self.pending: set[asyncio.Future[Any]] = set()
        self.death: WorkerDiedError | None = None


class InprocExecutor(Executor):
    """Workers as runners on dedicated threads of this process."""

    def __init__(self, config: WorkerConfig, num_workers: int = 1) -> None:
        super().__init__(config, num_workers)
        self._threads: list[_Thread | None] = [None] * num_workers
        self._generations = [0] * num_workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._launch(index) for index in range(self.num_workers)))

    async def _launch(self, index: int) -> None:
        loop = self._require_loop()
        self._generations[index] += 1
        thread = _Thread(index, self._generations[index])
        try:
            thread.runner = await loop.run_in_executor(thread.pool, build_runner, self.config, index)
        except Exception as error:
            thread.pool.shutdown(wait=False)
            raise WorkerStartError(
                f"worker {index} could not load model {self.config.model!r}: {type(error).__name__}: {error}"
            ) from error
        if self._spec is None:
            self._spec = thread.runner.spec
        self._threads[index] = thread

    def call(self, worker: int, method: str, args: tuple[Any, ...] = ()) -> asyncio.Future[Any]:
        loop = self._require_loop()
        future: asyncio.Future[Any] = loop.create_future()
        thread = self._threads[worker]
        if self._closed:
            future.set_exception(RuntimeClosedError("the runtime is shut down."))
            return future
        if thread is None or thread.runner is None or thread.death is not None:
            future.set_exception((thread and thread.death) or WorkerDiedError(f"worker {worker} is not running."))
            return future
        runner = thread.runner
        thread.pending.add(future)
        done = thread.pool.submit(_call, runner, method, args)
        done.add_done_callback(lambda result: _post(loop, _settle, thread, future, result))
        return future

    def is_alive(self, worker: int) -> bool:
        thread = self._threads[worker]
        return thread is not None and thread.runner is not None and thread.death is None

    def kill(self, worker: int) -> None:
        thread = self._threads[worker]
        if thread is None or thread.death is not None:
            return
        thread.death = WorkerDiedError(
            f"worker {worker} (a thread) was abandoned while stuck; the session states it held are lost, "
            "reset the session to start over."
        )
        thread.pool.shutdown(wait=False, cancel_futures=True)
        for future in thread.pending:
            if not future.done():
                future.set_exception(thread.death)
        thread.pending.clear()
        self._report_death(worker, thread.death)

    async def restart(self, worker: int) -> None:
        if self._closed:
            raise RuntimeClosedError("the executor is shut down.")
        self.kill(worker)
        await self._launch(worker)

    def pid(self, worker: int) -> int | None:
        return None

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = self._require_loop()
        for thread in self._threads:
            if thread is None:
                continue
            for future in thread.pending:
                if not future.done():
                    future.set_exception(RuntimeClosedError("the runtime is shut down."))
            thread.pending.clear()
            await loop.run_in_executor(None, thread.pool.shutdown)

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeClosedError("the executor has not started.")
        return self._loop


def _call(runner: ModelRunner, method: str, args: tuple[Any, ...]) -> Any:
    try:
        return runner.call(method, args)
    except TickFailedError:
        raise
    except Exception as error:  # the same surface as a process: a coded error, never a foreign type
        raise TickFailedError(f"{method} raised {type(error).__name__}: {error}") from error


def _settle(thread: _Thread, future: asyncio.Future[Any], result: concurrent.futures.Future[Any]) -> None:
    thread.pending.discard(future)
    if future.done():
        return
    if result.cancelled():
        future.set_exception(thread.death or RuntimeClosedError("the runtime is shut down."))
    elif (error := result.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(result.result())


def _post(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        loop.call_soon_threadsafe(callback, *args)
