"""Matrix-Game 2.0's controls: each variant's own action space, and a tick's controls -> its actions.

Owns: :func:`keys_schema` (the ``keys`` track, ``worldserve.keys.v1``: the held keys, restricted to
the variant's keys; Temple Run's one at a time, as its actions were one-hot in training),
:data:`MOUSE_SCHEMA` (the ``mouse`` track, ``worldserve.mouse.v1``: the camera's turn per video
frame, ``{"yaw", "pitch"}`` in the reference's units, for the variants with a mouse),
:func:`variant_controls` (a variant's tracks), :func:`keyboard_action` and :func:`mouse_action`
(a tick's controls -> one video frame's keyboard vector and (pitch, yaw), held for the whole
block as the reference's streaming demo holds an action for a block) and :func:`keys_control` /
:func:`mouse_control` (building them). Both tracks are state (what is held now), not commands.
Must not know: torch, sessions.

The keyboard vector is the reference's: universal W/S/A/D -> indexes 0-3 (forward, back, left,
right; several at once, as its training combined them); GTA W/S -> 0-1; Temple Run one of W
(jump, 1), S (slide, 2), Z (turn left, 3), C (turn right, 4), A (move left, 5), D (move right, 6),
none held -> ``nomove`` (0). The mouse is the reference's ``mouse_cond``: (pitch, yaw) per video
frame, up and right positive; its keyboard demo turns the camera by 0.1 per frame.
"""

from __future__ import annotations

from collections.abc import Sequence

from worldserve.models.base import ControlSchema
from worldserve.models.matrixgame.config import Variant
from worldserve.protocol import ControlInput

__all__ = [
    "KEYS_TRACK",
    "MOUSE_LIMIT",
    "MOUSE_SCHEMA",
    "MOUSE_TRACK",
    "keyboard_action",
    "keys_control",
    "keys_schema",
    "mouse_action",
    "mouse_control",
    "variant_controls",
]

KEYS_TRACK = "keys"
MOUSE_TRACK = "mouse"
#: The largest turn per video frame a control may ask for (the reference's demo keys turn 0.1).
MOUSE_LIMIT = 1.0


def keys_schema(variant: Variant) -> ControlSchema:
    """The ``keys`` track of ``variant``: the keys held now, from its own action space."""
    names = list(variant.key_names)
    meaning = {
        "universal": "W forward, S back, A left, D right (several at once)",
        "gta-drive": "W accelerate, S brake/reverse (steer with the mouse)",
        "templerun": "one at a time: W jump, S slide, Z turn left, C turn right, A move left, D move right; "
        "none held: run on",
    }[variant.name]
    return ControlSchema(
        track=KEYS_TRACK,
        schema="worldserve.keys.v1",
        description=(
            f"Keys held now (held-key state: it lasts until the next keys event), {variant.title}: {meaning}. "
            "Applied to every video frame of the chunk."
        ),
        json_schema={
            "type": "object",
            "properties": {
                "held": {
                    "type": "array",
                    "items": {"enum": names},
                    "uniqueItems": True,
                    "maxItems": 1 if variant.one_hot else len(names),
                }
            },
            "required": ["held"],
            "additionalProperties": False,
        },
        example={"held": names[:1]},
    )


MOUSE_SCHEMA = ControlSchema(
    track=MOUSE_TRACK,
    schema="worldserve.mouse.v1",
    description=(
        "Camera turn per video frame, held until the next mouse event (send {yaw: 0, pitch: 0} to stop): "
        "yaw positive turns right, pitch positive looks up, in the units Matrix-Game 2.0 was trained on "
        "(its keyboard demo turns 0.1 per frame)."
    ),
    json_schema={
        "type": "object",
        "properties": {
            "yaw": {"type": "number", "minimum": -MOUSE_LIMIT, "maximum": MOUSE_LIMIT},
            "pitch": {"type": "number", "minimum": -MOUSE_LIMIT, "maximum": MOUSE_LIMIT},
        },
        "required": ["yaw", "pitch"],
        "additionalProperties": False,
    },
    example={"yaw": 0.1, "pitch": 0.0},
)


def variant_controls(variant: Variant) -> tuple[ControlSchema, ...]:
    """The tracks ``variant`` was trained on: its keys, and the mouse when it has one."""
    return (keys_schema(variant), MOUSE_SCHEMA) if variant.mouse else (keys_schema(variant),)


def _track(controls: Sequence[ControlInput], track: str) -> ControlInput | None:
    for control in controls:
        if control.track == track:
            return control
    return None


def keyboard_action(controls: Sequence[ControlInput], variant: Variant) -> list[float]:
    """One video frame's keyboard vector (``keyboard_dim`` long) for the keys the tick holds."""
    vector = [0.0] * variant.keyboard_dim
    control = _track(controls, KEYS_TRACK)
    held = [str(key) for key in control.data["held"]] if control is not None else []
    index = dict(variant.keys)
    for key in held:
        vector[index[key]] = 1.0
    if not held and variant.idle_index is not None:
        vector[variant.idle_index] = 1.0
    return vector


def mouse_action(controls: Sequence[ControlInput]) -> list[float]:
    """One video frame's (pitch, yaw), the reference's ``mouse_cond`` order; none held: (0, 0)."""
    control = _track(controls, MOUSE_TRACK)
    if control is None:
        return [0.0, 0.0]
    return [float(control.data["pitch"]), float(control.data["yaw"])]


def keys_control(*held: str) -> ControlInput:
    return ControlInput(KEYS_TRACK, "worldserve.keys.v1", {"held": list(held)})


def mouse_control(yaw: float, pitch: float) -> ControlInput:
    return ControlInput(MOUSE_TRACK, MOUSE_SCHEMA.schema, {"yaw": yaw, "pitch": pitch})
