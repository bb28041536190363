"""The multi-process executor (the default): one spawned process per worker.

Owns: spawning workers with the ``spawn`` start method (no forked CUDA or thread
state), one duplex pipe per worker, and per worker a writer thread (pickling and
sending control calls, so a full pipe never blocks the event loop; a step, small and
sent only to a worker that is reading, goes straight from the loop), a reader thread (receiving
replies, copying a step's frames out of the worker's shared-memory
:class:`~worldserve.runtime.framebuf.FrameBuffer`, resolving futures through
``call_soon_threadsafe``, and noticing a death as end-of-file), and the buffer's
lifetime. A dead worker's death (the base's path: pending calls fail, reported once)
names its pid and exit status. Workers ignore SIGTERM and SIGINT (the parent owns shutdown),
so a runtime never closed is cleaned up at interpreter exit: its workers killed, its
buffers unlinked (before ``multiprocessing``'s own exit hook, which would wait on them).

Must not know: sessions, batching, routing, what the model computes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from worldserve.protocol import TickRequest
from worldserve.runtime.errors import RuntimeClosedError, TickFailedError, WorkerDiedError, WorkerStartError
from worldserve.runtime.executor.abstract import Executor, Life, post
from worldserve.runtime.framebuf import DEFAULT_FRAME_BUFFER_BYTES, FrameBuffer, PackedStep
from worldserve.runtime.messages import WorkerConfig
from worldserve.runtime.runner import STEP
from worldserve.runtime.wire import encode_ticks
from worldserve.runtime.worker import ATTACH_FRAMES, SHUTDOWN, run_worker

__all__ = ["MultiprocExecutor"]

_log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Proc:
    life: Life
    process: BaseProcess
    conn: Connection
    ready: asyncio.Future[Any]
    outbox: queue.SimpleQueue[tuple[int, str, tuple[Any, ...], bool] | None] = field(default_factory=queue.SimpleQueue)
    exited: bool = False
    reader: threading.Thread | None = None
    frames: FrameBuffer | None = None
    frames_request: int | None = None  # the step whose frames the buffer holds (one at a time)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    # Messages handed to the writer thread, and those it has sent; each has one writing
    # thread (the loop, the writer), so no update is lost.
    enqueued: int = 0
    sent: int = 0


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class MultiprocExecutor(Executor):
    """Workers in spawned processes, reached through pipes."""

    def __init__(
        self,
        config: WorkerConfig,
        num_workers: int = 1,
        *,
        start_timeout: float = 300.0,
        frame_buffer_bytes: int = DEFAULT_FRAME_BUFFER_BYTES,
    ) -> None:
        super().__init__(config, num_workers)
        self._frame_buffer_bytes = frame_buffer_bytes
        self._ctx = multiprocessing.get_context("spawn")
        self._start_timeout = start_timeout
        self._procs: list[_Proc | None] = [None] * num_workers

    # -- starting ----------------------------------------------------------------------

    async def start(self) -> None:
        self._bind_loop()
        atexit.register(self._kill_at_exit)  # runs before multiprocessing's hook (registered earlier)
        try:
            await asyncio.gather(*(self._launch(index) for index in range(self.num_workers)))
        except BaseException:
            await self.shutdown()
            raise

    async def restart(self, worker: int) -> None:
        if self._closed:
            raise RuntimeClosedError("the executor is shut down.")
        old = self._procs[worker]
        if old is not None and old.process.is_alive():
            old.life.closing = True
            old.process.kill()
        await self._launch(worker)

    async def _launch(self, index: int) -> None:
        loop = self._require_loop()
        # Process.start() forks and writes the spawn preamble: keep it off the event loop.
        proc = await loop.run_in_executor(None, self._spawn, self._begin_life(index), loop)
        self._procs[index] = proc
        try:
            async with asyncio.timeout(self._start_timeout):
                message = await asyncio.shield(proc.ready)
        except TimeoutError:
            proc.life.closing = True
            proc.process.kill()
            raise WorkerStartError(
                f"worker {index} did not load its model within {self._start_timeout:g} s (--worker-start-timeout-s)."
            ) from None
        kind = message[0]
        if kind != "ready":
            raise WorkerStartError(message[1])
        if proc.exited:
            raise WorkerStartError(f"worker {index} (pid {proc.process.pid}) exited right after starting.")
        spec = message[2]
        self._life_ready(proc.life, spec)
        shape = (spec.frames_per_chunk, spec.height, spec.width, 3)
        frames = FrameBuffer.create(shape, spec.max_batch_size, self._frame_buffer_bytes)
        if frames is not None:
            try:
                await self.call(index, ATTACH_FRAMES, (frames.name, frames.slots, shape))
            except TickFailedError as error:
                _log.warning("worker %d: frames go through the pipe (%s)", index, error)
                frames.close()
            else:
                proc.frames = frames
        if not proc.life.alive:
            raise WorkerStartError(f"worker {index} (pid {proc.process.pid}) died while starting.")

    def _spawn(self, life: Life, loop: asyncio.AbstractEventLoop) -> _Proc:
        index = life.index
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=run_worker, args=(child, self.config, index), name=f"worldserve-worker-{index}", daemon=True
        )
        process.start()
        child.close()
        proc = _Proc(life, process, parent, loop.create_future())
        proc.reader = threading.Thread(
            target=self._read, args=(proc, loop), name=f"worldserve-reader-{index}", daemon=True
        )
        proc.reader.start()
        threading.Thread(target=self._write, args=(proc,), name=f"worldserve-writer-{index}", daemon=True).start()
        return proc

    # -- calls -------------------------------------------------------------------------

    def _send(self, worker: int, request_id: int, method: str, args: tuple[Any, ...]) -> None:
        proc = self._procs[worker]
        assert proc is not None  # the base sends only to a live worker
        proc.enqueued += 1
        proc.outbox.put((request_id, method, args, False))

    def _send_step(self, worker: int, request_id: int, ticks: Sequence[TickRequest], parted: frozenset[str]) -> None:
        proc = self._procs[worker]
        assert proc is not None
        use_frames = proc.frames is not None and proc.frames_request is None
        if use_frames:
            proc.frames_request = request_id
        message = (request_id, STEP, (encode_ticks(ticks), parted), use_frames)  # the worker decodes the ticks
        if not self._send_now(proc, message):
            proc.enqueued += 1
            proc.outbox.put(message)

    @staticmethod
    def _send_now(proc: _Proc, message: tuple[int, str, tuple[Any, ...], bool]) -> bool:
        """Send a step on the event loop, skipping the writer thread's wake-up (the hot path).

        Only when nothing waits for the writer (order is kept). A step never blocks here:
        the engine sends one per worker at a time, after the previous one came back, so the
        worker is reading its pipe; it is a few hundred bytes per tick.
        """
        if proc.enqueued != proc.sent or not proc.send_lock.acquire(blocking=False):
            return False
        try:
            if proc.enqueued != proc.sent:
                return False
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):  # the reader sees a death
                proc.conn.send(message)
            return True
        finally:
            proc.send_lock.release()

    def shared_frame_slots(self, worker: int) -> int:
        """How many chunks of a step the worker hands over in shared memory (0: all through the pipe)."""
        proc = self._procs[worker]
        return 0 if proc is None or proc.frames is None else proc.frames.slots

    def kill(self, worker: int) -> None:
        proc = self._procs[worker]
        if proc is not None and proc.process.is_alive():
            proc.process.kill()

    def pid(self, worker: int) -> int | None:
        proc = self._procs[worker]
        return None if proc is None else proc.process.pid

    # -- threads -----------------------------------------------------------------------

    @staticmethod
    def _write(proc: _Proc) -> None:
        while True:
            message = proc.outbox.get()
            if message is None:
                return
            with proc.send_lock:
                try:
                    proc.conn.send(message)
                except (BrokenPipeError, EOFError, OSError):
                    return  # the reader sees the death
                finally:
                    proc.sent += 1

    def _read(self, proc: _Proc, loop: asyncio.AbstractEventLoop) -> None:
        conn = proc.conn
        try:
            post(loop, _settle, proc.ready, conn.recv())
            while True:
                request_id, ok, payload = conn.recv()
                if ok is None:  # a part of a step's chunk, ahead of the step's reply
                    post(loop, self._part, proc.life, request_id, payload)
                    continue
                if isinstance(payload, PackedStep):
                    assert proc.frames is not None
                    payload = proc.frames.unpack(payload)  # before the next step may reuse the slots
                if request_id == proc.frames_request:
                    proc.frames_request = None
                post(loop, self._deliver, proc.life, request_id, (ok, payload))
        except (EOFError, OSError):
            pass
        except BaseException as error:  # a reply that cannot be unpickled: treat the worker as broken
            proc.process.kill()
            post(loop, _settle, proc.ready, ("start_failed", f"worker {proc.life.index}: {error}"))
        proc.process.join(5.0)
        post(loop, self._on_exit, proc)

    # -- on the event loop ---------------------------------------------------------------

    def _on_exit(self, proc: _Proc) -> None:
        proc.exited = True
        proc.outbox.put(None)
        proc.conn.close()
        if proc.frames is not None:
            proc.frames.close()
        index, pid = proc.life.index, proc.process.pid
        status = _describe_exit(proc.process.exitcode)
        _settle(
            proc.ready,
            (
                "start_failed",
                f"worker {index} (pid {pid}) {status} while starting (see its stderr; a script "
                "that starts a runtime needs an `if __name__ == '__main__':` guard, as spawned workers import it).",
            ),
        )
        self._life_lost(
            proc.life,
            WorkerDiedError(
                f"worker {index} (pid {pid}) died ({status}); the session states it held are "
                "lost, reset the session to start over."
            ),
        )

    # -- stopping ----------------------------------------------------------------------

    def _kill_at_exit(self) -> None:
        """At interpreter exit, for a runtime never closed: kill the workers, unlink the buffers."""
        for proc in self._procs:
            if proc is None:
                continue
            proc.life.closing = True
            with contextlib.suppress(Exception):
                proc.process.kill()
                proc.process.join(5.0)
            if proc.frames is not None:
                with contextlib.suppress(Exception):
                    proc.frames.close()

    async def _stop_workers(self) -> None:
        atexit.unregister(self._kill_at_exit)
        procs = [proc for proc in self._procs if proc is not None]
        for proc in procs:
            proc.outbox.put((-1, SHUTDOWN, (), False))
        loop = self._require_loop()
        await asyncio.gather(*(loop.run_in_executor(None, _stop, proc) for proc in procs))
        for proc in procs:
            if proc.frames is not None:
                proc.frames.close()


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _stop(proc: _Proc) -> None:
    process = proc.process
    process.join(5.0)
    if process.is_alive():
        process.kill()
        process.join(5.0)
    if proc.reader is not None:
        proc.reader.join(5.0)
