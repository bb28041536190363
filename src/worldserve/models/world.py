"""The procedural world both built-in models share: terrain, styles, controls, motion.

Owns: a deterministic, infinite top-down terrain (:class:`World`: banded height
contours from seeded value noise, with sparse tree features) rendered as RGB views
in one of :data:`STYLES` (picked from a free-text prompt by :func:`style_for_prompt`);
the control tracks (:data:`CONTROL_SCHEMAS`: held movement keys and a camera pan) and
how they move the view (:func:`velocity`, :class:`Motion`).

The ``procedural`` model renders this world exactly; ``tinyworld`` learns it. Must
not know: sessions, engines, torch. Needs numpy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worldserve.models.base import ControlSchema
from worldserve.protocol import ControlInput

__all__ = [
    "CAMERA_SCHEMA",
    "CONTINUOUS_TRACKS",
    "CONTROL_SCHEMAS",
    "DEFAULT_STYLE",
    "KEYS_SCHEMA",
    "KEY_SPEED",
    "MAX_SPEED",
    "STYLES",
    "WORLD_VERSION",
    "STYLE_WORDS",
    "Motion",
    "World",
    "camera_control",
    "keys_control",
    "style_for_prompt",
    "velocity",
]

Frame = npt.NDArray[np.uint8]

#: Pixels per frame that one held movement key moves the view.
KEY_SPEED = 2.0
#: Largest view speed per axis, pixels per frame (keys and camera together).
MAX_SPEED = 4.0

KEYS_SCHEMA = ControlSchema(
    track="keys",
    schema="worldserve.keys.v1",
    description=(
        "Movement keys held now (held-key state: it lasts until the next keys event). "
        f"W moves the view up, S down, A left, D right, {KEY_SPEED:g} px per frame each; "
        "opposite keys cancel."
    ),
    json_schema={
        "type": "object",
        "properties": {
            "held": {
                "type": "array",
                "items": {"enum": ["W", "A", "S", "D"]},
                "uniqueItems": True,
                "maxItems": 4,
            }
        },
        "required": ["held"],
        "additionalProperties": False,
    },
    example={"held": ["W", "D"]},
)

CAMERA_SCHEMA = ControlSchema(
    track="camera",
    schema="worldserve.camera.v1",
    description=(
        "Camera pan velocity in px per frame (positive dx pans right, positive dy down); "
        "it lasts until the next camera event, so send {dx: 0, dy: 0} to stop. Adds to the "
        f"keys; each axis is capped at {MAX_SPEED:g} px per frame."
    ),
    json_schema={
        "type": "object",
        "properties": {
            "dx": {"type": "number", "minimum": -MAX_SPEED, "maximum": MAX_SPEED},
            "dy": {"type": "number", "minimum": -MAX_SPEED, "maximum": MAX_SPEED},
        },
        "required": ["dx", "dy"],
        "additionalProperties": False,
    },
    example={"dx": 1.5, "dy": 0},
)

CONTROL_SCHEMAS: tuple[ControlSchema, ...] = (KEYS_SCHEMA, CAMERA_SCHEMA)

#: Both tracks are state (the keys held now, the camera's pan velocity), not commands.
CONTINUOUS_TRACKS: tuple[str, ...] = (KEYS_SCHEMA.track, CAMERA_SCHEMA.track)


def keys_control(*held: str) -> ControlInput:
    """A ``keys`` control: the movement keys held now (none: stand still)."""
    return ControlInput(KEYS_SCHEMA.track, KEYS_SCHEMA.schema, {"held": list(held)})


def camera_control(dx: float, dy: float) -> ControlInput:
    """A ``camera`` control: the pan velocity, px per frame."""
    return ControlInput(CAMERA_SCHEMA.track, CAMERA_SCHEMA.schema, {"dx": dx, "dy": dy})


_KEY_VECTORS = {"W": (0.0, -1.0), "S": (0.0, 1.0), "A": (-1.0, 0.0), "D": (1.0, 0.0)}


def velocity(controls: Sequence[ControlInput]) -> tuple[float, float]:
    """The view's velocity (px per frame) under a tick's controls; unknown tracks are ignored."""
    vx = vy = 0.0
    for control in controls:
        if control.track == KEYS_SCHEMA.track:
            for key in control.data.get("held", ()):
                kx, ky = _KEY_VECTORS.get(key, (0.0, 0.0))
                vx += kx * KEY_SPEED
                vy += ky * KEY_SPEED
        elif control.track == CAMERA_SCHEMA.track:
            vx += float(control.data.get("dx", 0.0))
            vy += float(control.data.get("dy", 0.0))
    return (min(max(vx, -MAX_SPEED), MAX_SPEED), min(max(vy, -MAX_SPEED), MAX_SPEED))


@dataclass(slots=True)
class Motion:
    """A view position that moves with sub-pixel precision and renders at whole pixels."""

    x: float = 0.0
    y: float = 0.0

    @property
    def pixel(self) -> tuple[int, int]:
        return (math.floor(self.x + 0.5), math.floor(self.y + 0.5))

    def advance(self, vx: float, vy: float, frames: int) -> list[tuple[int, int]]:
        """Move ``frames`` steps; return the whole-pixel position after each."""
        positions = []
        for _ in range(frames):
            self.x += vx
            self.y += vy
            positions.append(self.pixel)
        return positions


@dataclass(frozen=True, slots=True)
class _Band:
    top: float  # upper bound of the height band
    rgb: tuple[int, int, int]
    trees: bool = False


@dataclass(frozen=True, slots=True)
class _Style:
    name: str
    words: tuple[str, ...]
    bands: tuple[_Band, ...]
    tree_rgb: tuple[int, int, int]


_STYLE_TABLE: tuple[_Style, ...] = (
    _Style(
        "islands",
        ("islands", "island", "ocean", "sea", "archipelago", "beach", "tropical", "lagoon", "coast"),
        (
            _Band(0.50, (24, 62, 140)),
            _Band(0.57, (46, 118, 196)),
            _Band(0.62, (232, 212, 150)),
            _Band(0.72, (96, 176, 72)),
            _Band(1.01, (44, 128, 56), trees=True),
        ),
        (18, 70, 30),
    ),
    _Style(
        "desert",
        ("desert", "sand", "sandy", "dune", "dunes", "arid", "canyon", "mesa", "sahara"),
        (
            _Band(0.26, (48, 126, 170)),
            _Band(0.30, (120, 150, 70), trees=True),
            _Band(0.50, (228, 192, 124)),
            _Band(0.62, (204, 160, 96)),
            _Band(0.74, (168, 104, 62)),
            _Band(1.01, (122, 70, 46)),
        ),
        (60, 90, 40),
    ),
    _Style(
        "forest",
        ("forest", "woods", "woodland", "trees", "jungle", "green", "meadow", "grove"),
        (
            _Band(0.34, (42, 92, 164)),
            _Band(0.46, (116, 174, 64)),
            _Band(0.78, (36, 112, 46), trees=True),
            _Band(1.01, (124, 122, 112)),
        ),
        (16, 58, 22),
    ),
    _Style(
        "snow",
        ("snow", "snowy", "ice", "icy", "winter", "frozen", "arctic", "tundra", "glacier"),
        (
            _Band(0.36, (168, 210, 232)),
            _Band(0.62, (240, 244, 250)),
            _Band(0.78, (52, 92, 82), trees=True),
            _Band(1.01, (112, 112, 124)),
        ),
        (24, 52, 46),
    ),
)

#: Style names, in a fixed order (class indices of style classifiers follow it).
STYLES: tuple[str, ...] = tuple(style.name for style in _STYLE_TABLE)

#: Version of the world's generator (terrain, styles, motion): bump it when rendering changes.
WORLD_VERSION = "world-1"
DEFAULT_STYLE = "islands"
#: The words that name each style in a prompt (:func:`style_for_prompt` takes the first one found).
STYLE_WORDS: dict[str, tuple[str, ...]] = {style.name: style.words for style in _STYLE_TABLE}
_STYLE_BY_NAME = {style.name: style for style in _STYLE_TABLE}
_STYLE_BY_WORD = {word: style.name for style in _STYLE_TABLE for word in style.words}
_WORD = re.compile(r"[a-z]+")


def style_for_prompt(prompt: str | None, default: str = DEFAULT_STYLE) -> str:
    """The style a prompt names: the first style word in it, else ``default``."""
    if prompt:
        for word in _WORD.findall(prompt.lower()):
            style = _STYLE_BY_WORD.get(word)
            if style is not None:
                return style
    return default


_M1 = np.uint32(0x8DA6B343)
_M2 = np.uint32(0xD8163841)
_M3 = np.uint32(0x85EBCA6B)
_M4 = np.uint32(0xC2B2AE35)


def _hash01(ix: npt.NDArray[np.int64], iy: npt.NDArray[np.int64], salt: int) -> npt.NDArray[np.float64]:
    """A deterministic hash of integer lattice points to [0, 1)."""
    h = (ix.astype(np.uint32) * _M1) ^ (iy.astype(np.uint32) * _M2) ^ np.uint32(salt & 0xFFFFFFFF)
    h ^= h >> np.uint32(15)
    h *= _M3
    h ^= h >> np.uint32(13)
    h *= _M4
    h ^= h >> np.uint32(16)
    return h.astype(np.float64) * (1.0 / 2**32)


def _value_noise(
    xs: npt.NDArray[np.float64], ys: npt.NDArray[np.float64], wavelength: float, salt: int
) -> npt.NDArray[np.float64]:
    """Smooth value noise in [0, 1) at a row of x and a column of y coordinates."""
    fx = xs / wavelength
    fy = ys / wavelength
    ix = np.floor(fx).astype(np.int64)
    iy = np.floor(fy).astype(np.int64)
    tx = fx - ix
    ty = fy - iy
    tx = tx * tx * (3.0 - 2.0 * tx)
    ty = ty * ty * (3.0 - 2.0 * ty)
    v00 = _hash01(ix, iy, salt)
    v10 = _hash01(ix + 1, iy, salt)
    v01 = _hash01(ix, iy + 1, salt)
    v11 = _hash01(ix + 1, iy + 1, salt)
    top = v00 + (v10 - v00) * tx
    bottom = v01 + (v11 - v01) * tx
    return top + (bottom - top) * ty


_TREE_CELL = 5


class World:
    """One seeded, infinite world; :meth:`render` draws any window of it in any style."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) & 0xFFFFFFFF

    def height(self, x: int, y: int, height: int, width: int) -> npt.NDArray[np.float64]:
        """The terrain height field in [0, 1) over a window."""
        xs = np.arange(x, x + width, dtype=np.float64)[None, :]
        ys = np.arange(y, y + height, dtype=np.float64)[:, None]
        salt = self.seed * 3
        coarse = _value_noise(xs, ys, 30.0, salt)
        fine = _value_noise(xs, ys, 11.0, salt + 1)
        return 0.72 * coarse + 0.28 * fine

    def render(self, x: int, y: int, height: int, width: int, style: str) -> Frame:
        """RGB ``uint8 [height, width, 3]`` view whose top-left world pixel is ``(x, y)``."""
        spec = _STYLE_BY_NAME[style]
        field = self.height(x, y, height, width)
        tops = np.array([band.top for band in spec.bands])
        band_index = np.minimum(np.searchsorted(tops, field, side="right"), len(spec.bands) - 1)
        palette = np.array([band.rgb for band in spec.bands], dtype=np.uint8)
        frame = palette[band_index]
        wooded = np.array([band.trees for band in spec.bands])[band_index]
        if wooded.any():
            frame[wooded & self._trees(x, y, height, width)] = spec.tree_rgb
        return frame

    def _trees(self, x: int, y: int, height: int, width: int) -> npt.NDArray[np.bool_]:
        """Sparse 2x2 tree marks, one jittered candidate per 5x5 cell, about half present."""
        xs = np.arange(x, x + width, dtype=np.int64)[None, :]
        ys = np.arange(y, y + height, dtype=np.int64)[:, None]
        cx, ox = np.divmod(xs, _TREE_CELL)
        cy, oy = np.divmod(ys, _TREE_CELL)
        salt = self.seed * 3 + 2
        jitter = _hash01(cx, cy, salt)
        present = _hash01(cx, cy, salt + 7) < 0.55
        jx = (jitter * 4).astype(np.int64)  # 0..3
        jy = (jitter * 16).astype(np.int64) % 4
        dx = ox - jx
        dy = oy - jy
        return present & (dx >= 0) & (dx < 2) & (dy >= 0) & (dy < 2)
