"""The immutable values that cross between the engine and a worker (often a process boundary).

Owns: :class:`WorkerConfig` (how a worker builds its model and runner), the per-tick
results of a step (:class:`TickOutput`, :class:`TickFailure`), :class:`ChunkPart` (a chunk's frames
handed on while its step still runs), :class:`StepReport`
(one step's results plus its compute and encoding times), :class:`ResidencyReport` and the name of the
runner call that undoes a session's last step (:data:`ROLLBACK_SESSION_RPC`). All are
frozen and picklable; frames travel as numpy arrays, or as
:class:`~worldserve.media.EncodedFrames` for a session that asked the runner to encode them.

Must not know: asyncio, pipes, sessions' logic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from worldserve.media import EncodedFrames
from worldserve.protocol import ChunkMetadata

__all__ = [
    "ROLLBACK_SESSION_RPC",
    "ChunkPart",
    "ResidencyLimits",
    "ResidencyReport",
    "StepReport",
    "TickFailure",
    "TickOutput",
    "WorkerConfig",
]

#: The runner call that undoes a session's last step (the engine's, to cancel a chunk in flight).
ROLLBACK_SESSION_RPC = "rollback_ar_diffusion_session"


@dataclass(frozen=True, slots=True)
class ResidencyLimits:
    """How many sessions one worker may hold: a count and/or a budget of state bytes.

    ``None`` means unlimited. The budget is divided by the model's ``spec.state_bytes``.
    """

    max_sessions: int | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_sessions", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None; got {value!r}.")

    def capacity(self, state_bytes: int) -> int | None:
        """Sessions that fit (``None``: unlimited)."""
        capacity = self.max_sessions
        if self.memory_budget_bytes is not None and state_bytes > 0:
            by_budget = self.memory_budget_bytes // state_bytes
            capacity = by_budget if capacity is None else min(capacity, by_budget)
        return capacity


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker needs to build its model and runner (picklable: it crosses to a process)."""

    model: str
    model_options: Mapping[str, Any] = field(default_factory=dict)
    limits: ResidencyLimits = ResidencyLimits()
    #: CPU threads for the worker's compute libraries (torch, OpenMP, BLAS); None leaves them be.
    cpu_threads: int | None = None


@dataclass(frozen=True, slots=True)
class TickOutput:
    """One tick's chunk: ``uint8 [frames, H, W, 3]`` (or, for a session with an encoding, its
    frames already encoded) and the metadata the model echoed."""

    frames: npt.NDArray[np.uint8] | EncodedFrames
    metadata: ChunkMetadata


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """Frames of a chunk still being made (a model with ``spec.frame_parts``, for a tick that asked).

    ``first`` is the index in the chunk of the part's first frame; ``frames`` are the part's frames,
    as :class:`TickOutput` would carry them (raw, or encoded in the session's JPEG or raw encoding).
    A chunk's parts, in order, are its frames; the step's :class:`TickOutput` still carries them all.
    A part is not a commit: the tick may yet fail, and then its parts are void.
    """

    session_id: str
    chunk_index: int
    first: int
    frames: npt.NDArray[np.uint8] | EncodedFrames

    @property
    def count(self) -> int:
        """Frames in the part."""
        return self.frames.count if isinstance(self.frames, EncodedFrames) else int(self.frames.shape[0])


@dataclass(frozen=True, slots=True)
class TickFailure:
    """One tick that failed; ``code`` is a :mod:`worldserve.runtime.errors` code."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class StepReport:
    """The results of one step request, in tick order, the time spent in ``model.step`` and
    the time spent encoding frames after it (sessions with an encoding; 0 otherwise)."""

    results: tuple[TickOutput | TickFailure, ...]
    compute_s: float
    encode_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ResidencyReport:
    """What one worker holds: resident sessions (least recently used first) and its limits."""

    worker: int
    resident: tuple[str, ...]
    capacity: int | None
    state_bytes: int
    evictions: int
