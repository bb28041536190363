"""The worker side: build the model and runner, answer calls in order; a worker process's main loop.

Owns: turning one call into a reply for any executor (:func:`answer`: exceptions become
``(code, message)``), and the child side of one multiprocess worker -- it loads the model by name (so heavy
model libraries are imported only here), sends ``("ready", pid, spec)`` or
``("start_failed", message)``, then answers each ``(request_id, method, args, use_frames)``
with ``(request_id, True, result)`` or ``(request_id, False, (code, message))``
(:func:`answer`); a step whose args name sessions to hand on in parts sends each
:class:`~worldserve.runtime.messages.ChunkPart` first, as ``(request_id, None, part)``. Exceptions never cross the
pipe; only codes and messages do. A step's ticks arrive in
:mod:`~worldserve.runtime.wire`'s compact form. A step's frames go through
the parent's shared-memory :class:`~worldserve.runtime.framebuf.FrameBuffer` when the
parent allows it (``use_frames``) and they fit.

Must not know: asyncio, the engine's routing or batching, sessions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from worldserve.models import load_model
from worldserve.runtime.errors import TickFailedError
from worldserve.runtime.framebuf import FrameBuffer
from worldserve.runtime.messages import ChunkPart, StepReport, WorkerConfig
from worldserve.runtime.runner import STEP, ModelRunner
from worldserve.runtime.wire import decode_ticks

__all__ = ["ATTACH_FRAMES", "SHUTDOWN", "Reply", "answer", "build_runner", "limit_threads", "run_worker", "serve"]

_log = logging.getLogger(__name__)

#: The method name that ends a worker's loop.
SHUTDOWN = "__shutdown__"
#: The method name that attaches the parent's shared-memory frame buffer: ``(name, slots, shape)``.
ATTACH_FRAMES = "__attach_frames__"

#: A worker's answer to one call: ``(True, result)`` or ``(False, (code, message))``.
Reply = tuple[bool, Any]


def build_runner(config: WorkerConfig, worker: int) -> ModelRunner:
    """Load the configured model and wrap it in a runner; frames are encoded on the worker's CPU
    threads (``cpu_threads``, default 1)."""
    model = load_model(config.model, **dict(config.model_options))
    return ModelRunner(model, config.limits, worker=worker, encode_threads=config.cpu_threads or 1)


def answer(
    runner: ModelRunner,
    method: str,
    args: Sequence[Any],
    worker: int,
    on_part: Callable[[ChunkPart], None] | None = None,
) -> Reply:
    """Run one call on a runner, on the worker's side; exceptions become ``(code, message)``.

    Exceptions never cross a boundary (a thread, a pipe, a machine): only codes and
    messages do, and the executor's base turns them back into the coded error. A step's
    parts go to ``on_part`` (``args``: the ticks and the sessions to hand on in parts, if any).
    """
    try:
        if method == STEP and on_part is not None and len(args) > 1 and args[1]:
            ticks, parted = args
            return True, runner.step(ticks, parted, on_part)
        return True, runner.call(method, args)
    except TickFailedError as error:
        return False, (error.code, str(error))
    except Exception as error:
        _log.exception("worker %d: %s failed", worker, method)
        return False, ("runtime_error", f"worker {worker}: {method} raised {type(error).__name__}: {error}")


def limit_threads(threads: int) -> None:
    """Cap this process's compute threads; call before the model's libraries load.

    OpenMP, MKL and OpenBLAS read their environment when they load (torch reads
    ``OMP_NUM_THREADS``); torch, if already imported, is told directly.
    """
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def run_worker(conn: Connection, config: WorkerConfig, worker: int) -> None:
    """The process entry point (``multiprocessing`` spawn target)."""
    # The parent owns shutdown: a Ctrl-C in its terminal, or a SIGTERM sent to its whole process
    # group (systemd's default KillMode, `timeout`, `kill -- -PGID`), must not kill workers under
    # its graceful stop. It stops them itself (SHUTDOWN, then SIGKILL); a worker whose parent is
    # gone exits when its pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.cpu_threads is not None:
        limit_threads(config.cpu_threads)
    try:
        runner = build_runner(config, worker)
    except BaseException as error:
        conn.send(
            ("start_failed", f"worker {worker} could not load model {config.model!r}: {type(error).__name__}: {error}")
        )
        return
    conn.send(("ready", os.getpid(), runner.spec))
    serve(conn, runner, worker)


def serve(conn: Connection, runner: ModelRunner, worker: int) -> None:
    """Answer calls until the pipe closes or :data:`SHUTDOWN` arrives."""
    frames: FrameBuffer | None = None
    try:
        while True:
            try:
                request_id, method, args, use_frames = conn.recv()
            except (EOFError, OSError):
                return
            if method == SHUTDOWN:
                return
            result: Any
            if method == ATTACH_FRAMES:
                try:
                    frames = FrameBuffer.attach(*args)
                    ok, result = True, True
                except Exception as error:
                    ok, result = False, ("runtime_error", f"worker {worker}: cannot attach frames: {error}")
            else:
                on_part = None
                if method == STEP:
                    args = (decode_ticks(args[0]), *args[1:])
                    on_part = _sender(conn, request_id)  # used if the step names sessions to hand on in parts
                ok, result = answer(runner, method, args, worker, on_part)
                if ok and use_frames and frames is not None and isinstance(result, StepReport):
                    result = frames.pack(result) or result
            try:
                conn.send((request_id, ok, result))
            except (BrokenPipeError, EOFError, OSError):
                return
            except Exception as error:  # e.g. a result that cannot be pickled
                conn.send(
                    (request_id, False, ("runtime_error", f"worker {worker}: {method} reply not sendable: {error}"))
                )
    finally:
        if frames is not None:
            frames.close()


def _sender(conn: Connection, request_id: int) -> Callable[[ChunkPart], None]:
    """Sends a step's parts down the pipe ahead of its reply (a broken pipe: the parent sees the death)."""

    def send(part: ChunkPart) -> None:
        with contextlib.suppress(BrokenPipeError, EOFError, OSError):
            conn.send((request_id, None, part))

    return send
