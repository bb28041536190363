"""Models and ground truth for the runtime's tests (importable by spawned workers: tests/ is on sys.path).

``FaultyModel`` is the procedural world with faults on demand, keyed by a word in a
tick's prompt (or, before any event set one, the session's start prompt):
``poison`` makes ``step`` raise for any batch holding that session, ``slow`` makes it
sleep ``slow_s`` first, ``garbage`` makes it return a wrong-shaped payload.
``atomic=False`` makes a raising step advance the states it got to first, like a model
that cannot promise an untouched batch; ``rollback=False`` declares that it cannot roll a
session back (so a chunk it is making cannot be cancelled).

``gate`` (a path) holds steps for as long as a test wants, whatever the machine's speed: a
step whose batch holds a session marked ``gate`` writes ``<gate>.entered`` (the batch's
session ids), waits until ``<gate>.open`` exists, then writes ``<gate>.left``. :class:`Gate`
is the test's side. Files, so that it works in spawned worker processes too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from worldserve import ChunkMetadata, ControlInput, TickRequest, build_chunk_envelope
from worldserve.models.base import ModelSpec
from worldserve.models.procedural import ProceduralModel, ProceduralState
from worldserve.models.world import Motion, World, style_for_prompt, velocity
from worldserve.protocol import held_keys

KEYS = "worldserve.keys.v1"
CAMERA = "worldserve.camera.v1"


def keys(*held: str) -> ControlInput:
    return ControlInput("keys", KEYS, {"held": list(held)})


class FaultyModel(ProceduralModel):
    def __init__(
        self,
        *,
        atomic: bool = True,
        slow_s: float = 0.5,
        gate: str | None = None,
        rollback: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self._faulty_spec = dataclasses.replace(super().spec, name="faulty", atomic_step=atomic, can_rollback=rollback)
        self._slow_s = slow_s
        self._gate = None if gate is None else Gate(gate)
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
        if self._gate is not None and any(self._marked(state, tick, "gate") for state, tick in batch):
            self._gate.hold(tick.session_id for _, tick in batch)
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


class Gate:
    """Holds a :class:`FaultyModel` step (see the module docstring) until the test opens it."""

    #: A step never waits longer than this: a test that forgets to open fails instead of hanging.
    LIMIT_S = 60.0

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _file(self, suffix: str) -> Path:
        return self.path.with_name(self.path.name + suffix)

    @property
    def entered(self) -> bool:
        return self._file(".entered").exists()

    @property
    def left(self) -> bool:
        return self._file(".left").exists()

    def batch(self) -> list[str]:
        """The session ids of the step that entered last."""
        return self._file(".entered").read_text().split()

    def open(self) -> None:
        self._file(".open").touch()

    def hold(self, session_ids: Iterable[str]) -> None:
        """In the model's step: say so, wait until the test opens the gate, say it left."""
        ids = list(session_ids)
        self._say(".entered", ids)
        deadline = time.monotonic() + self.LIMIT_S
        while not self._file(".open").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test never opened the gate {self.path}")
            time.sleep(0.002)
        self._say(".left", ids)

    def _say(self, suffix: str, session_ids: list[str]) -> None:
        """Write the file whole, then give it its name: a test that sees it exist reads every id (write_text
        makes the file first and fills it after, and a reader in between read none)."""
        written = self._file(suffix + ".part")
        written.write_text(" ".join(session_ids))
        written.replace(self._file(suffix))

    async def wait_entered(self) -> None:
        """Wait (on the event loop) until a gated step is inside the model."""
        await until(lambda: self.entered, f"a step entered the gate {self.path}")


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` on the event loop until it holds; fail after a generous ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():  # noqa: ASYNC110 -- polls files and counters, nothing to await
                await asyncio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"waited {timeout} s for: {what}") from None


def chunk_controls(
    state: dict[str, ControlInput],
    applied: Sequence[int],
    events: Mapping[int, Sequence[ControlInput]],
    carried: Mapping[int, Sequence[int]] = MappingProxyType({}),
) -> list[ControlInput]:
    """The controls a chunk's tick holds, by the session's rules; ``state`` (the controls after the chunk before)
    becomes the controls after this one. Its ``applied`` events' controls replace their tracks' (the last wins),
    and on a held-keys control the tick also holds every key pressed since the chunk before: by its events and
    by those they superseded (``carried``: a superseding event's id -> the ids it superseded, as ``input.dropped``
    told them), each press counted against the keys before it, in id order."""
    steps: set[int] = set()
    todo = list(applied)
    while todo:  # a superseded event may have superseded others before it
        event_id = todo.pop()
        if event_id not in steps:
            steps.add(event_id)
            todo.extend(carried.get(event_id, ()))
    before = {track: keys for track, control in state.items() if (keys := held_keys(control)) is not None}
    pressed: dict[str, set[str]] = {}
    for event_id in sorted(steps):
        for control in events[event_id]:
            now = held_keys(control)
            if now is not None:
                pressed.setdefault(control.track, set()).update(now - before.get(control.track, frozenset()))
                before[control.track] = now
    for event_id in applied:
        state.update({control.track: control for control in events[event_id]})
    shown = dict(state)
    for track, keys in pressed.items():
        final = state[track]
        extra = keys - (held_keys(final) or frozenset())
        if extra:
            data = {**final.data, "held": [*final.data["held"], *sorted(extra)]}
            shown[track] = ControlInput(track, final.schema, data)
    return [shown[track] for track in sorted(shown)]


def carried_by(dropped: Iterable[tuple[Sequence[int], str]]) -> dict[int, list[int]]:
    """``chunk_controls``' ``carried`` from ``input.dropped`` notices (event ids, detail), superseded ones only."""
    carried: dict[int, list[int]] = {}
    for event_ids, detail in dropped:
        if detail.startswith("superseded by event "):
            carried.setdefault(int(detail.removeprefix("superseded by event ")), []).extend(event_ids)
    return carried


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


class RandomWeightsModel(ProceduralModel):
    """The procedural world under a spec that says its weights are random (as ``wan-causal load=dummy``
    does): what the player must show on screen."""

    @property
    def spec(self) -> ModelSpec:
        return dataclasses.replace(
            super().spec, description="RANDOM WEIGHTS (a test stand-in): frames are the procedural world."
        )


class PartsModel(FaultyModel):
    """:class:`FaultyModel` that declares ``frame_parts``: each row's frames go to the step's sink ``part``
    frames at a time (every row's first part, then every row's second, as a streaming decoder does),
    before the step returns them whole. ``cracked`` in a prompt makes the step raise once the first
    parts are out (the batch's states have moved: this model is not atomic then). ``pause_s``: a wait
    after each part but the last (a decoder that takes its time: a part is out while the step runs on)."""

    def __init__(self, *, part: int = 2, pause_s: float = 0.0, **options: Any) -> None:
        super().__init__(**options)
        self._faulty_spec = dataclasses.replace(self._faulty_spec, name="parts", frame_parts=True)
        self._part = part
        self._pause_s = pause_s

    def step(
        self, batch: Sequence[tuple[Any, TickRequest]], on_part: Callable[[int, np.ndarray], None] | None = None
    ) -> list[dict[str, Any]]:
        outputs = super().step(batch)
        frames = self.spec.frames_per_chunk
        for first in range(0, frames, self._part):
            for row, envelope in enumerate(outputs):
                if on_part is not None:
                    on_part(row, envelope["payload"][first : first + self._part])
            if any(self._marked(state, tick, "cracked") for state, tick in batch):
                raise RuntimeError("the decoder cracked after a part")
            if self._pause_s and first + self._part < frames:
                time.sleep(self._pause_s)
        return outputs
