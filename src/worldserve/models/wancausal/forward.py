"""``wan-causal``'s cached, block-causal forward over several sessions at different positions.

Owns: :class:`CachedForward`, the Wan2.1 T2V transformer's forward for one AR block of every
session in a batch: diffusers' ``SkyReelsV2Transformer3DModel``'s patch embedding and condition
embedder (text and per-frame timesteps), the family's action embedding added to the timestep
projection, then the shared blocks and head
(:class:`~worldserve.models.wan.blocks.BlockRunner`: each row against its own cache, RoPE at its
own frame offset, one self-attention call per layer per pass). Must not know: the sampler's
schedule, the VAE, sessions' control plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from worldserve.models.wan.blocks import BlockRunner
from worldserve.models.wan.cache import BatchKV, KVCache
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wancausal.actions import ActionEmbedding

__all__ = ["CachedForward"]


class CachedForward:
    """The block-causal transformer forward against the KV caches of a batch of sessions."""

    def __init__(
        self,
        transformer: nn.Module,
        actions: ActionEmbedding,
        config: WanCausalConfig,
        *,
        attention: str = "batched",
        compile: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        self.blocks = BlockRunner(
            transformer, config, attention=attention, compile=compile, compile_backend=compile_backend
        )
        self.transformer = transformer
        self.actions = actions
        self.config = config
        self.attention = attention
        self.compiled = compile

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
        caches: Sequence[KVCache] | BatchKV,
        rope: tuple[Tensor, Tensor],
        *,
        head: bool = True,
    ) -> Tensor | None:
        """Flow prediction for ``latents`` ``[B, C, F, h, w]`` at ``timesteps`` ``[B, F]``.

        ``text`` is ``[B, text_len, text_dim]``, ``actions`` ``[B, F, action_dim]``, ``rope``
        the (cos, sin) for each row's frames, ``caches`` the step's :class:`BatchKV` (or the
        caches, gathered here). With ``head=False`` (the commit pass) the output head is skipped.
        """
        kv = caches if isinstance(caches, BatchKV) else BatchKV(list(caches))
        tr: Any = self.transformer
        _, _, frames, height, width = latents.shape
        _, p_h, p_w = self.config.patch
        hidden = tr.patch_embedding(latents.to(self.dtype)).flatten(2).transpose(1, 2)
        temb, timestep_proj, context, _ = tr.condition_embedder(timesteps, text.to(self.dtype))
        timestep_proj = timestep_proj + self.actions(actions.to(timestep_proj.dtype))
        grid = (frames, height // p_h, width // p_w)
        return self.blocks(hidden, temb, timestep_proj, context, kv, rope, grid, head=head)
