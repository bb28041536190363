"""Models and ground truth for the runtime's tests (importable by spawned workers: tests/ is on sys.path).

``FaultyModel`` is the procedural world with faults on demand, keyed by a word in a
tick's prompt (or, before any event set one, the session's start prompt):
``poison`` makes ``step`` raise for any batch holding that session, ``slow`` makes it
sleep ``slow_s`` first, ``garbage`` makes it return a wrong-shaped payload.
``atomic=False`` makes a raising step advance the states it got to first, like a model
that cannot promise an untouched batch; ``rollback=False`` declares that it cannot roll a
session back (so a chunk it is making cannot be cancelled).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from worldserve import ChunkMetadata, ControlInput, TickRequest, build_chunk_envelope
from worldserve.models.base import ModelSpec
from worldserve.models.procedural import ProceduralModel, ProceduralState
from worldserve.models.world import Motion, World, style_for_prompt, velocity

KEYS = "worldserve.keys.v1"
CAMERA = "worldserve.camera.v1"


def keys(*held: str) -> ControlInput:
    return ControlInput("keys", KEYS, {"held": list(held)})


class FaultyModel(ProceduralModel):
    def __init__(self, *, atomic: bool = True, slow_s: float = 0.5, rollback: bool = True, **options: Any) -> None:
        super().__init__(**options)
        self._faulty_spec = dataclasses.replace(super().spec, name="faulty", atomic_step=atomic, can_rollback=rollback)
        self._slow_s = slow_s
        self.steps = 0

    @property
    def spec(self) -> ModelSpec:
        return self._faulty_spec

    @staticmethod
    def _marked(state: ProceduralState, tick: TickRequest, word: str) -> bool:
        prompt = tick.prompt if tick.prompt is not None else state.options.prompt
        return word in (prompt or "")

    def step(self, batch: Sequence[tuple[Any, TickRequest]]) -> list[dict[str, Any]]:
        self.steps += 1
        if any(self._marked(state, tick, "slow") for state, tick in batch):
            time.sleep(self._slow_s)
        outputs: list[dict[str, Any]] = []
        for state, tick in batch:
            if self._marked(state, tick, "poison"):
                raise RuntimeError(f"poisoned session {tick.session_id}")
            if not self.spec.atomic_step:
                outputs.extend(super().step([(state, tick)]))  # moves this state before a later item raises
        if self.spec.atomic_step:
            outputs = super().step(batch)
        for index, (state, tick) in enumerate(batch):
            if self._marked(state, tick, "garbage"):
                outputs[index] = build_chunk_envelope(np.zeros((1, 2, 3), np.uint8), ChunkMetadata.from_tick(tick))
        return outputs


class Truth:
    """The exact frames a procedural session must produce, chunk after chunk."""

    def __init__(self, seed: int, start_prompt: str | None = None, size: int = 48, frames: int = 4) -> None:
        self.world = World(seed)
        self.start_prompt = start_prompt
        self.size = size
        self.frames = frames
        self.motion = Motion()

    def next(self, prompt: str | None, controls: Sequence[ControlInput]) -> np.ndarray:
        style = style_for_prompt(prompt if prompt is not None else self.start_prompt)
        positions = self.motion.advance(*velocity(controls), self.frames)
        return np.stack([self.world.render(x, y, self.size, self.size, style) for x, y in positions])


class ThreadsModel(ProceduralModel):
    """The procedural world; its spec's description tells the thread limit its worker process got."""

    @property
    def spec(self) -> ModelSpec:
        threads = os.environ.get("OMP_NUM_THREADS")
        return dataclasses.replace(super().spec, name="threads", description=f"OMP_NUM_THREADS={threads}")


class SlowStartModel(ProceduralModel):
    """The procedural world, whose construction (a worker's start) takes ``load_s`` seconds."""

    def __init__(self, *, load_s: float = 0.0, **options: Any) -> None:
        time.sleep(load_s)
        super().__init__(**options)
