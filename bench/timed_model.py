"""A benchmark model whose ``step`` takes a set wall time: ``fixed_ms + per_session_ms * batch``.

It sleeps instead of computing, like a step running on an accelerator while the CPU
waits, so it measures the serving path (pacing, the chunk clock, batching, admission)
against a chosen step-time profile without competing for the CPU. The defaults follow
tinyworld's bfloat16 step on a quiet 2-core AVX-512 box (about 43 ms at batch 1 and
194 ms at batch 8, docs/tinyworld.md). It takes the world's controls and ignores them;
frames are cheap constant ``uint8`` chunks.
Loaded by name as ``timed_model:TimedModel`` with ``bench/`` on the path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from worldserve import ChunkMetadata, TickRequest, build_chunk_envelope
from worldserve.models import ModelSpec, SessionOptions
from worldserve.models.world import CONTROL_SCHEMAS


class TimedModel:
    def __init__(self, *, fixed_ms: float = 22.0, per_session_ms: float = 21.5, max_batch_size: int = 32) -> None:
        self._fixed_s = fixed_ms / 1000.0
        self._per_session_s = per_session_ms / 1000.0
        self._spec = ModelSpec(
            name="timed",
            frames_per_chunk=4,
            fps=16.0,
            height=48,
            width=48,
            controls=CONTROL_SCHEMAS,  # the world's keys and camera, so `worldserve bench` can steer
            max_batch_size=max_batch_size,
            state_bytes=1024,
            atomic_step=True,
        )

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def new_state(self, session_id: str, options: SessionOptions) -> dict[str, int]:
        return {"seed": options.seed}

    def step(self, batch: Sequence[tuple[Any, TickRequest]]) -> list[dict[str, Any]]:
        time.sleep(self._fixed_s + self._per_session_s * len(batch))
        shape = (self._spec.frames_per_chunk, self._spec.height, self._spec.width, 3)
        return [
            build_chunk_envelope(
                np.full(shape, (state["seed"] + tick.chunk_index) % 256, np.uint8), ChunkMetadata.from_tick(tick)
            )
            for state, tick in batch
        ]

    def release(self, state: Any) -> None:
        pass
