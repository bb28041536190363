"""vllm-omni's interactions (``session.interaction``) on worldserve's control plane, chunk by chunk.

Owns, for one ``/v1/realtime/video`` session: checking an interaction as vllm-omni's server
does (:func:`parse_interaction`: the shape; :meth:`InteractionPlan.check`: what its
handlers would refuse, which becomes ``interaction_failed``), and :class:`InteractionPlan`,
which applies vllm-omni's prompt and camera handlers' rules at each chunk boundary (its
``PromptInteractionHandler`` and ``SE3DeltaCameraHandler``, at chunk rather than frame
granularity) and turns them into what this session's next tick applies -- a prompt and
the model's own control tracks -- and into each chunk's ``started_event_ids``,
``active_event_ids`` and ``completed_event_ids``.

The camera, for a model with the built-in ``camera`` track (``worldserve.camera.v1``, a pan
velocity ``{dx, dy}`` in px per frame over a top-down view): Unity axes, +X right, +Y up,
+Z forward; +X pans the view right (``dx``), +Z moves it forward, which is up the screen
(``dy = -z``), and :data:`PX_PER_UNIT` pixels make one unit, so vllm-omni's example WASD
step (0.05 a frame) moves the view as a held key does (2 px a frame). ``velocity`` holds
that per-frame delta until a newer camera event replaces it; ``target`` moves the view to
a position relative to the session's start pose over ``transition_chunks`` chunks (default
1), at a constant speed, then stops. The view cannot climb (+Y) nor turn (any rotation
but identity), nor move faster than the track allows (its schema's bound, 4 px a frame),
nor jump (a target in 0 chunks): such an interaction is refused (``interaction_failed``).

Prompt transitions: vllm-omni blends a prompt change over N chunks (``transition_chunks``,
default 3), the k-th chunk ``k / N`` of the way, so the N-th has the new prompt alone and
completes it. A model that declares the ``prompt_transition`` track
(``worldserve.prompt_transition.v1``) blends ``{"chunks": M}`` ``k / (M + 1)`` of the way at
the k-th chunk and has the new prompt alone at chunk M + 1, so it is sent ``M = N - 1``
(0 for N = 0): the same weights, chunk for chunk, and the new prompt alone in the chunk the
lists say completed it; a transition the track refuses (longer than the model's maximum) is
refused when it is queued. For a model without the track every prompt change is immediate,
a transition of 0 chunks, which vllm-omni's lists show as started, active and completed in
one chunk.

Must not know: sockets, messages' wire form, sessions, how models compute frames.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from worldserve.models.base import ModelSpec, SpecControlValidator
from worldserve.protocol import (
    PROMPT_TRANSITION_SCHEMA_NAME,
    PROMPT_TRANSITION_TRACK,
    ControlInput,
    transition_chunks_control,
)

__all__ = [
    "CAMERA_SCHEMA",
    "DEFAULT_CAMERA_TRANSITION_CHUNKS",
    "DEFAULT_PROMPT_TRANSITION_CHUNKS",
    "PX_PER_UNIT",
    "TRANSITION_SCHEMA",
    "Boundary",
    "Camera",
    "Interaction",
    "InteractionPlan",
    "InteractionRefused",
    "parse_interaction",
]

#: Pixels of the built-in models' top-down view per Unity unit.
PX_PER_UNIT = 40.0
#: vllm-omni's defaults when ``transition_chunks`` is absent: prompts (prompt.py) and camera targets (camera.py).
DEFAULT_PROMPT_TRANSITION_CHUNKS = 3
DEFAULT_CAMERA_TRANSITION_CHUNKS = 1
CAMERA_TRACK, CAMERA_SCHEMA = "camera", "worldserve.camera.v1"
TRANSITION_TRACK, TRANSITION_SCHEMA = PROMPT_TRANSITION_TRACK, PROMPT_TRANSITION_SCHEMA_NAME
_EPSILON = 1e-9


class InteractionRefused(ValueError):
    """An interaction the session's model cannot take (the wire's ``interaction_failed``)."""


@dataclass(frozen=True, slots=True)
class Camera:
    """A camera command in the view's pixels: ``velocity`` (px per frame) or ``target`` (px from the start)."""

    mode: str
    x: float
    y: float


