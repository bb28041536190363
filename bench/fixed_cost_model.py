"""A benchmark model whose ``step`` costs a fixed compute that barely grows with the batch.

Each step multiplies a fixed square matrix ``repeats`` times, whatever the batch size
(like a memory-bound batched forward on an accelerator), then emits cheap
``uint8 [frames, H, W, 3]`` frames per tick: flat colours, or with ``texture=True`` a pan
across a textured panorama (smooth waves plus grain, made once), which compresses like
video frames do (JPEG q90 at 480x832: ~150 KB a frame, ~10x smaller than raw). ``wait_ms``
adds a wait per step with the CPU idle, like a step running on an accelerator. Loaded by name in worker processes as
``fixed_cost_model:FixedCostModel`` (``bench/`` is on their ``sys.path``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from worldserve import ChunkMetadata, TickRequest, build_chunk_envelope
from worldserve.models import ModelSpec, SessionOptions

_PAN = 8  # pixels the view moves per frame


def _panorama(height: int, width: int) -> np.ndarray:
    """A textured image: a few sine waves per channel and some grain."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.full((height, width, 3), 128.0, np.float32)
    for channel in range(3):
        for k in range(4):
            fx, fy = rng.uniform(0.002, 0.05, 2)
            image[..., channel] += np.sin(x * fx + y * fy + rng.uniform(0, 6.28)) * (40 / (k + 1))
    image += rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


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
        texture: bool = False,
        wait_ms: float = 0.0,
    ) -> None:
        self._wait_s = wait_ms / 1000.0
        self._panorama = _panorama(height, width + _PAN * frames_per_chunk * 16) if texture else None
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
        if self._wait_s > 0:
            time.sleep(self._wait_s)
        return [
            build_chunk_envelope(self._frames(state["seed"], tick.chunk_index), ChunkMetadata.from_tick(tick))
            for state, tick in batch
        ]

    def _frames(self, seed: int, chunk: int) -> np.ndarray:
        spec = self._spec
        if self._panorama is None:
            shape = (spec.frames_per_chunk, spec.height, spec.width, 3)
            return np.full(shape, (seed + chunk) % 256, np.uint8)
        steps = self._panorama.shape[1] - spec.width
        starts = [((seed * 7 + chunk * spec.frames_per_chunk + f) * _PAN) % steps for f in range(spec.frames_per_chunk)]
        return np.stack([self._panorama[:, start : start + spec.width] for start in starts])

    def release(self, state: Any) -> None:
        pass
