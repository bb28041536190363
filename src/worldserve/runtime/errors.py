"""The runtime's client-facing errors, each with a stable ``code``.

Owns: the :class:`~worldserve.session.SessionError` subclasses the runtime raises
(a session that fails because of one records its ``code``), and the mapping from a
code back to its class, so a worker process sends ``(code, message)`` over a pipe and
the engine re-raises the same error type; exceptions themselves never cross a process.

Must not know: sessions' logic, executors, models. Standard library only.
"""

from __future__ import annotations

from worldserve.session import SessionError

__all__ = [
    "AdmissionRefusedError",
    "BadModelOutputError",
    "DeadlineExceededError",
    "ModelStepError",
    "OutOfSyncError",
    "RPCTimeoutError",
    "RuntimeClosedError",
    "SessionEvictedError",
    "SessionNotResidentError",
    "TickFailedError",
    "UnknownSessionError",
    "WorkerDiedError",
    "WorkerStartError",
    "error_from_code",
]


class TickFailedError(SessionError):
    """Base of the runtime's errors; the message says what happened and what to do."""

    code = "runtime_error"


class SessionEvictedError(TickFailedError):
    """The session's state was evicted (idle, least recently used) to admit another; reset it."""

    code = "evicted"


class OutOfSyncError(TickFailedError):
    """A tick's ``chunk_index`` does not continue its state's own count; the state was released."""

    code = "out_of_sync"


class SessionNotResidentError(TickFailedError):
    """The session holds no state on any worker (it failed and was released); reset it."""

    code = "not_resident"


class UnknownSessionError(TickFailedError):
    """The runtime never admitted this session (create sessions through the runtime)."""

    code = "unknown_session"


class AdmissionRefusedError(TickFailedError):
    """No worker can make room for another session now; close one or try again later."""

    code = "admission_refused"


class ModelStepError(TickFailedError):
    """The model raised while generating this session's chunk; its state was released."""

    code = "model_error"


class BadModelOutputError(TickFailedError):
    """The model returned something that is not this tick's chunk; its state was released."""

    code = "bad_output"


class WorkerDiedError(TickFailedError):
    """The worker process holding the session's state died; the state is lost, reset to go on."""

    code = "worker_died"


class WorkerStartError(TickFailedError):
    """A worker could not start (its model failed to load)."""

    code = "worker_start_failed"


class DeadlineExceededError(TickFailedError):
    """The tick did not finish within the runtime's deadline; the session failed closed."""

    code = "deadline_exceeded"


class RPCTimeoutError(TickFailedError):
    """A worker did not answer a control RPC in time."""

    code = "rpc_timeout"


class RuntimeClosedError(TickFailedError):
    """The runtime is shut down (or not started)."""

    code = "runtime_closed"


_BY_CODE: dict[str, type[TickFailedError]] = {
    cls.code: cls
    for cls in (
        TickFailedError,
        SessionEvictedError,
        OutOfSyncError,
        SessionNotResidentError,
        UnknownSessionError,
        AdmissionRefusedError,
        ModelStepError,
        BadModelOutputError,
        WorkerDiedError,
        WorkerStartError,
        DeadlineExceededError,
        RPCTimeoutError,
        RuntimeClosedError,
    )
}


def error_from_code(code: str, message: str) -> TickFailedError:
    """The error a ``(code, message)`` pair names (the base class for an unknown code)."""
    error = _BY_CODE.get(code, TickFailedError)(message)
    if type(error) is TickFailedError and code != TickFailedError.code:
        error.code = code  # keep an unknown code visible rather than flattening it
    return error