@dataclass(frozen=True, slots=True)
class Interaction:
    """One checked ``session.interaction``."""

    event_id: str
    prompt: str | None = None
    camera: Camera | None = None
    transition_chunks: int | None = None
    #: Modalities besides prompt and camera (refused by :meth:`InteractionPlan.check`).
    other: tuple[str, ...] = ()
    #: The camera payload, if any, as sent (checked by :meth:`InteractionPlan.check`).
    camera_payload: Mapping[str, Any] | None = None


def parse_interaction(message: Mapping[str, Any], new_id: str) -> Interaction:
    """``session.interaction``'s shape, as vllm-omni's server checks it (``ValueError``: its message).

    ``new_id`` is the event id used when the interaction names none.
    """
    interaction = message.get("interaction")
    if not isinstance(interaction, dict):
        raise ValueError("session.interaction requires an interaction object")
    event_id = interaction.get("event_id")
    if event_id is None:
        event_id = new_id
    elif not isinstance(event_id, str) or not event_id:
        raise ValueError("session.interaction event_id must be a non-empty string")
    event = interaction.get("event")
    if not isinstance(event, dict):
        raise ValueError("session.interaction requires event object")
    prompt = event.get("prompt")
    modalities = event.get("multi_modal_data")
    has_prompt = isinstance(prompt, str) and bool(prompt.strip())
    has_modalities = isinstance(modalities, dict) and bool(modalities)
    if not has_prompt and not has_modalities:
        raise ValueError(
            "session.interaction requires a non-empty event.prompt and/or non-empty event.multi_modal_data"
        )
    if prompt is not None and not has_prompt:
        raise ValueError("session.interaction event.prompt must be a non-empty string when provided")
    if modalities is not None and not has_modalities:
        raise ValueError("session.interaction event.multi_modal_data must be a non-empty object when provided")
    camera_payload = None
    other = []
    if has_modalities:
        assert isinstance(modalities, dict)
        for modality, payload in modalities.items():
            if not isinstance(payload, dict):
                raise ValueError(f"session.interaction multi_modal_data[{modality!r}] must be an object")
            if modality == CAMERA_TRACK:
                camera_payload = payload
            else:
                other.append(str(modality))
    if event.get("negative_prompt") is not None:
        raise ValueError("session.interaction negative_prompt is not supported in this release")
    transition = interaction.get("transition_chunks")
    if transition is not None:
        if (
            isinstance(transition, bool)
            or not isinstance(transition, int | float)
            or (isinstance(transition, float) and not transition.is_integer())
        ):
            raise ValueError("session.interaction transition_chunks must be an integer")
        transition = int(transition)
        if transition < 0:
            raise ValueError("session.interaction transition_chunks must be >= 0")
    return Interaction(
        event_id=event_id,
        prompt=prompt if has_prompt else None,
        transition_chunks=transition,
        other=tuple(other),
        camera_payload=camera_payload,
    )


def _vector(value: Any, length: int, name: str) -> tuple[float, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or len(value) != length:
        raise InteractionRefused(f"camera {name} must be a list of {length} numbers")
    numbers = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item):
            raise InteractionRefused(f"camera {name} must hold finite numbers")
        numbers.append(float(item))
    return tuple(numbers)


def _camera(payload: Mapping[str, Any], transition: int | None) -> Camera:
    """vllm-omni's SE3 camera payload, mapped onto the top-down view (or refused)."""
    mode = payload.get("mode", "target")
    if mode not in ("target", "velocity"):
        raise InteractionRefused("camera mode must be 'target' or 'velocity'")
    data = payload.get("data")
    if not isinstance(data, Mapping):
        raise InteractionRefused("camera data must be an object")
    if "actions" in data:
        raise InteractionRefused("camera data.actions (WASD keys) is not accepted; send translation/rotation")
    tx, ty, tz = _vector(data.get("translation", (0.0, 0.0, 0.0)), 3, "translation")
    qx, qy, qz, qw = _vector(data.get("rotation", (0.0, 0.0, 0.0, 1.0)), 4, "rotation (x, y, z, w)")
    norm = math.sqrt(qx * qx + qy * qy + qz * qz + qw * qw)
    if norm <= 0.0:
        raise InteractionRefused("camera rotation quaternion must be non-zero")
    if max(abs(qx), abs(qy), abs(qz)) / norm > 1e-6:
        raise InteractionRefused("this model's view is top-down with a fixed heading: it cannot rotate")
    if abs(ty) > _EPSILON:
        raise InteractionRefused("this model's view is top-down at a fixed height: it cannot move along +Y")
    if mode == "target" and transition == 0:
        raise InteractionRefused("this model's view moves frame by frame: a target needs transition_chunks >= 1")
    return Camera(mode, tx * PX_PER_UNIT, -tz * PX_PER_UNIT)


