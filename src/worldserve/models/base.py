"""The model interface: what a world-model adapter gives the runtime.

Owns: :class:`WorldModel` (the protocol an adapter implements), :class:`RollbackModel`
(the optional snapshot/restore an adapter adds so a chunk in flight can be cancelled), :class:`ModelSpec`
and :class:`ControlSchema` (what a model declares: size, rate, controls, batch limit,
bytes of state per session), :class:`SessionOptions` (how a session's world starts)
and :class:`SpecControlValidator`, which refuses a control the model cannot take
when its event is *accepted*, from the spec alone (no model weights needed).

Must not know: sessions, engines, transports. Controls are the model's to interpret:
the control plane only ever sees them as opaque ``ControlInput`` values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jsonschema
import numpy as np
import numpy.typing as npt

from worldserve.media import FrameEncoding
from worldserve.protocol import ControlInput, FrozenMap, TickRequest, freeze_transport_value, thaw_transport_value

__all__ = [
    "ControlSchema",
    "ModelSpec",
    "PartSink",
    "RollbackModel",
    "SessionOptions",
    "SpecControlValidator",
    "WorldModel",
]


#: Where a model with ``spec.frame_parts`` hands a row's frames on while its step runs:
#: ``sink(row, frames)``, ``row`` the pair's index in the batch, ``frames`` ``uint8 [n, H, W, 3]``.
PartSink = Callable[[int, npt.NDArray[np.uint8]], None]


@dataclass(frozen=True, slots=True)
class ControlSchema:
    """One control track a model accepts: its ``schema`` name and a JSON Schema of its data."""

    track: str
    schema: str
    description: str
    json_schema: Mapping[str, Any]
    example: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "json_schema", freeze_transport_value(self.json_schema, path="json_schema"))
        object.__setattr__(self, "example", freeze_transport_value(self.example, path="example"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "track": self.track,
            "schema": self.schema,
            "description": self.description,
            "json_schema": thaw_transport_value(self.json_schema),
            "example": thaw_transport_value(self.example),
        }


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a model declares about itself; shown to clients and used by the runtime."""

    name: str
    frames_per_chunk: int
    fps: float
    height: int
    width: int
    controls: tuple[ControlSchema, ...]
    max_batch_size: int
    state_bytes: int
    styles: tuple[str, ...] = ()
    default_prompt: str | None = None
    description: str = ""
    #: True when a ``step`` that raises leaves every state of its batch unchanged, so the
    #: runtime may retry the batch's other sessions alone to isolate the failing one.
    atomic_step: bool = False
    #: What exactly computes the frames (weights hash, generator version): replays compare it.
    version: str = ""
    #: The arithmetic the model runs in ("float32", "bfloat16", ...); frames are exactly
    #: reproducible only at the same precision on the same machine.
    precision: str = ""
    #: Tracks whose control is *state* (held keys, a camera velocity), not a command: only
    #: the latest value matters, so a newer event on them may supersede queued ones.
    continuous_tracks: tuple[str, ...] = ()
    #: True when the model implements :class:`RollbackModel`, so the runtime can put a
    #: session back at its last commit and cancel the chunk it is making.
    can_rollback: bool = False
    #: True when a world starts only from a start image (an image-to-world model): a session
    #: without one (``SessionOptions.image``) is refused when it is created.
    requires_image: bool = False
    #: False for a model that has no use for a prompt (no text encoder: Matrix-Game 2.0): it
    #: ignores every prompt, so a player shows no prompt field for it.
    takes_prompt: bool = True
    #: What the model chose at load that its user should hear of (a precision this machine
    #: cannot serve fast, served in float32 instead): the server says each at start-up.
    notes: tuple[str, ...] = ()
    #: Reference images a world may start with besides its start image, by name, in the order the
    #: model takes them (ABot-World: views of the scene, ``head left right front back``); a session
    #: gives all of them or none (``SessionOptions.references``). Empty: the model takes none.
    reference_slots: tuple[str, ...] = ()
    #: The side of each (square) reference image, in pixels; 0 when the model takes none.
    reference_size: int = 0
    #: True when ``step(batch, on_part=sink)`` hands each row's frames on as its decoder makes them
    #: (a :data:`PartSink`), before the step returns: a row's parts, in order, are its chunk's frames.
    frame_parts: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(str(note) for note in self.notes))
        object.__setattr__(self, "reference_slots", tuple(self.reference_slots))
        slots = self.reference_slots
        if not all(isinstance(name, str) and name for name in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"ModelSpec.reference_slots must be distinct non-empty names; got {slots!r}.")
        size = self.reference_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or (size > 0) != bool(slots):
            raise ValueError(
                f"ModelSpec.reference_size must be a positive integer with reference_slots, else 0; got {size!r}."
            )
        for name in ("frames_per_chunk", "height", "width", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive integer; got {value!r}.")
        if isinstance(self.state_bytes, bool) or not isinstance(self.state_bytes, int) or self.state_bytes < 0:
            raise ValueError(f"ModelSpec.state_bytes must be a non-negative integer; got {self.state_bytes!r}.")
        for flag in ("atomic_step", "can_rollback", "requires_image", "takes_prompt", "frame_parts"):
            if type(getattr(self, flag)) is not bool:
                raise ValueError(f"ModelSpec.{flag} must be a bool; got {getattr(self, flag)!r}.")
        if not self.fps > 0:
            raise ValueError(f"ModelSpec.fps must be positive; got {self.fps!r}.")
        tracks = [control.track for control in self.controls]
        if len(tracks) != len(set(tracks)):
            raise ValueError("ModelSpec.controls must declare each track once.")
        object.__setattr__(self, "continuous_tracks", tuple(self.continuous_tracks))
        unknown = [track for track in self.continuous_tracks if track not in tracks]
        if unknown or len(set(self.continuous_tracks)) != len(self.continuous_tracks):
            raise ValueError(
                f"ModelSpec.continuous_tracks must name declared tracks once each; got {self.continuous_tracks!r}."
            )

    @property
    def chunk_seconds(self) -> float:
        """Playback time of one chunk."""
        return self.frames_per_chunk / self.fps

    def control(self, track: str) -> ControlSchema | None:
        for control in self.controls:
            if control.track == track:
                return control
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "frames_per_chunk": self.frames_per_chunk,
            "fps": self.fps,
            "height": self.height,
            "width": self.width,
            "controls": [control.to_dict() for control in self.controls],
            "max_batch_size": self.max_batch_size,
            "state_bytes": self.state_bytes,
            "styles": list(self.styles),
            "default_prompt": self.default_prompt,
            "description": self.description,
            "version": self.version,
            "precision": self.precision,
            "continuous_tracks": list(self.continuous_tracks),
            "can_rollback": self.can_rollback,
            "requires_image": self.requires_image,
            "takes_prompt": self.takes_prompt,
            "reference_slots": list(self.reference_slots),
            "reference_size": self.reference_size,
            "frame_parts": self.frame_parts,
            "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True)
class SessionOptions:
    """How a session's world starts; kept by the runtime and reused on every reset.

    ``prompt`` is the start prompt, used while no event has set one. ``seed`` picks the
    world. ``image`` is an optional start image: raw RGB bytes of ``height * width * 3``.
    ``references``: the model's reference images (``ModelSpec.reference_slots``), raw RGB bytes of
    ``reference_size`` squared each, in the spec's order; all of them or none (empty).
    ``encoding`` is for the runner, not the model (models ignore it): when set, the
    runner encodes the session's frames (JPEG or raw bytes) right after ``model.step`` and
    hands back only those payloads (so only compressed bytes cross machines); ``None``
    hands back the ``uint8`` arrays. ``extra_encodings``: other media the session's frames are
    wanted in as well (members of one world that asked for another media than its host's),
    each encoded once per chunk and handed back as the payloads' ``alternates``; only with an
    ``encoding``, one per media, none of them the ``encoding``'s media.
    """

    prompt: str | None = None
    seed: int = 0
    image: bytes | None = field(default=None, repr=False)
    encoding: FrameEncoding | None = None
    extra_encodings: tuple[FrameEncoding, ...] = ()
    references: tuple[bytes, ...] = field(default=(), repr=False)

    @property
    def encodings(self) -> tuple[FrameEncoding, ...]:
        """Every encoding the runner makes of each chunk: ``encoding`` first, then ``extra_encodings``."""
        return () if self.encoding is None else (self.encoding, *self.extra_encodings)

    def __post_init__(self) -> None:
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError("SessionOptions.prompt must be a string or None.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"SessionOptions.seed must be an integer in [0, 2**32); got {self.seed!r}.")
        if self.image is not None and not isinstance(self.image, bytes):
            raise ValueError("SessionOptions.image must be raw RGB bytes or None.")
        if not isinstance(self.references, tuple) or not all(isinstance(item, bytes) for item in self.references):
            raise ValueError("SessionOptions.references must be a tuple of raw RGB bytes.")
        if self.encoding is not None and not isinstance(self.encoding, FrameEncoding):
            raise ValueError("SessionOptions.encoding must be a FrameEncoding or None.")
        extra = self.extra_encodings
        if not isinstance(extra, tuple) or not all(isinstance(item, FrameEncoding) for item in extra):
            raise ValueError("SessionOptions.extra_encodings must be a tuple of FrameEncoding.")
        if extra and self.encoding is None:
            raise ValueError("SessionOptions.extra_encodings need an encoding.")
        media = [item.media for item in self.encodings]
        if len(set(media)) != len(media):
            raise ValueError(f"SessionOptions: one encoding per media; got {media}.")

    def check_image(self, spec: ModelSpec) -> None:
        """Raise ``ValueError`` unless the start image (if any) fits ``spec``'s frame size, and there is one
        when ``spec.requires_image``; and unless the reference images are none, or one per slot of
        ``spec.reference_slots``, each ``reference_size`` square."""
        if self.references:
            slots, side = spec.reference_slots, spec.reference_size
            if not slots:
                raise ValueError(f"model {spec.name!r} takes no reference images.")
            if len(self.references) != len(slots):
                raise ValueError(
                    f"model {spec.name!r} takes {len(slots)} reference images ({', '.join(slots)}), all or none; "
                    f"got {len(self.references)}."
                )
            for name, blob in zip(slots, self.references, strict=True):
                if len(blob) != side * side * 3:
                    raise ValueError(
                        f"reference image {name!r} must be {side}x{side} RGB ({side * side * 3} bytes); "
                        f"got {len(blob)} bytes."
                    )
        if self.image is None and spec.requires_image:
            raise ValueError(
                f"model {spec.name!r} starts a world from a start image: send one ({spec.width}x{spec.height} RGB)."
            )
        expected = spec.height * spec.width * 3
        if self.image is not None and len(self.image) != expected:
            raise ValueError(
                f"start image must be {spec.width}x{spec.height} RGB ({expected} bytes); got {len(self.image)} bytes."
            )


@runtime_checkable
class WorldModel(Protocol):
    """A world model adapter the runtime drives, one AR block per tick.

    ``step`` receives one ``(state, tick)`` pair per session of a batch (at most
    ``spec.max_batch_size``) and returns one chunk envelope per pair, in order,
    whose metadata echoes the tick and whose payload is the chunk's frames. States
    are the model's own; the runner owns which session holds which state. A step that
    raises fails its batch; declare ``spec.atomic_step`` if it then leaves every state
    unchanged, so the runtime can retry the other sessions alone.

    A model that declares ``spec.frame_parts`` also takes ``step(batch, on_part=sink)``: it calls
    ``sink(row, frames)`` with each row's frames as they are made (per latent frame, for a model
    whose decoder streams that way), every frame of the chunk once and in order, before the step
    returns the whole chunks as usual. Frames handed on are out: a step that raises after a part
    fails its rows (the runtime does not retry them alone, their frames would be made twice).
    """

    @property
    def spec(self) -> ModelSpec: ...

    def new_state(self, session_id: str, options: SessionOptions) -> Any: ...

    def step(self, batch: Sequence[tuple[Any, TickRequest]]) -> list[dict[str, Any]]: ...

    def release(self, state: Any) -> None: ...


@runtime_checkable
class RollbackModel(Protocol):
    """What a model adds to let the runtime cancel a chunk in flight (``spec.can_rollback``).

    ``snapshot(state)`` is called before each step of the state and returns whatever
    the model needs to undo that step (keep it small: it is taken on every step);
    ``restore(state, snapshot)`` undoes the step and returns the state to keep (the
    same object or another). The snapshot is taken even if the step then raises; a
    restore is only asked for after a step that succeeded.
    """

    def snapshot(self, state: Any) -> Any: ...

    def restore(self, state: Any, snapshot: Any) -> Any: ...


class SpecControlValidator:
    """The :class:`~worldserve.session.ControlValidator` a :class:`ModelSpec` implies.

    A control is refused unless its track is declared, its schema name matches, and
    its data satisfies the declared JSON Schema; the error names all three.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self._by_track: dict[str, tuple[str, jsonschema.protocols.Validator]] = {}
        for control in spec.controls:
            schema = thaw_transport_value(control.json_schema)
            validator_class = jsonschema.validators.validator_for(schema)
            validator_class.check_schema(schema)
            self._by_track[control.track] = (control.schema, validator_class(schema))
        self._model = spec.name

    def validate_controls(self, controls: Sequence[ControlInput]) -> None:
        for control in controls:
            known = self._by_track.get(control.track)
            if known is None:
                raise ValueError(
                    f"model {self._model!r} has no control track {control.track!r}; "
                    f"known tracks: {sorted(self._by_track)}."
                )
            schema_name, validator = known
            if control.schema != schema_name:
                raise ValueError(
                    f"control track {control.track!r} expects schema {schema_name!r}; got {control.schema!r}."
                )
            data = thaw_transport_value(control.data) if isinstance(control.data, FrozenMap) else control.data
            error = jsonschema.exceptions.best_match(validator.iter_errors(data))
            if error is not None:
                where = "data" + "".join(f"[{part!r}]" for part in error.absolute_path)
                raise ValueError(f"control track {control.track!r} (schema {schema_name!r}): {where}: {error.message}.")
