"""Matrix-Game 2.0's action modules: keyboard and mouse injected into the transformer blocks.

Owns: :class:`ActionModule` (one block's module, its parameters named as the reference names
them: ``keyboard_embed``, ``mouse_mlp``, ``t_qkv``, ``img_attn_q_norm``/``img_attn_k_norm``,
``proj_mouse``, ``mouse_attn_q``, ``keyboard_attn_kv``, ``key_attn_q_norm``/``key_attn_k_norm``,
``proj_keyboard``), :class:`ActionRope` (its rotary tables at each session's own frames),
:func:`action_windows` (each latent frame's window of video-frame actions) and
:func:`first_block_actions`. Must not know: sessions, the sampler, checkpoints' files.

What the module computes, for a block of ``F`` latent frames of ``S`` tokens each (the
reference's ``wan/modules/action_module.py``, batched over sessions and against caches):

- **Windows.** Latent frame ``f`` reads the actions of the ``window * frames_per_latent`` (12)
  video frames before its own, ``[4f - 12, 4f)``; frames before the first take the first frame's
  action. Keyboard actions pass through ``keyboard_embed`` per video frame first.
- **Mouse** (variants with a mouse): each token's hidden state is concatenated with its frame's
  window of (pitch, yaw) values, through ``mouse_mlp`` (Linear, GELU-tanh, Linear, LayerNorm),
  ``t_qkv`` into 16 heads; each token attends over ITS OWN column of frames (the same spatial
  position in the cached frames and the block's), queries and keys RMS-normalised and rotated by
  their frame index; ``proj_mouse`` back to the model width, added.
- **Keyboard**: queries from every token (``mouse_attn_q`` of the hidden state, after the mouse's
  addition), keys and values from each frame's embedded window (``keyboard_attn_kv``): one key per
  frame, shared by the frame's tokens; RMS norms and rotation by frame index as for the mouse;
  ``proj_keyboard``, added.
- Both attentions see the cached frames and all of the block's frames (no mask inside the block).
  Their K/V are cached like the self-attention's, committed from the commit pass.
- The RMS norms of the action module have a weight in the checkpoint that the reference does not
  apply (``WanRMSNorm.forward`` there returns ``x * rsqrt(mean(x^2) + eps)``); so here.
- RoPE: theta 256 over the head's first ``rope_dims[0]`` (8) channels at the latent frame's
  absolute index; the other channels' axes (height, width) have the single position 0. The
  reference reads a 7500-frame table; here the table is computed at each frame's position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from torch import Tensor, nn

from worldserve.models.matrixgame.config import ActionConfig
from worldserve.models.wan.cache import BatchKV
from worldserve.models.wan.rope import apply_rope

__all__ = ["ActionModule", "ActionRope", "UnscaledRMSNorm", "action_windows", "first_block_actions"]


class UnscaledRMSNorm(nn.Module):
    """RMS normalisation over the last axis; ``weight`` is loaded but, as in the reference, not applied."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