@dataclass(frozen=True, slots=True)
class Boundary:
    """What the chunk about to be made applies, and the event lists its metadata reports."""

    prompt: str | None
    controls: tuple[ControlInput, ...]
    started: tuple[str, ...]
    active: tuple[str, ...]
    completed: tuple[str, ...]
    #: Interactions refused only here (a camera target out of the view's reach), with why.
    refused: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class _PromptChange:
    event_id: str
    chunks: int  # the transition's length (0: at once)
    elapsed: int = 0


@dataclass(slots=True)
class _CameraMove:
    event_id: str
    mode: str
    vx: float
    vy: float
    frames_left: int = 0  # target: frames until it is reached


@dataclass(slots=True)
class InteractionPlan:
    """One session's queued interactions and its prompt and camera state (see the module docstring)."""

    spec: ModelSpec
    _pending: list[Interaction] = field(default_factory=list)
    _prompt: _PromptChange | None = None
    _camera: _CameraMove | None = None
    _x: float = 0.0  # the view's position, px from the start (as the model's Motion integrates it)
    _y: float = 0.0
    _sent_velocity: tuple[float, float] = (0.0, 0.0)
    _validator: SpecControlValidator | None = None

    def __post_init__(self) -> None:
        self._validator = SpecControlValidator(self.spec)

    @property
    def camera(self) -> bool:
        """The model takes camera interactions (it has the built-in camera track)."""
        control = self.spec.control(CAMERA_TRACK)
        return control is not None and control.schema == CAMERA_SCHEMA

    @property
    def transitions(self) -> bool:
        """The model blends prompt changes over chunks (it declares the prompt_transition track)."""
        control = self.spec.control(TRANSITION_TRACK)
        return control is not None and control.schema == TRANSITION_SCHEMA

    @property
    def pending(self) -> int:
        return len(self._pending)

    def check(self, interaction: Interaction) -> Interaction:
        """What vllm-omni's handlers would refuse (:class:`InteractionRefused`); the interaction, camera mapped."""
        if interaction.other:
            raise InteractionRefused(
                f"interaction modality {interaction.other[0]!r} is not supported by model {self.spec.name!r}"
            )
        if interaction.prompt is not None and self.transitions:
            self._validate((_transition_control(_prompt_chunks(interaction.transition_chunks)),))
        camera = None
        if interaction.camera_payload is not None:
            if not self.camera:
                raise InteractionRefused(f"interaction modality 'camera' is not supported by model {self.spec.name!r}")
            camera = _camera(interaction.camera_payload, interaction.transition_chunks)
            if camera.mode == "velocity":
                self._validate((_camera_control(camera.x, camera.y),))
        return Interaction(interaction.event_id, interaction.prompt, camera, interaction.transition_chunks, (), None)

    def queue(self, interaction: Interaction) -> None:
        """Queue a checked interaction; the next :meth:`boundary` applies it."""
        self._pending.append(interaction)

    def forget(self, event_id: str) -> None:
        """Drop a queued interaction (its submission failed)."""
        self._pending = [item for item in self._pending if item.event_id != event_id]

    def boundary(self) -> Boundary:
        """Start the next chunk: the queued interactions take effect, in order, at its first frame."""
        pending, self._pending = self._pending, []
        started: list[str] = []
        active: list[str] = []
        completed: list[str] = []
        refused: list[tuple[str, str]] = []
        controls: list[ControlInput] = []
        prompt = self._prompt_boundary(pending, started, active, completed, controls)
        camera_started: list[str] = []
        camera_completed: list[str] = []
        for item in pending:
            if item.camera is None:
                continue
            move = self._activate(item, refused)
            if move is None:
                continue
            camera_started.append(item.event_id)
            if self._camera is not None and self._camera.event_id != item.event_id:
                camera_completed.append(self._camera.event_id)  # replaced: vllm-omni lists it completed
            self._camera = move
        velocity = (self._camera.vx, self._camera.vy) if self._camera is not None else (0.0, 0.0)
        if velocity != self._sent_velocity:
            controls.append(_camera_control(*velocity))
            self._sent_velocity = velocity
        frames = self.spec.frames_per_chunk
        for _ in range(frames):  # as the model's Motion moves, frame by frame
            self._x += velocity[0]
            self._y += velocity[1]
        camera = self._camera
        if camera is not None and camera.mode == "target":
            camera.frames_left -= frames
            if camera.frames_left <= 0:
                camera_completed.append(camera.event_id)
                self._camera = None
        camera_active = [self._camera.event_id] if self._camera is not None else []
        return Boundary(
            prompt,
            tuple(controls),
            _merged(started, camera_started),
            _merged(active, camera_active),
            _merged(completed, camera_completed),
            tuple(refused),
        )

    def _prompt_boundary(
        self,
        pending: list[Interaction],
        started: list[str],
        active: list[str],
        completed: list[str],
        controls: list[ControlInput],
    ) -> str | None:
        """vllm-omni's prompt handler: an unfinished transition advances; the last queued prompt starts."""
        change = self._prompt
        if change is not None and change.elapsed < change.chunks:
            change.elapsed += 1
            active.append(change.event_id)
            if change.elapsed >= change.chunks:
                completed.append(change.event_id)
        latest = next((item for item in reversed(pending) if item.prompt is not None), None)  # last write wins
        if latest is None:
            return None
        chunks = _prompt_chunks(latest.transition_chunks) if self.transitions else 0  # 0: it switches at once
        self._prompt = _PromptChange(latest.event_id, chunks)
        started.append(latest.event_id)
        active.append(latest.event_id)
        if chunks <= 0:
            completed.append(latest.event_id)
        else:
            self._prompt.elapsed = 1
            if chunks <= 1:
                completed.append(latest.event_id)
        if self.transitions:
            controls.append(_transition_control(chunks))
        return latest.prompt

    def _activate(self, item: Interaction, refused: list[tuple[str, str]]) -> _CameraMove | None:
        camera = item.camera
        assert camera is not None
        if camera.mode == "velocity":
            return _CameraMove(item.event_id, "velocity", camera.x, camera.y)
        chunks = item.transition_chunks or DEFAULT_CAMERA_TRANSITION_CHUNKS
        frames = chunks * self.spec.frames_per_chunk
        vx, vy = (camera.x - self._x) / frames, (camera.y - self._y) / frames
        try:
            self._validate((_camera_control(vx, vy),))
        except InteractionRefused as error:
            refused.append((item.event_id, f"the target is out of reach in {chunks} chunk(s): {error}"))
            return None
        return _CameraMove(item.event_id, "target", vx, vy, frames)

    def _validate(self, controls: tuple[ControlInput, ...]) -> None:
        assert self._validator is not None
        try:
            self._validator.validate_controls(controls)
        except ValueError as error:
            raise InteractionRefused(str(error)) from None


def _prompt_chunks(transition_chunks: int | None) -> int:
    return DEFAULT_PROMPT_TRANSITION_CHUNKS if transition_chunks is None else transition_chunks


def _transition_control(chunks: int) -> ControlInput:
    """vllm-omni's ``chunks``-chunk transition as the track's control (see the module docstring)."""
    return transition_chunks_control(chunks)


def _camera_control(dx: float, dy: float) -> ControlInput:
    return ControlInput(CAMERA_TRACK, CAMERA_SCHEMA, {"dx": dx + 0.0, "dy": dy + 0.0})


def _merged(*lists: list[str]) -> tuple[str, ...]:
    """vllm-omni's merge of per-handler lists: in order, each id once."""
    seen: dict[str, None] = {}
    for ids in lists:
        for event_id in ids:
            seen.setdefault(event_id, None)
    return tuple(seen)
