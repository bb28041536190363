"""The ``procedural`` model: renders the shared world exactly, chunk by chunk.

Owns: :class:`ProceduralModel`, a :class:`~worldserve.models.base.WorldModel` whose
per-session state is a view position (and an optional start image pasted into the
world at the start view). Frames depend only on the world seed, the start options
and the applied snapshots, so tests can check which events reached which chunk.
Rolling a session back (to cancel a chunk) restores its view position.
Cheap: a 48x48 frame costs about 0.2 ms, which makes it the load-test model.

Must not know: sessions, engines, transports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from worldserve.models.base import ModelSpec, SessionOptions
from worldserve.models.world import (
    CONTINUOUS_TRACKS,
    CONTROL_SCHEMAS,
    DEFAULT_STYLE,
    STYLES,
    WORLD_VERSION,
    Motion,
    World,
    style_for_prompt,
    velocity,
)
from worldserve.protocol import ChunkMetadata, TickRequest, build_chunk_envelope

__all__ = ["ProceduralModel", "ProceduralState"]


class ProceduralState:
    """One session's view of its world."""

    __slots__ = ("image", "motion", "options", "session_id", "world")

    def __init__(self, session_id: str, options: SessionOptions, height: int, width: int) -> None:
        self.session_id = session_id
        self.options = options
        self.world = World(options.seed)
        self.motion = Motion()
        self.image: npt.NDArray[np.uint8] | None = None
        if options.image is not None:
            self.image = np.frombuffer(options.image, dtype=np.uint8).reshape(height, width, 3)


class ProceduralModel:
    """Exact renderer of :class:`~worldserve.models.world.World` behind the model interface."""

    def __init__(
        self,
        *,
        height: int = 48,
        width: int = 48,
        frames_per_chunk: int = 4,
        fps: float = 16.0,
        max_batch_size: int = 64,
    ) -> None:
        self._spec = ModelSpec(
            name="procedural",
            frames_per_chunk=frames_per_chunk,
            fps=fps,
            height=height,
            width=width,
            controls=CONTROL_SCHEMAS,
            max_batch_size=max_batch_size,
            state_bytes=height * width * 3 + 512,
            styles=STYLES,
            default_prompt=DEFAULT_STYLE,
            description="Exact procedural terrain renderer (ground truth for tinyworld; cheap load-test model).",
            atomic_step=True,
            version=WORLD_VERSION,
            precision="exact",
            continuous_tracks=CONTINUOUS_TRACKS,
            can_rollback=True,
        )

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def new_state(self, session_id: str, options: SessionOptions) -> ProceduralState:
        options.check_image(self._spec)
        return ProceduralState(session_id, options, self._spec.height, self._spec.width)

    def start_frame(self, state: ProceduralState) -> npt.NDArray[np.uint8]:
        """The frame a session starts from (the context of its first chunk)."""
        x, y = state.motion.pixel
        return self._view(state, x, y, style_for_prompt(state.options.prompt))

    def step(self, batch: Sequence[tuple[Any, TickRequest]]) -> list[dict[str, Any]]:
        # Atomic: every chunk is rendered from a copy of its motion, and the states move
        # only once the whole batch has succeeded (the spec declares ``atomic_step``).
        outputs = []
        moved = []
        for state, tick in batch:
            if not isinstance(state, ProceduralState):
                raise TypeError(f"procedural model got a foreign state: {type(state).__name__}")
            style = style_for_prompt(tick.prompt if tick.prompt is not None else state.options.prompt)
            vx, vy = velocity(tick.controls)
            motion = Motion(state.motion.x, state.motion.y)
            positions = motion.advance(vx, vy, self._spec.frames_per_chunk)
            frames = np.stack([self._view(state, x, y, style) for x, y in positions])
            outputs.append(build_chunk_envelope(frames, ChunkMetadata.from_tick(tick)))
            moved.append((state, motion))
        for state, motion in moved:
            state.motion = motion
        return outputs

    def snapshot(self, state: Any) -> Motion:
        """The view position before a step (a step replaces ``state.motion``, never mutates it)."""
        if not isinstance(state, ProceduralState):
            raise TypeError(f"procedural model got a foreign state: {type(state).__name__}")
        return state.motion

    def restore(self, state: Any, snapshot: Any) -> ProceduralState:
        if not isinstance(state, ProceduralState) or not isinstance(snapshot, Motion):
            raise TypeError("procedural model got a foreign state or snapshot.")
        state.motion = snapshot
        return state

    def release(self, state: Any) -> None:
        if isinstance(state, ProceduralState):
            state.image = None

    def _view(self, state: ProceduralState, x: int, y: int, style: str) -> npt.NDArray[np.uint8]:
        height, width = self._spec.height, self._spec.width
        frame = state.world.render(x, y, height, width, style)
        if state.image is not None:
            # The start image lies in the world at the start view, [0, width) x [0, height).
            x0, x1 = max(x, 0), min(x + width, width)
            y0, y1 = max(y, 0), min(y + height, height)
            if x0 < x1 and y0 < y1:
                frame[y0 - y : y1 - y, x0 - x : x1 - x] = state.image[y0:y1, x0:x1]
        return frame
