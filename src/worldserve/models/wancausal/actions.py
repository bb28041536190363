"""Keys and camera controls -> per-latent-frame action features.

Owns: :func:`action_features`. A tick's ``keys`` and ``camera`` controls (the shared
schemas of :mod:`worldserve.models.world`) become the view's velocity through
:func:`~worldserve.models.world.velocity`; each latent frame of the block gets
``(vx, vy, |v|, moving)``, velocities over ``MAX_SPEED``. No control gives all zeros, which
the :class:`~worldserve.models.wancausal.build.ActionEmbedding` maps to exactly zero. Must
not know: the transformer, sessions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from worldserve.models.world import MAX_SPEED, velocity
from worldserve.protocol import ControlInput

__all__ = ["ACTION_DIM", "action_features"]

ACTION_DIM = 4


def action_features(controls: Sequence[ControlInput], frames: int) -> list[list[float]]:
    """``frames`` rows of ``ACTION_DIM`` features for one tick's controls."""
    vx, vy = velocity(controls)
    speed = math.hypot(vx, vy)
    row = [vx / MAX_SPEED, vy / MAX_SPEED, speed / MAX_SPEED, 1.0 if speed > 0 else 0.0]
    return [list(row) for _ in range(frames)]
