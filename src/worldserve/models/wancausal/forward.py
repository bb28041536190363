"""One cached, block-causal forward over several sessions at different positions.

Owns: :class:`CachedForward`, the transformer's forward for one AR block of every session
in a batch, written on the public submodules of diffusers' ``SkyReelsV2Transformer3DModel``
(patch embedding, condition embedder, each block's norms, attention projections, cross
attention and FFN, the output head). What it adds to the library's dense forward: each
row's self-attention reads that session's :class:`~worldserve.models.wancausal.cache.KVCache`
(the block's own K/V written to the cache's scratch first), RoPE at each row's own frame
offset, per-frame timesteps and an action embedding added to the timestep projection. The
projections, FFN and cross-attention run once for the whole batch; only the attention over
each session's cache runs per row (its own length, no padding, no copy). Must not know:
the sampler's schedule, the VAE, sessions' control plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.wancausal.build import ActionEmbedding
from worldserve.models.wancausal.cache import KVCache
from worldserve.models.wancausal.config import WanCausalConfig
from worldserve.models.wancausal.rope import apply_rope

__all__ = ["CachedForward"]


class CachedForward:
    """The block-causal transformer forward against per-session KV caches."""

    def __init__(self, transformer: nn.Module, actions: ActionEmbedding, config: WanCausalConfig):
        self.transformer = transformer
        self.actions = actions
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        transformer: Any = self.transformer
        weight: Tensor = transformer.patch_embedding.weight
        return weight.dtype

    def __call__(
        self,
        latents: Tensor,
        timesteps: Tensor,
        text: Tensor,
        actions: Tensor,
        caches: Sequence[KVCache],
        rope: tuple[Tensor, Tensor],
        *,
        head: bool = True,
    ) -> Tensor | None:
        """Flow prediction for ``latents`` ``[B, C, F, h, w]`` at ``timesteps`` ``[B, F]``.

        ``text`` is ``[B, text_len, text_dim]``, ``actions`` ``[B, F, action_dim]``, ``rope``
        the (cos, sin) for each row's frames. Each row's K/V land in its cache's scratch
        slots; with ``head=False`` (the commit pass) the output head is skipped.
        """
        tr: Any = self.transformer
        batch, _, frames, height, width = latents.shape
        p_t, p_h, p_w = self.config.patch
        pph, ppw = height // p_h, width // p_w
        hw = pph * ppw
        dim = self.config.dim
        hidden = tr.patch_embedding(latents.to(self.dtype)).flatten(2).transpose(1, 2)
        temb, timestep_proj, context, _ = tr.condition_embedder(timesteps, text.to(self.dtype))
        timestep_proj = timestep_proj + self.actions(actions.to(timestep_proj.dtype))
        # Per-frame modulation [B, 6, F, 1, dim]; it broadcasts over a frame's tokens.
        modulation = timestep_proj.unflatten(-1, (6, -1)).transpose(1, 2).unsqueeze(3).float()
        for layer, block in enumerate(tr.blocks):
            hidden = self._block(layer, block, hidden, context, modulation, rope, caches, (batch, frames, hw, dim))
        if not head:
            return None
        table = tr.scale_shift_table.view(1, 2, 1, 1, dim)
        shift, scale = (table + temb.view(batch, 1, frames, 1, dim)).unbind(1)
        hidden4 = hidden.view(batch, frames, hw, dim)
        out = (tr.norm_out(hidden4.float()) * (1 + scale) + shift).type_as(hidden)
        out = tr.proj_out(out)
        out = out.reshape(batch, frames, pph, ppw, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        result: Tensor = out.flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return result

    def _block(
        self,
        layer: int,
        block: Any,
        hidden: Tensor,
        context: Tensor,
        modulation: Tensor,
        rope: tuple[Tensor, Tensor],
        caches: Sequence[KVCache],
        shape: tuple[int, int, int, int],
    ) -> Tensor:
        batch, frames, hw, dim = shape
        table = block.scale_shift_table.view(1, 6, 1, 1, dim)
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = (table + modulation).unbind(1)
        h4 = hidden.view(batch, frames, hw, dim)
        normed = (block.norm1(h4.float()) * (1 + scale_msa) + shift_msa).type_as(hidden)
        attn = self._self_attention(layer, block.attn1, normed.view(batch, frames * hw, dim), rope, caches)
        h4 = (h4.float() + attn.view(batch, frames, hw, dim) * gate_msa).type_as(hidden)
        normed = block.norm2(h4.float()).type_as(hidden)
        cross = block.attn2(normed.view(batch, frames * hw, dim), context, None, None)
        h4 = h4 + cross.view(batch, frames, hw, dim)
        normed = (block.norm3(h4.float()) * (1 + c_scale) + c_shift).type_as(hidden)
        ff = block.ffn(normed)
        h4 = (h4.float() + ff.float() * c_gate).type_as(hidden)
        result: Tensor = h4.view(batch, frames * hw, dim)
        return result

    def _self_attention(
        self, layer: int, attn: Any, x: Tensor, rope: tuple[Tensor, Tensor], caches: Sequence[KVCache]
    ) -> Tensor:
        heads = self.config.num_heads
        query = attn.norm_q(attn.to_q(x)).unflatten(2, (heads, -1))
        key = attn.norm_k(attn.to_k(x)).unflatten(2, (heads, -1))
        value = attn.to_v(x).unflatten(2, (heads, -1))
        query = apply_rope(query, *rope)
        key = apply_rope(key, *rope)
        out = torch.empty_like(query)
        for row, cache in enumerate(caches):
            cache.write_scratch(layer, key[row].transpose(0, 1), value[row].transpose(0, 1))
            keys, values = cache.visible(layer)
            attended = F.scaled_dot_product_attention(query[row].transpose(0, 1)[None], keys[None], values[None])
            out[row] = attended[0].transpose(0, 1)
        result: Tensor = attn.to_out[0](out.flatten(2))
        return result
