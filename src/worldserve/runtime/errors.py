"""The runtime's client-facing errors, re-exported from :mod:`worldserve.errors`.

Owns nothing of its own: every code and class lives in :mod:`worldserve.errors` (one
vocabulary for the control plane, the runtime and the server). The runtime's branch of
that tree is :class:`RuntimeFailure`; a worker process sends ``(code, message)`` and
:func:`error_from_code` rebuilds the same class on the engine's side, so exceptions
themselves never cross a process.

Must not know: sessions' logic, executors, models. Standard library only.
"""

from __future__ import annotations

from worldserve.errors import (
    AdmissionRefusedError,
    BadModelOutputError,
    DeadlineExceededError,
    ModelStepError,
    OutOfSyncError,
    RPCTimeoutError,
    RuntimeClosedError,
    RuntimeFailure,
    SessionEvictedError,
    SessionNotResidentError,
    TickFailedError,
    UnknownSessionError,
    WorkerDiedError,
    WorkerStartError,
    error_from_code,
)

__all__ = [
    "AdmissionRefusedError",
    "BadModelOutputError",
    "DeadlineExceededError",
    "ModelStepError",
    "OutOfSyncError",
    "RPCTimeoutError",
    "RuntimeClosedError",
    "RuntimeFailure",
    "SessionEvictedError",
    "SessionNotResidentError",
    "TickFailedError",
    "UnknownSessionError",
    "WorkerDiedError",
    "WorkerStartError",
    "error_from_code",
]
