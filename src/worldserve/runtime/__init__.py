"""The runtime: sessions' ticks scheduled onto workers that own their model state.

Data flows one way: session -> :mod:`~worldserve.runtime.engine` (batching, affinity,
deadlines) -> :mod:`~worldserve.runtime.executor` (in-process or multi-process) ->
:mod:`~worldserve.runtime.runner` (states, residency) -> the model. Needs numpy.
"""

from __future__ import annotations

from worldserve.runtime.chunk import Chunk
from worldserve.runtime.config import RuntimeConfig
from worldserve.runtime.engine import Engine, EngineConfig
from worldserve.runtime.errors import (
    AdmissionRefusedError,
    BadModelOutputError,
    DeadlineExceededError,
    ModelStepError,
    OutOfSyncError,
    RPCTimeoutError,
    RuntimeClosedError,
    SessionEvictedError,
    SessionNotResidentError,
    TickFailedError,
    UnknownSessionError,
    WorkerDiedError,
    WorkerStartError,
)
from worldserve.runtime.executor import Executor, InprocExecutor, MultiprocExecutor
from worldserve.runtime.messages import ChunkPart, ResidencyLimits, WorkerConfig
from worldserve.runtime.metrics import EngineStats
from worldserve.runtime.runner import ModelRunner
from worldserve.runtime.runtime import Runtime, RuntimeStats

__all__ = [
    "AdmissionRefusedError",
    "BadModelOutputError",
    "Chunk",
    "ChunkPart",
    "DeadlineExceededError",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Executor",
    "InprocExecutor",
    "ModelRunner",
    "ModelStepError",
    "MultiprocExecutor",
    "OutOfSyncError",
    "RPCTimeoutError",
    "ResidencyLimits",
    "Runtime",
    "RuntimeClosedError",
    "RuntimeConfig",
    "RuntimeStats",
    "SessionEvictedError",
    "SessionNotResidentError",
    "TickFailedError",
    "UnknownSessionError",
    "WorkerConfig",
    "WorkerDiedError",
    "WorkerStartError",
]
