"""Keys and camera controls -> per-latent-frame action features -> the transformer's modulation.

Owns: :func:`action_features` and :class:`ActionEmbedding` (keys/camera -> a per-frame addition
to the timestep modulation). A tick's ``keys`` and ``camera`` controls (the shared
schemas of :mod:`worldserve.models.world`) become the view's velocity through
:func:`~worldserve.models.world.velocity`; each latent frame of the block gets
``(vx, vy, |v|, moving)``, velocities over ``MAX_SPEED``. No control gives all zeros, which
the :class:`ActionEmbedding` maps to exactly zero. Must
not know: the transformer's other parts, sessions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from worldserve.models.world import MAX_SPEED, velocity
from worldserve.protocol import ControlInput

__all__ = ["ACTION_DIM", "ActionEmbedding", "action_features"]

ACTION_DIM = 4


def action_features(controls: Sequence[ControlInput], frames: int) -> list[list[float]]:
    """``frames`` rows of ``ACTION_DIM`` features for one tick's controls."""
    vx, vy = velocity(controls)
    speed = math.hypot(vx, vy)
    row = [vx / MAX_SPEED, vy / MAX_SPEED, speed / MAX_SPEED, 1.0 if speed > 0 else 0.0]
    return [list(row) for _ in range(frames)]


class ActionEmbedding(nn.Module):
    """Per-latent-frame action features -> an addition to the transformer's timestep projection.

    The transformer modulates every block with ``time_proj(silu(temb))`` (shift, scale and
    gate of its norms, 6 x dim per frame); this module adds ``W2 silu(W1 a)`` to it, so a
    frame's keys/camera steer it the way its noise level does (adaLN conditioning, as
    camera-conditioned video models do). Neither layer has a bias, so "no action" adds exactly
    zero and the model is then exactly the transformer alone. Random-initialised unless a
    checkpoint supplies ``action_embedding.*``.
    """

    def __init__(self, action_dim: int, dim: int) -> None:
        super().__init__()
        self.action_dim = action_dim
        self.dim = dim
        self.linear_1 = nn.Linear(action_dim, dim, bias=False)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, 6 * dim, bias=False)
        with torch.no_grad():
            self.linear_2.weight.mul_(0.1)

    def forward(self, actions: Tensor) -> Tensor:
        """``actions`` [..., action_dim] -> [..., 6 * dim]."""
        return self.linear_2(self.act(self.linear_1(actions)))  # type: ignore[no-any-return]
