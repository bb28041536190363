"""The one error vocabulary: every stable code, where it may occur, and the exception tree.

Owns: :class:`ErrorCode` (each code once), :data:`CODES` (for each code: whose fault it
is, the surfaces where a client or caller may meet it, what it means and what to do),
and the exception hierarchy under one base, :class:`SessionError`, with one class per
code that an exception carries (h11's single error tree is the model). The server's
wire codes, the documentation's tables (:func:`markdown_table`) and the metrics' label
values all follow from here; ``tests/test_errors.py`` fails when a code is added in one
place and not the others.

Two branches hang under the base: the control plane's errors (the seed's, raised by
:mod:`worldserve.session`) and :class:`RuntimeFailure`, the errors the runtime raises
(engine, executors, workers), which cross a process as ``(code, message)`` and come
back as the same class through :func:`error_from_code`.

Must not know: sessions' logic, transports, models. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "CODES",
    "AdmissionRefusedError",
    "BadModelOutputError",
    "CancelUnsupportedError",
    "ChunkCancelledError",
    "ChunkMetadataError",
    "CodeInfo",
    "DeadlineExceededError",
    "ErrorCode",
    "EventQueueFullError",
    "Fault",
    "InvalidEventError",
    "ModelStepError",
    "NothingToCancelError",
    "OutOfSyncError",
    "RPCTimeoutError",
    "RuntimeClosedError",
    "RuntimeFailure",
    "SessionError",
    "SessionEvictedError",
    "SessionExistsError",
    "SessionNotResidentError",
    "SessionStateError",
    "StaleEventError",
    "Surface",
    "TickFailedError",
    "UnknownSessionError",
    "WorkerDiedError",
    "WorkerStartError",
    "codes_at",
    "error_from_code",
    "exception_table",
    "markdown_table",
]


class ErrorCode(StrEnum):
    """Every stable error code, each once. Values never change; new codes are added."""

    # A client message that cannot be taken (the connection and its session go on).
    INVALID_JSON = "invalid_json"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    MESSAGE_TOO_LARGE = "message_too_large"
    RATE_LIMITED = "rate_limited"
    NO_SESSION = "no_session"
    SESSION_EXISTS = "session_exists"
    UNKNOWN_MODEL = "unknown_model"
    INVALID_IMAGE = "invalid_image"
    RESUME_REFUSED = "resume_refused"
    JOIN_REFUSED = "join_refused"
    NOT_CONTROLLER = "not_controller"
    # The control plane (the seed's errors).
    SESSION_ERROR = "session_error"
    INVALID_STATE = "invalid_state"
    INVALID_CONTROL = "invalid_control"
    STALE_EVENT = "stale_event"
    QUEUE_FULL = "queue_full"
    METADATA_MISMATCH = "metadata_mismatch"
    TICK_FAILED = "tick_failed"
    RESET_FAILED = "reset_failed"
    CLEANUP_FAILED = "cleanup_failed"
    CANCELLED = "cancelled"
    CHUNK_CANCELLED = "chunk_cancelled"
    NOTHING_TO_CANCEL = "nothing_to_cancel"
    CANCEL_UNSUPPORTED = "cancel_unsupported"
    # The runtime.
    RUNTIME_ERROR = "runtime_error"
    ADMISSION_REFUSED = "admission_refused"
    EVICTED = "evicted"
    OUT_OF_SYNC = "out_of_sync"
    NOT_RESIDENT = "not_resident"
    UNKNOWN_SESSION = "unknown_session"
    MODEL_ERROR = "model_error"
    BAD_OUTPUT = "bad_output"
    WORKER_DIED = "worker_died"
    WORKER_START_FAILED = "worker_start_failed"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    RPC_TIMEOUT = "rpc_timeout"
    RUNTIME_CLOSED = "runtime_closed"
    # The server's own fault.
    INTERNAL_ERROR = "internal_error"


class Fault(StrEnum):
    """Whose fault an error is (h11's local/remote split): fix the request, or retry/reset."""

    CLIENT = "client"
    SERVER = "server"


class Surface(StrEnum):
    """Where a code may reach a client or caller."""

    #: an ``error`` reply to any client message (the message was not taken)
    MESSAGE = "message"
    #: an ``error`` reply to ``input.event`` (the event was not accepted)
    EVENT = "event"
    #: an ``error`` reply to ``session.start`` (no session was created); ``Runtime.create_session``
    START = "start"
    #: ``session.failed`` after a tick: the session failed closed and takes only reset or close
    TICK = "tick"
    #: ``session.failed`` in reply to ``session.reset`` / ``session.close``
    LIFECYCLE = "lifecycle"
    #: raised by the Python API only (never on the wire)
    API = "api"


@dataclass(frozen=True, slots=True)
class CodeInfo:
    """One code: whose fault, where it may occur, what it means, what to do."""

    fault: Fault
    surfaces: frozenset[Surface]
    meaning: str
    remedy: str


def _info(fault: Fault, surfaces: str, meaning: str, remedy: str) -> CodeInfo:
    return CodeInfo(fault, frozenset(Surface(name) for name in surfaces.split()), meaning, remedy)


_C, _S = Fault.CLIENT, Fault.SERVER

#: Every code's documentation; :class:`ErrorCode` and this table must list the same codes.
CODES: Mapping[ErrorCode, CodeInfo] = MappingProxyType(
    {
        ErrorCode.INVALID_JSON: _info(_C, "message", "the text is not JSON", "send JSON"),
        ErrorCode.INVALID_MESSAGE: _info(
            _C,
            "message event",
            "wrong shape or types (strict: no coercion, no unknown fields), a binary message, text that is not "
            "valid Unicode (an unpaired surrogate), an empty event, a repeated track",
            "fix the message",
        ),
        ErrorCode.UNKNOWN_TYPE: _info(_C, "message", "`type` is not one of the client messages", "see the protocol"),
        ErrorCode.MESSAGE_TOO_LARGE: _info(
            _C,
            "message",
            "over `--max-message-bytes` (256 KiB); a `session.start`, which may carry images, over "
            "`--max-start-bytes` (4 MiB)",
            "send less",
        ),
        ErrorCode.RATE_LIMITED: _info(
            _C, "event", "more input events than `--event-rate`/`--event-burst` allow", "slow down; resend the event"
        ),
        ErrorCode.NO_SESSION: _info(
            _C, "message event", "a session message before `session.start` (or after `session.closed`)", "start first"
        ),
        ErrorCode.SESSION_EXISTS: _info(
            _C,
            "message start api",
            "a `session.start`, `session.resume` or `session.join` while this connection's session is open; a "
            "session id already in use",
            "close the session first",
        ),
        ErrorCode.UNKNOWN_MODEL: _info(_C, "start", "`model` is not the served model", "see `GET /v1/models`"),
        ErrorCode.INVALID_IMAGE: _info(
            _C,
            "start",
            "the start image is not base64 PNG/JPEG/raw RGB of the frame size (its header is checked before "
            "any decoding), or the model starts from an image (`requires_image`) and none was sent; or "
            "`references` names a slot the model lacks, misses one of its slots, cannot be decoded, or the model "
            "takes none",
            "send an image of the model's frame size; send every reference slot or none",
        ),
        ErrorCode.RESUME_REFUSED: _info(
            _C,
            "message",
            "`session.resume` with an unknown, closed or expired session, or a wrong token (which of these is not "
            "said)",
            "start a new session",
        ),
        ErrorCode.JOIN_REFUSED: _info(
            _C,
            "message",
            "`session.join` with an unknown or closed session, or a token that does not grant the role (which of "
            "these is not said)",
            "ask the host for a share link",
        ),
        ErrorCode.NOT_CONTROLLER: _info(
            _C,
            "message event",
            "a viewer sent `input.event`, `session.reset` or `chunk.cancel`",
            "join as a controller",
        ),
        ErrorCode.SESSION_ERROR: _info(
            _S, "lifecycle api", "a worker lifecycle RPC is unsupported or failed", "close the session"
        ),
        ErrorCode.INVALID_STATE: _info(
            _C,
            "event api",
            "the session is failed, resetting or closing (or the operation does not fit its status)",
            "`session.reset` after `session.failed`",
        ),
        ErrorCode.INVALID_CONTROL: _info(
            _C, "event", "the model refuses a control (track, schema or data)", "see the model's control schemas"
        ),
        ErrorCode.STALE_EVENT: _info(
            _C,
            "event",
            "`event_id` at or below the session's event floor (the last applied or dropped id, or the highest id "
            "of the chunk in flight)",
            "use increasing ids",
        ),
        ErrorCode.QUEUE_FULL: _info(_C, "event", "`max_pending_events` events are queued", "wait for a chunk"),
        ErrorCode.METADATA_MISMATCH: _info(
            _S, "tick", "the model's chunk metadata did not echo its tick", "reset the session"
        ),
        ErrorCode.TICK_FAILED: _info(_S, "tick", "the tick raised an error without a code of its own", "reset"),
        ErrorCode.RESET_FAILED: _info(
            _S, "lifecycle", "the worker could not reset the session", "reset again or close"
        ),
        ErrorCode.CLEANUP_FAILED: _info(
            _S, "lifecycle", "the worker could not release the session's state", "close again"
        ),
        ErrorCode.CANCELLED: _info(_S, "tick api", "the tick was cancelled (the session fails closed)", "reset"),
        ErrorCode.CHUNK_CANCELLED: _info(
            _C,
            "api",
            "`next_chunk()` gave no chunk: `cancel_chunk()` cancelled it (the session is still active at its last "
            "commit, the chunk's events still queued)",
            "call `next_chunk()` again",
        ),
        ErrorCode.NOTHING_TO_CANCEL: _info(
            _C,
            "message api",
            "`chunk.cancel` while no chunk is being generated (or the one in flight has already been made and is "
            "being committed)",
            "nothing to do: that chunk arrives",
        ),
        ErrorCode.CANCEL_UNSUPPORTED: _info(
            _C,
            "message api",
            "the model cannot roll a session back to its last commit (its spec says `can_rollback: false`), so the "
            "chunk it is making cannot be cancelled; the session goes on",
            "wait for the chunk",
        ),
        ErrorCode.RUNTIME_ERROR: _info(
            _S, "tick start api", "the runtime failed in a way no other code names", "reset; report it"
        ),
        ErrorCode.ADMISSION_REFUSED: _info(
            _S,
            "start lifecycle api",
            "no worker can take a new session now (all full, stalled in a step, restarting, or their chunk clock "
            "cannot hold real time with one more)",
            "retry after `retry_after_ms`, here or on another front-end",
        ),
        ErrorCode.EVICTED: _info(
            _S, "tick", "the session's state was evicted (not in use, least recently used) for another session", "reset"
        ),
        ErrorCode.OUT_OF_SYNC: _info(_S, "tick", "a tick did not continue its state's own chunk count", "reset"),
        ErrorCode.NOT_RESIDENT: _info(_S, "tick", "the session holds no state on any worker", "reset"),
        ErrorCode.UNKNOWN_SESSION: _info(
            _C, "tick api", "the runtime never admitted this session", "create sessions through the runtime"
        ),
        ErrorCode.MODEL_ERROR: _info(
            _S, "tick start lifecycle", "the model raised while making this session's chunk or state", "reset"
        ),
        ErrorCode.BAD_OUTPUT: _info(_S, "tick", "the model returned something that is not this tick's chunk", "reset"),
        ErrorCode.WORKER_DIED: _info(
            _S, "tick lifecycle api", "the worker holding the session's state died; the state is lost", "reset"
        ),
        ErrorCode.WORKER_START_FAILED: _info(
            _S, "api", "a worker could not start (its model failed to load)", "see the worker's log; check the model"
        ),
        ErrorCode.DEADLINE_EXCEEDED: _info(_S, "tick", "the tick missed the runtime's deadline", "reset"),
        ErrorCode.RPC_TIMEOUT: _info(
            _S, "start lifecycle api", "a worker did not answer a control call in time", "retry"
        ),
        ErrorCode.RUNTIME_CLOSED: _info(
            _S, "start tick api", "the runtime is shut down (or not started)", "connect to a running server"
        ),
        ErrorCode.INTERNAL_ERROR: _info(_S, "message start event", "a server bug", "report it"),
    }
)


def codes_at(surface: Surface) -> tuple[ErrorCode, ...]:
    """The codes that may occur at ``surface``, in :class:`ErrorCode` order."""
    return tuple(code for code in ErrorCode if surface in CODES[code].surfaces)


def markdown_table(surfaces: tuple[Surface, ...]) -> str:
    """The docs' table of the codes met at any of ``surfaces`` (``python -m worldserve.errors``)."""
    rows = ["| code | fault | cause | what to do |", "|---|---|---|---|"]
    for code in ErrorCode:
        info = CODES[code]
        if info.surfaces.intersection(surfaces):
            rows.append(f"| `{code.value}` | {info.fault.value} | {info.meaning} | {info.remedy} |")
    return "\n".join(rows)


# -- the exception tree --------------------------------------------------------------------


class SessionError(RuntimeError):
    """The base of every worldserve error; ``code`` is its stable :class:`ErrorCode`.

    ``code`` is a class attribute; an instance may carry another string (a model's own
    error class may bring one, such as ``model_oom``; an unknown code from a worker stays
    visible rather than being flattened).
    """

    code: str = ErrorCode.SESSION_ERROR


class SessionStateError(SessionError):
    """The operation is invalid in the session's current status."""

    code = ErrorCode.INVALID_STATE


class SessionExistsError(SessionStateError):
    """A session with this id already exists (a ``SessionStateError``, as in the seed)."""

    code = ErrorCode.SESSION_EXISTS


class EventQueueFullError(SessionError):
    """Accepting the event would exceed the bounded queue; retry after a chunk."""

    code = ErrorCode.QUEUE_FULL


class StaleEventError(SessionError):
    """The event id is at or below the session's event floor."""

    code = ErrorCode.STALE_EVENT


class ChunkMetadataError(SessionError):
    """The tick consumer returned metadata for a different chunk."""

    code = ErrorCode.METADATA_MISMATCH


class InvalidEventError(SessionError, ValueError):
    """The model cannot take an event's controls; raised at acceptance, not at its chunk."""

    code = ErrorCode.INVALID_CONTROL


class ChunkCancelledError(SessionError):
    """``next_chunk()`` made no chunk: ``cancel_chunk()`` cancelled it; the session stays active."""

    code = ErrorCode.CHUNK_CANCELLED


class NothingToCancelError(SessionError):
    """No chunk is being generated that could still be cancelled."""

    code = ErrorCode.NOTHING_TO_CANCEL


class CancelUnsupportedError(SessionError):
    """The backend cannot roll the session back to its last commit, so its chunk cannot be cancelled."""

    code = ErrorCode.CANCEL_UNSUPPORTED


class RuntimeFailure(SessionError):
    """Base of the errors the runtime raises (engine, executors, workers).

    They cross a process as ``(code, message)`` and are rebuilt by :func:`error_from_code`.
    """

    code: str = ErrorCode.RUNTIME_ERROR


#: The former name of :class:`RuntimeFailure` (it is the base of errors that are not tick failures).
TickFailedError = RuntimeFailure


class SessionEvictedError(RuntimeFailure):
    """The session's state was evicted (not in use, least recently used) to admit another; reset it."""

    code = ErrorCode.EVICTED


class OutOfSyncError(RuntimeFailure):
    """A tick's ``chunk_index`` does not continue its state's own count; the state was released."""

    code = ErrorCode.OUT_OF_SYNC


class SessionNotResidentError(RuntimeFailure):
    """The session holds no state on any worker (it failed and was released); reset it."""

    code = ErrorCode.NOT_RESIDENT


class UnknownSessionError(RuntimeFailure):
    """The runtime never admitted this session (create sessions through the runtime)."""

    code = ErrorCode.UNKNOWN_SESSION


class AdmissionRefusedError(RuntimeFailure):
    """No worker can make room for another session now; close one or try again later.

    ``retry_after_s`` is a hint for when to try again (None: no estimate).
    """

    code = ErrorCode.ADMISSION_REFUSED

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelStepError(RuntimeFailure):
    """The model raised while generating this session's chunk (or state); its state was released."""

    code = ErrorCode.MODEL_ERROR


class BadModelOutputError(RuntimeFailure):
    """The model returned something that is not this tick's chunk; its state was released."""

    code = ErrorCode.BAD_OUTPUT


class WorkerDiedError(RuntimeFailure):
    """The worker holding the session's state died; the state is lost, reset to go on."""

    code = ErrorCode.WORKER_DIED


class WorkerStartError(RuntimeFailure):
    """A worker could not start (its model failed to load)."""

    code = ErrorCode.WORKER_START_FAILED


class DeadlineExceededError(RuntimeFailure):
    """The tick did not finish within the runtime's deadline; the session failed closed."""

    code = ErrorCode.DEADLINE_EXCEEDED


class RPCTimeoutError(RuntimeFailure):
    """A worker did not answer a control RPC in time."""

    code = ErrorCode.RPC_TIMEOUT


class RuntimeClosedError(RuntimeFailure):
    """The runtime is shut down (or not started)."""

    code = ErrorCode.RUNTIME_CLOSED


_RUNTIME_CLASSES: Mapping[str, type[RuntimeFailure]] = MappingProxyType(
    {
        cls.code: cls
        for cls in (
            RuntimeFailure,
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
)


def error_from_code(code: str, message: str) -> RuntimeFailure:
    """The runtime error a ``(code, message)`` pair names (the base class for another code)."""
    error = _RUNTIME_CLASSES.get(code, RuntimeFailure)(message)
    if type(error) is RuntimeFailure and code != RuntimeFailure.code:
        error.code = code  # keep an unknown code visible rather than flattening it
    return error


def exception_table() -> str:
    """The docs' table of the exception tree: each class (indented under its base) and its code."""
    rows = ["| error | `code` |", "|---|---|"]

    def walk(cls: type[SessionError], depth: int) -> None:
        alias = " (formerly `TickFailedError`)" if cls is RuntimeFailure else ""
        rows.append(f"| {'&nbsp;&nbsp;' * depth}`{cls.__name__}`{alias} | `{cls.code}` |")
        for sub in cls.__subclasses__():
            if sub.__module__ == __name__:
                walk(sub, depth + 1)

    walk(SessionError, 0)
    return "\n".join(rows)


if __name__ == "__main__":  # python -m worldserve.errors: the docs' tables
    print("Wire errors (error replies):\n")
    print(markdown_table((Surface.MESSAGE, Surface.EVENT, Surface.START)))
    print("\nsession.failed codes:\n")
    print(markdown_table((Surface.TICK, Surface.LIFECYCLE)))
    print("\nThe exception tree:\n")
    print(exception_table())
