"""Rotary position embedding at each session's own latent-frame offset.

Owns: :class:`FrameRope` (cos/sin tables for a block of frames starting at a different
absolute frame per batch row, split over time/height/width as Wan splits a head:
``t = D - 2 * (2 * (D // 6))``, ``h = w = 2 * (D // 6)``; and for single frames of another grid
at chosen times: ABot-World's reference slots), :func:`apply_rope` (rotate interleaved pairs),
and ABot-World's relative RoPE as positions: :class:`RelativeWindow` (when its reference moves the
frame its window's positions count from) and :func:`slot_times` (where its reference slots sit).

**Relative RoPE, as absolute positions.** ABot-World (``use_relative_rope``, ``wan/modules/
causal_model.py``) keeps each key's temporal position local to its attention window of
``local_attn_size`` latent frames. In the path its inference runs (``REL_ROPE_CACHE`` on, no sink
frames: "optimization E"), keys are cached rotated at ``frame - base``, and ``base`` moves to the
oldest visible frame (the whole window re-rotated) when the block's positions would pass
``min(256, 1024 - local_attn_size - block)``; the reference images' keys are rotated at the fixed
times ``-(slots - i) * max(tokens_per_slot, 256)`` in the same coordinates. Attention logits
depend only on the difference of a query's and a key's position, so between video frames this is
Wan2.1's absolute positions (what :class:`FrameRope` gives, cached once at write, never
re-rotated), and for the reference slots it is a rotation at ``base + that time``: re-rotated only
when ``base`` moves, a few slots' keys rather than the window. The reference's other path (the
window re-rotated from 0 every block, slots fixed to the window's start) gives other logits
between video and slots; it is not the one its inference runs.

The frequencies come from diffusers' public ``get_1d_rotary_pos_embed`` at the exact positions, so
a frame's rotation equals the library's table entry for it (float32, as the library returns it),
and positions are not capped by the library's ``rope_max_seq_len``. Must not know: caches,
sessions, the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from torch import Tensor

from worldserve.models.wan.config import WanCausalConfig

__all__ = ["FrameRope", "RelativeWindow", "apply_rope", "slot_times"]

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

    def slots(self, times: Sequence[float], grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """cos/sin ``[1, len(times) * gh * gw, 1, head_dim]``: one frame of a ``grid`` of (gh, gw) patches
        at each of ``times`` (ABot-World's reference slots: their own grid, their own times)."""
        rows = torch.arange(grid[0], dtype=torch.float64, device=self.device)
        cols = torch.arange(grid[1], dtype=torch.float64, device=self.device)
        h_table, w_table = _table(self.h_dim, rows), _table(self.w_dim, cols)
        t_table = _table(self.t_dim, torch.tensor(list(times), dtype=torch.float64).to(self.device))
        shape = (len(times), grid[0], grid[1])
        out = []
        for t_part, h_part, w_part in zip(t_table, h_table, w_table, strict=True):
            table = torch.cat(
                [
                    t_part.view(-1, 1, 1, self.t_dim).expand(*shape, -1),
                    h_part.view(1, grid[0], 1, self.h_dim).expand(*shape, -1),
                    w_part.view(1, 1, grid[1], self.w_dim).expand(*shape, -1),
                ],
                dim=-1,
            )
            out.append(table.reshape(1, -1, 1, table.shape[-1]))
        return out[0], out[1]


@dataclass(frozen=True, slots=True)
class RelativeWindow:
    """ABot-World's relative RoPE (see the module docstring): the frame its positions count from."""

    #: ``local_attn_size``: latent frames a query sees, its own block's included.
    frames: int
    #: ``REL_ROPE_REBASE_MAX_POS``: a block's last position stays at most this far from ``base``.
    limit: int = 256
    #: The length of the reference's rotary table (``rope_params(1024, ...)``).
    table: int = 1024

    def base_for(self, base: int, start: int, block: int) -> int:
        """The base a block of ``block`` frames starting at absolute frame ``start`` is rotated from, the
        block before's being ``base``: moved to the oldest visible frame when the block would pass the limit."""
        visible = min(self.frames, start + block)
        position = start - base
        limit = min(self.limit, self.table - self.frames - block)
        if visible > 0 and (position + block > limit or position < 0):
            return start + block - visible
        return base


def slot_times(base: int, slots: int, tokens_per_slot: int) -> list[int]:
    """Absolute times of ABot-World's reference slots while its window counts from ``base``."""
    step = max(tokens_per_slot, 256)
    return [base - (slots - i) * step for i in range(slots)]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, L, H, D]`` by interleaved pairs (Wan's convention)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    c = cos[..., 0::2]
    s = sin[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)
