"""The in-process executor: each worker is a runner on a thread of its own.

Owns: one single-thread pool per worker (so calls to a worker run in order and model
compute never runs on the event loop), and the same death semantics as a process:
:meth:`InprocExecutor.kill` abandons a stuck worker's thread, and its pending calls
fail with ``WorkerDiedError`` (the base's death path). For tests and tiny models; the
GIL is shared, so a model that computes in pure Python slows the event loop.

Must not know: sessions, batching, routing, what the model computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from worldserve.runtime.errors import RuntimeClosedError, WorkerDiedError, WorkerStartError
from worldserve.runtime.executor.abstract import Executor, Life, post
from worldserve.runtime.messages import ChunkPart, WorkerConfig
from worldserve.runtime.runner import ModelRunner
from worldserve.runtime.worker import Reply, answer, build_runner

__all__ = ["InprocExecutor"]


class _Thread:
    def __init__(self, life: Life, generation: int) -> None:
        self.life = life
        self.pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"worldserve-worker-{life.index}.{generation}"
        )
        self.runner: ModelRunner | None = None


class InprocExecutor(Executor):
    """Workers as runners on dedicated threads of this process."""

    def __init__(self, config: WorkerConfig, num_workers: int = 1) -> None:
        super().__init__(config, num_workers)
        self._threads: list[_Thread | None] = [None] * num_workers
        self._generations = [0] * num_workers

    async def start(self) -> None:
        self._bind_loop()
        await asyncio.gather(*(self._launch(index) for index in range(self.num_workers)))

    async def _launch(self, index: int) -> None:
        loop = self._require_loop()
        self._generations[index] += 1
        thread = _Thread(self._begin_life(index), self._generations[index])
        try:
            thread.runner = await loop.run_in_executor(thread.pool, build_runner, self.config, index)
        except Exception as error:
            thread.pool.shutdown(wait=False)
            raise WorkerStartError(
                f"worker {index} could not load model {self.config.model!r}: {type(error).__name__}: {error}"
            ) from error
        self._threads[index] = thread
        self._life_ready(thread.life, thread.runner.spec)

    def _send(self, worker: int, request_id: int, method: str, args: tuple[Any, ...]) -> None:
        thread = self._threads[worker]
        assert thread is not None  # the base sends only to a live worker
        assert thread.runner is not None
        loop = self._require_loop()
        life = thread.life

        def on_part(part: ChunkPart) -> None:  # on the worker's thread (a step that hands on parts): to the loop
            post(loop, self._part, life, request_id, part)

        done = thread.pool.submit(answer, thread.runner, method, args, worker, on_part)
        done.add_done_callback(lambda result: post(loop, self._settle, life, request_id, result))

    def _settle(self, life: Life, request_id: int, result: concurrent.futures.Future[Reply]) -> None:
        if result.cancelled():
            return  # its thread was abandoned or stopped: the base failed the call already
        self._deliver(life, request_id, result.result())

    def kill(self, worker: int) -> None:
        thread = self._threads[worker]
        if thread is None or thread.life.ended:
            return
        thread.pool.shutdown(wait=False, cancel_futures=True)
        self._life_lost(
            thread.life,
            WorkerDiedError(
                f"worker {worker} (a thread) was abandoned while stuck; the session states it held are lost, "
                "reset the session to start over."
            ),
        )

    async def restart(self, worker: int) -> None:
        if self._closed:
            raise RuntimeClosedError("the executor is shut down.")
        self.kill(worker)
        await self._launch(worker)

    async def _stop_workers(self) -> None:
        loop = self._require_loop()
        for thread in self._threads:
            if thread is not None:
                self._fail_pending(thread.life, RuntimeClosedError("the runtime is shut down."))
                await loop.run_in_executor(None, thread.pool.shutdown)
