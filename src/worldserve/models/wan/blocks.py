"""The Wan transformer's blocks and output head over a batch of AR blocks, each row against its own caches.

Owns: :class:`BlockRunner`, written on the public submodules of diffusers' Wan layout (each
block's norms, attention projections, cross-attention and FFN, ``scale_shift_table``,
``norm_out``, ``proj_out``), and :data:`Inject` (a family's modules run between a block's
cross-attention and its FFN: Matrix-Game 2.0's action modules). What a family runs before it is
its own (the patch and condition embedding: ``wan-causal``'s
:class:`~worldserve.models.wancausal.forward.CachedForward`, Matrix-Game's
:class:`~worldserve.models.matrixgame.forward.MatrixGameForward`). What it adds to the library's
dense forward: each row's self-attention reads that session's cache, RoPE at each row's own frame
offset, per-frame modulation. Every part runs once for the whole batch: the projections, FFN and
cross-attention, and the self-attention too, ONE call per layer per pass over a
:class:`~worldserve.models.wan.cache.BatchKV` (the sessions' caches gathered, each row masked past
its own length), so a forward makes the same calls whatever the batch. ``attention="loop"`` keeps
the per-session loop (each row against its own cache, no gather) as the reference the batched
call is tested and measured against. ``compile=True`` runs each block's dense parts (everything
but the self-attention over the caches) through ``torch.compile`` (whole graphs, dynamic shapes).
A pass may carry a *prefix*: tokens before the frames' with a modulation of their own, whose keys and
values go to the caches' reference slots (ABot-World's reference images, in a session's first block,
at timestep 0's modulation; the head reads only the frames).
Must not know: the sampler's schedule, the VAE, any family's embedding or conditioning, sessions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.wan.cache import BatchKV
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.rope import apply_rope

__all__ = ["BlockRunner", "Inject"]

#: (batch, frames, tokens per frame, model width)
Shape = tuple[int, int, int, int]
#: A module run between a block's cross-attention and its FFN: (layer, hidden [B, tokens, dim]) -> hidden.
Inject = Callable[[int, Tensor], Tensor]


class BlockRunner:
    """The Wan blocks and output head over a batch of blocks, each row against its own caches.

    ``transformer`` is anything with the diffusers Wan layout's ``blocks`` (``norm1``, ``attn1``,
    ``norm2``, ``attn2``, ``norm3``, ``ffn``, ``scale_shift_table``), ``scale_shift_table``,
    ``norm_out`` and ``proj_out``.
    """

    def __init__(
        self,
        transformer: nn.Module,
        config: WanCausalConfig,
        *,
        attention: str = "batched",
        compile: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        if attention not in ("batched", "loop"):
            raise ValueError(f"attention must be 'batched' or 'loop'; got {attention!r}.")
        self.transformer = transformer
        self.config = config
        self.attention = attention
        self.compiled = compile
        self._pre: Any = _pre_attention
        self._cross: Any = _cross_attention
        self._ffn: Any = _feed_forward
        if compile:  # whole graphs (no breaks), shapes dynamic: one graph serves every batch size and window
            self._pre = torch.compile(_pre_attention, dynamic=True, fullgraph=True, backend=compile_backend)
            self._cross = torch.compile(_cross_attention, dynamic=True, fullgraph=True, backend=compile_backend)
            self._ffn = torch.compile(_feed_forward, dynamic=True, fullgraph=True, backend=compile_backend)

    def __call__(
        self,
        hidden: Tensor,
        temb: Tensor,
        timestep_proj: Tensor,
        context: Tensor,
        kv: BatchKV,
        rope: tuple[Tensor, Tensor],
        grid: tuple[int, int, int],
        *,
        head: bool = True,
        inject: Inject | None = None,
        prefix_proj: Tensor | None = None,
    ) -> Tensor | None:
        """``hidden`` ``[B, frames * h * w, dim]`` (patch tokens), ``temb`` ``[B, frames, dim]`` and
        ``timestep_proj`` ``[B, frames, 6 * dim]`` (per frame), ``context`` ``[B, tokens, dim]`` (what the
        cross-attention reads), ``grid`` (frames, h, w) in patches. Returns the flow prediction
        ``[B, C, frames, H, W]``, or None with ``head=False`` (the commit pass).

        With ``prefix_proj`` (``[B, 6 * dim]``), ``hidden`` is ``[B, P + frames * h * w, dim]``: P prefix
        tokens first, modulated by it, their keys and values written to the caches' reference slots
        (``rope`` then covers them too, first); ``inject`` is not run on such a pass."""
        tr: Any = self.transformer
        batch = hidden.shape[0]
        frames, pph, ppw = grid
        hw = pph * ppw
        dim = self.config.dim
        heads = self.config.num_heads
        # Per-frame modulation [B, 6, F, 1, dim]; it broadcasts over a frame's tokens.
        modulation = timestep_proj.view(batch, frames, 6, dim).transpose(1, 2).unsqueeze(3).float()
        prefix_mod = None if prefix_proj is None else prefix_proj.view(batch, 6, 1, dim).float()
        prefix = hidden.shape[1] - frames * hw
        if (prefix > 0) != (prefix_mod is not None):
            raise ValueError(f"{prefix} tokens before the frames' need prefix_proj, and prefix_proj needs them.")
        if prefix and (inject is not None or self.attention == "loop"):
            raise ValueError("a pass with a prefix runs the batched attention and no injected modules.")
        shape = (batch, frames, hw, dim)
        for layer, block in enumerate(tr.blocks):
            query, key, value, raw = self._pre(block, hidden, modulation, prefix_mod, rope[0], rope[1], shape, heads)
            if self.attention == "loop":
                attended = _loop_attention(layer, query, key, value, kv)
            else:
                if prefix:
                    refs = (key[:, :, :prefix], value[:, :, :prefix], raw)
                    keys, values, mask = kv.attend(layer, key[:, :, prefix:], value[:, :, prefix:], refs=refs)
                else:
                    keys, values, mask = kv.attend(layer, key, value)
                attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
            hidden = self._cross(block, hidden, attended, context, modulation, prefix_mod, shape)
            if inject is not None:
                hidden = inject(layer, hidden)
            hidden = self._ffn(block, hidden, modulation, prefix_mod, shape)
        if not head:
            return None
        if prefix:
            hidden = hidden[:, prefix:]
        p_t, p_h, p_w = self.config.patch
        table = tr.scale_shift_table.view(1, 2, 1, 1, dim)
        shift, scale = (table + temb.view(batch, 1, frames, 1, dim)).unbind(1)
        hidden4 = hidden.reshape(batch, frames, hw, dim)
        out = (tr.norm_out(hidden4.float()) * (1 + scale) + shift).type_as(hidden)
        out = tr.proj_out(out)
        out = out.reshape(batch, frames, pph, ppw, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        result: Tensor = out.flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return result


def _modulate(norm: Any, hidden: Tensor, mod: Tensor, prefix_mod: Tensor | None, shape: Shape, at: int) -> Tensor:
    """``norm(hidden) * (1 + scale) + shift`` with the modulation's (shift, scale) at ``at``, ``at + 1``:
    per frame over the frames' tokens, the prefix's own over the prefix."""
    batch, frames, hw, dim = shape
    if prefix_mod is None:
        out: Tensor = norm(hidden.view(batch, frames, hw, dim).float()) * (1 + mod[:, at + 1]) + mod[:, at]
        return out.type_as(hidden).view(batch, frames * hw, dim)
    prefix = hidden.shape[1] - frames * hw
    body = norm(hidden[:, prefix:].reshape(batch, frames, hw, dim).float()) * (1 + mod[:, at + 1]) + mod[:, at]
    head = norm(hidden[:, :prefix].float()) * (1 + prefix_mod[:, at + 1]) + prefix_mod[:, at]
    return torch.cat([head.type_as(hidden), body.type_as(hidden).reshape(batch, frames * hw, dim)], dim=1)


def _gated_add(hidden: Tensor, update: Tensor, mod: Tensor, prefix_mod: Tensor | None, shape: Shape, at: int) -> Tensor:
    """``hidden + update * gate`` with the modulation's gate at ``at`` (per frame; the prefix's own)."""
    batch, frames, hw, dim = shape
    if prefix_mod is None:
        h4 = hidden.view(batch, frames, hw, dim)
        h4 = (h4.float() + update.view(batch, frames, hw, dim) * mod[:, at]).type_as(hidden)
        return h4.view(batch, frames * hw, dim)
    prefix = hidden.shape[1] - frames * hw
    body = hidden[:, prefix:].reshape(batch, frames, hw, dim).float()
    body = body + update[:, prefix:].reshape(batch, frames, hw, dim) * mod[:, at]
    head = hidden[:, :prefix].float() + update[:, :prefix] * prefix_mod[:, at]
    return torch.cat([head.type_as(hidden), body.type_as(hidden).reshape(batch, frames * hw, dim)], dim=1)


def _pre_attention(
    block: Any,
    hidden: Tensor,
    modulation: Tensor,
    prefix_mod: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    shape: Shape,
    heads: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Norm and modulation, Q/K/V projections, QK norms and RoPE: ``[B, heads, tokens, head_dim]`` each,
    and the prefix's keys before RoPE (``[B, heads, P, head_dim]``; P = 0 without a prefix)."""
    _, frames, hw, dim = shape
    mod = block.scale_shift_table.view(1, 6, 1, 1, dim) + modulation
    pmod = None if prefix_mod is None else block.scale_shift_table.view(1, 6, 1, dim) + prefix_mod
    x = _modulate(block.norm1, hidden, mod, pmod, shape, 0)
    attn = block.attn1
    prefix = hidden.shape[1] - frames * hw
    query = apply_rope(attn.norm_q(attn.to_q(x)).unflatten(2, (heads, -1)), cos, sin)
    unrotated = attn.norm_k(attn.to_k(x)).unflatten(2, (heads, -1))
    key = apply_rope(unrotated, cos, sin)
    value = attn.to_v(x).unflatten(2, (heads, -1))
    raw = unrotated[:, :prefix].transpose(1, 2)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), raw


