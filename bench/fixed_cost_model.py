"""A benchmark model whose ``step`` costs a fixed compute that barely grows with the batch.

Each step multiplies a fixed square matrix ``repeats`` times, whatever the batch size
(like a memory-bound batched forward on an accelerator), then emits cheap
``uint8 [frames, H, W, 3]`` frames per tick. Loaded by name in worker processes as
``fixed_cost_model:FixedCostModel`` (``bench/`` is on their ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from worldserve import ChunkMetadata, TickRequest, build_chunk_envelope
from worldserve.models import ModelSpec, SessionOptions


class FixedCostModel:
    def __init__(
        self,
        *,
        matrix: int = 256,
        repeats: int = 1,
        max_batch_size: int = 64,
        height: int = 48,
        width: int = 48,
        frames_per_chunk: int = 4,
    ) -> None:
        self._matrix = np.random.default_rng(0).standard_normal((matrix, matrix)).astype(np.float32) / matrix**0.5
        self._repeats = repeats
        self._spec = ModelSpec(
            name="fixed-cost",
            frames_per_chunk=frames_per_chunk,
            fps=16.0,
            height=height,
            width=width,
            controls=(),
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
        x = self._matrix
        for _ in range(self._repeats):
            x = self._matrix @ x
        shape = (self._spec.frames_per_chunk, self._spec.height, self._spec.width, 3)
        return [
            build_chunk_envelope(
                np.full(shape, (state["seed"] + tick.chunk_index) % 256, np.uint8), ChunkMetadata.from_tick(tick)
            )
            for state, tick in batch
        ]

    def release(self, state: Any) -> None:
        pass