class ActionRope:
    """cos/sin ``[B, frames, head_dim]`` of the action attentions at per-row latent-frame offsets."""

    def __init__(self, config: ActionConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def __call__(self, offsets: Sequence[int], frames: int) -> tuple[Tensor, Tensor]:
        time_dims = self.config.rope_dims[0]
        rest = self.config.head_dim - time_dims
        start = torch.tensor(list(offsets), dtype=torch.float64).to(self.device, non_blocking=True)
        positions = (start[:, None] + torch.arange(frames, dtype=torch.float64, device=self.device)).reshape(-1)
        pos: object = positions
        cos, sin = get_1d_rotary_pos_embed(
            time_dims,
            pos,  # type: ignore[arg-type]
            self.config.rope_theta,
            use_real=True,
            repeat_interleave_real=True,
            freqs_dtype=torch.float64,
        )
        ones = torch.ones(cos.shape[0], rest, dtype=cos.dtype, device=cos.device)
        zeros = torch.zeros_like(ones)
        batch = len(offsets)
        full_cos = torch.cat([cos, ones], dim=-1).view(batch, frames, -1).float()
        full_sin = torch.cat([sin, zeros], dim=-1).view(batch, frames, -1).float()
        return full_cos, full_sin


def first_block_actions(actions: Tensor, frames_per_latent: int = 4) -> Tensor:
    """A first block's video-frame actions ``[..., 1 + 4(F - 1), A]`` laid out as every block's ``4F``.

    The first latent frame stands for one video frame; the ``frames_per_latent - 1`` slots before it
    take its action (what the reference pads every window with), so a first block's windows come out
    of :func:`action_windows` exactly as the reference's do.
    """
    pad = actions[..., :1, :].expand(*actions.shape[:-2], frames_per_latent - 1, actions.shape[-1])
    return torch.cat([pad, actions], dim=-2)


def action_windows(history: Tensor, block: Tensor, config: ActionConfig) -> Tensor:
    """Each latent frame's window of video-frame actions: ``[B, F, window * frames_per_latent, A]``.

    ``history`` ``[B, P, A]`` holds the ``P = window * frames_per_latent`` video frames before the
    block's (a first block's: P copies of its first action), ``block`` ``[B, 4F, A]`` the block's own
    (:func:`first_block_actions` for a first block). Latent frame ``i`` of the block reads the video
    frames ``[4(f - window), 4f)`` before its own (f its absolute index), which in ``history + block``
    start at ``4i + 3``.
    """
    ratio = config.frames_per_latent
    span = config.window_frames
    sequence = torch.cat([history, block], dim=1)
    frames = block.shape[1] // ratio
    return torch.stack([sequence[:, ratio * i + ratio - 1 : ratio * i + ratio - 1 + span] for i in range(frames)], 1)


class ActionModule(nn.Module):
    """One block's keyboard (and mouse) module; see the module docstring."""

    def __init__(self, config: ActionConfig, dim: int) -> None:
        super().__init__()
        self.config = config
        self.dim = dim
        bias = config.qkv_bias
        head = config.head_dim
        span = config.window_frames
        self.keyboard_embed = nn.Sequential(
            nn.Linear(config.keyboard_dim, config.keyboard_embed_dim),
            nn.SiLU(),
            nn.Linear(config.keyboard_embed_dim, config.keyboard_embed_dim),
        )
        if config.mouse:
            c = config.mouse_hidden
            self.mouse_mlp = nn.Sequential(
                nn.Linear(config.mouse_dim * span + dim, c),
                nn.GELU(approximate="tanh"),
                nn.Linear(c, c),
                nn.LayerNorm(c),
            )
            self.t_qkv = nn.Linear(c, 3 * c, bias=bias)
            self.img_attn_q_norm = UnscaledRMSNorm(head)
            self.img_attn_k_norm = UnscaledRMSNorm(head)
            self.proj_mouse = nn.Linear(c, dim, bias=bias)
        k = config.keyboard_hidden
        self.key_attn_q_norm = UnscaledRMSNorm(head)
        self.key_attn_k_norm = UnscaledRMSNorm(head)
        self.mouse_attn_q = nn.Linear(dim, k, bias=bias)
        self.keyboard_attn_kv = nn.Linear(config.keyboard_embed_dim * span, 2 * k, bias=bias)
        self.proj_keyboard = nn.Linear(k, dim, bias=bias)

    def forward(
        self,
        hidden: Tensor,
        grid: tuple[int, int],
        keyboard: Tensor,
        mouse: Tensor | None,
        rope: tuple[Tensor, Tensor],
        keyboard_kv: BatchKV,
        mouse_kv: BatchKV | None,
        index: int,
    ) -> Tensor:
        """``hidden`` ``[B, F * S, dim]`` plus the module's output; ``grid`` (F, S); ``keyboard``
        ``[B, F, 12, keyboard_dim]`` and ``mouse`` ``[B, F, 12, 2]`` (:func:`action_windows`); ``rope``
        (:class:`ActionRope`) at the block's frames; the caches' layer ``index``."""
        frames, tokens = grid
        batch = hidden.shape[0]
        heads, head = self.config.heads, self.config.head_dim
        cos = rope[0].view(batch, frames, 1, 1, head)
        sin = rope[1].view(batch, frames, 1, 1, head)
        if self.config.mouse:
            if mouse is None or mouse_kv is None:
                raise ValueError("a variant with a mouse needs each block's mouse windows and the mouse caches.")
            hidden = hidden + self._mouse(hidden, frames, tokens, mouse, cos, sin, mouse_kv, index)
        # Keyboard: keys/values per frame from its embedded window, queries from every token.
        embedded = self.keyboard_embed(keyboard.to(hidden.dtype)).flatten(2)  # [B, F, 12 * embed]
        kv = self.keyboard_attn_kv(embedded).view(batch, frames, 2, heads, head)
        key = apply_rope(self.key_attn_k_norm(kv[:, :, 0]), cos[:, :, 0], sin[:, :, 0])  # [B, F, heads, head]
        value = kv[:, :, 1]
        query = self.key_attn_q_norm(self.mouse_attn_q(hidden).view(batch, frames, tokens, heads, head))
        query = apply_rope(query, cos, sin).permute(0, 3, 1, 2, 4).reshape(batch, heads, frames * tokens, head)
        keys, values, mask = keyboard_kv.attend(index, key.transpose(1, 2), value.transpose(1, 2))
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)  # [B, heads, F * S, head]
        out = out.transpose(1, 2).reshape(batch, frames * tokens, heads * head)
        result: Tensor = hidden + self.proj_keyboard(out)
        return result

    def _mouse(
        self,
        hidden: Tensor,
        frames: int,
        tokens: int,
        mouse: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv: BatchKV,
        index: int,
    ) -> Tensor:
        """Each token over its own column of frames: ``[B, F * S, dim]`` to add."""
        batch = hidden.shape[0]
        heads, head = self.config.heads, self.config.head_dim
        columns = hidden.view(batch, frames, tokens, -1)  # [B, F, S, dim]
        windows = mouse.to(hidden.dtype).flatten(2)[:, :, None].expand(batch, frames, tokens, -1)
        features = self.mouse_mlp(torch.cat([columns, windows], dim=-1))
        qkv = self.t_qkv(features).view(batch, frames, tokens, 3, heads, head)
        query = apply_rope(self.img_attn_q_norm(qkv[:, :, :, 0]), cos, sin)  # [B, F, S, heads, head]
        key = apply_rope(self.img_attn_k_norm(qkv[:, :, :, 1]), cos, sin)
        value = qkv[:, :, :, 2]
        # The cache keeps [heads, frames * S, head] (frame-major, like the self-attention's).
        flat_key = key.permute(0, 3, 1, 2, 4).reshape(batch, heads, frames * tokens, head)
        flat_value = value.permute(0, 3, 1, 2, 4).reshape(batch, heads, frames * tokens, head)
        keys, values, mask = kv.attend(index, flat_key, flat_value)
        length = keys.shape[2] // tokens
        # Per token: [B, S, heads, frames, head] against [B, S, heads, L, head].
        keys5 = keys.view(batch, heads, length, tokens, head).permute(0, 3, 1, 2, 4)
        values5 = values.view(batch, heads, length, tokens, head).permute(0, 3, 1, 2, 4)
        query5 = query.permute(0, 2, 3, 1, 4)
        frame_mask = None if mask is None else mask.view(batch, 1, 1, length, tokens)[..., 0][:, None]
        out = F.scaled_dot_product_attention(query5, keys5, values5, attn_mask=frame_mask)
        out = out.permute(0, 3, 1, 2, 4).reshape(batch, frames * tokens, heads * head)
        result: Tensor = self.proj_mouse(out)
        return result