def _cross_attention(
    block: Any,
    hidden: Tensor,
    attended: Tensor,
    context: Tensor,
    modulation: Tensor,
    prefix_mod: Tensor | None,
    shape: Shape,
) -> Tensor:
    """The self-attention's output projection and gate, then the cross-attention."""
    dim = shape[3]
    mod = block.scale_shift_table.view(1, 6, 1, 1, dim) + modulation
    pmod = None if prefix_mod is None else block.scale_shift_table.view(1, 6, 1, dim) + prefix_mod
    attn = block.attn1.to_out[0](attended.transpose(1, 2).flatten(2))
    hidden = _gated_add(hidden, attn, mod, pmod, shape, 2)
    normed = block.norm2(hidden.float()).type_as(hidden)
    cross = block.attn2(normed, context, None, None)
    result: Tensor = hidden + cross
    return result


def _feed_forward(block: Any, hidden: Tensor, modulation: Tensor, prefix_mod: Tensor | None, shape: Shape) -> Tensor:
    """The modulated FFN and its gate."""
    dim = shape[3]
    mod = block.scale_shift_table.view(1, 6, 1, 1, dim) + modulation
    pmod = None if prefix_mod is None else block.scale_shift_table.view(1, 6, 1, dim) + prefix_mod
    ff = block.ffn(_modulate(block.norm3, hidden, mod, pmod, shape, 3))
    return _gated_add(hidden, ff.float(), mod, pmod, shape, 5)


def _loop_attention(layer: int, query: Tensor, key: Tensor, value: Tensor, kv: BatchKV) -> Tensor:
    """The per-session reference: each row against its own cache (its own length, no gather)."""
    if kv.pending is not None:
        kv.pending[0][layer] = key
        kv.pending[1][layer] = value
    out = torch.empty_like(query)
    for row, cache in enumerate(kv.caches):
        cache.write_scratch(layer, key[row], value[row])
        keys, values = cache.visible(layer)
        out[row] = F.scaled_dot_product_attention(query[row][None], keys[None], values[None])[0]
    return out
