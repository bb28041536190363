"""Rotary position embedding at each session's own latent-frame offset.

Owns: :class:`FrameRope` (cos/sin tables for a block of frames starting at a different
absolute frame per batch row, split over time/height/width as Wan splits a head:
``t = D - 2 * (2 * (D // 6))``, ``h = w = 2 * (D // 6)``) and :func:`apply_rope` (rotate
interleaved pairs). The frequencies come from diffusers' public ``get_1d_rotary_pos_embed``
at the exact positions, so a frame's rotation equals the library's table entry for it, and
positions are not capped by the library's ``rope_max_seq_len``. Must not know: caches,
sessions, the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from torch import Tensor

from worldserve.models.wan.config import WanCausalConfig

__all__ = ["FrameRope", "apply_rope"]

_THETA = 10000.0


def _table(dim: int, positions: Tensor) -> tuple[Tensor, Tensor]:
    # The function takes a tensor of positions as well as an array (it computes on ``pos.device``),
    # so the tables are built on the model's device.
    pos: Any = positions
    cos, sin = get_1d_rotary_pos_embed(
        dim, pos, _THETA, use_real=True, repeat_interleave_real=True, freqs_dtype=torch.float64
    )
    return cos, sin


class FrameRope:
    """cos/sin ``[B, frames * h * w, 1, head_dim]`` for blocks starting at per-row frame offsets."""

    def __init__(self, config: WanCausalConfig, device: torch.device) -> None:
        head = config.head_dim
        self.h_dim = self.w_dim = 2 * (head // 6)
        self.t_dim = head - self.h_dim - self.w_dim
        self.pph = config.latent_height // config.patch[1]
        self.ppw = config.latent_width // config.patch[2]
        self.device = device
        rows = torch.arange(self.pph, dtype=torch.float64, device=device)
        cols = torch.arange(self.ppw, dtype=torch.float64, device=device)
        self._h = _table(self.h_dim, rows)
        self._w = _table(self.w_dim, cols)

    def __call__(self, offsets: Sequence[int], frames: int) -> tuple[Tensor, Tensor]:
        batch = len(offsets)
        start = torch.tensor(list(offsets), dtype=torch.float64).to(self.device, non_blocking=True)
        positions = (start[:, None] + torch.arange(frames, dtype=torch.float64, device=self.device)).reshape(-1)
        t_cos, t_sin = _table(self.t_dim, positions)
        shape = (batch, frames, self.pph, self.ppw)
        out = []
        for t_part, h_part, w_part in ((t_cos, self._h[0], self._w[0]), (t_sin, self._h[1], self._w[1])):
            t_full = t_part.view(batch, frames, 1, 1, -1).expand(*shape, -1)
            h_full = h_part.view(1, 1, self.pph, 1, -1).expand(*shape, -1)
            w_full = w_part.view(1, 1, 1, self.ppw, -1).expand(*shape, -1)
            table = torch.cat([t_full, h_full, w_full], dim=-1)
            out.append(table.reshape(batch, frames * self.pph * self.ppw, 1, -1))
        return out[0], out[1]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, L, H, D]`` by interleaved pairs (Wan's convention)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    c = cos[..., 0::2]
    s = sin[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)
