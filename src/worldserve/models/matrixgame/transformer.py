"""Matrix-Game 2.0's transformer, assembled from the library's Wan parts, plus its action modules.

Owns: :class:`MatrixGameTransformer` and :func:`build_transformer`. The network is Wan2.1's:
its blocks are diffusers' ``SkyReelsV2TransformerBlock`` (the very blocks ``wan-causal`` runs),
its time embedding diffusers' ``SkyReelsV2Timesteps`` + ``TimestepEmbedding``, its image
embedder diffusers' ``SkyReelsV2ImageEmbedding`` (Wan2.1-I2V's ``MLPProj``: LayerNorm, Linear,
GELU, Linear, LayerNorm). What Matrix-Game changes: the patch embedding takes 36 channels (noisy
latents, the first-frame mask, the start image's latents); there is no text embedder (the
cross-attention reads the image embedder's output alone, through the block's plain ``attn2``);
the blocks listed in the action configuration carry an
:class:`~worldserve.models.matrixgame.action.ActionModule` as ``action_model``. Parameter names
are therefore the Diffusers layout's (``condition_embedder.image_embedder.ff.net.0.proj``,
``blocks.N.attn1.to_q``, ``blocks.N.action_model.t_qkv``, ...). Must not know: caches, sessions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers.models.embeddings import TimestepEmbedding
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_skyreels_v2 import (
    SkyReelsV2ImageEmbedding,
    SkyReelsV2Timesteps,
    SkyReelsV2TransformerBlock,
)
from torch import Tensor, nn

from worldserve.models.matrixgame.action import ActionModule
from worldserve.models.matrixgame.config import MatrixGameConfig

__all__ = ["ConditionEmbedder", "MatrixGameTransformer", "build_transformer"]


class ConditionEmbedder(nn.Module):
    """Per-frame timesteps -> (temb, the 6-way modulation); the image's CLIP features -> the context."""

    def __init__(self, dim: int, freq_dim: int, image_dim: int) -> None:
        super().__init__()
        self.timesteps_proj = SkyReelsV2Timesteps(num_channels=freq_dim, flip_sin_to_cos=True)
        self.time_embedder = TimestepEmbedding(in_channels=freq_dim, time_embed_dim=dim)
        self.act_fn = nn.SiLU()
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.image_embedder = SkyReelsV2ImageEmbedding(image_dim, dim)

    def forward(self, timesteps: Tensor, image: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """``timesteps`` ``[B, F]``, ``image`` ``[B, tokens, image_dim]`` -> temb ``[B, F, dim]``, the
        modulation ``[B, F, 6 * dim]`` and the context ``[B, tokens, dim]``."""
        sinusoid = self.timesteps_proj(timesteps)
        weight: Tensor = self.time_embedder.linear_1.weight
        temb: Tensor = self.time_embedder(sinusoid.to(weight.dtype)).to(dtype)
        timestep_proj: Tensor = self.time_proj(self.act_fn(temb))
        context: Tensor = self.image_embedder(image.to(dtype))
        return temb, timestep_proj, context


class MatrixGameTransformer(nn.Module):
    """Matrix-Game 2.0's ``CausalWanModel`` in the Diffusers layout (see the module docstring)."""

    def __init__(self, config: MatrixGameConfig) -> None:
        super().__init__()
        wan = config.wan
        dim = wan.dim
        self.config = config
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=wan.patch, stride=wan.patch)
        self.condition_embedder = ConditionEmbedder(dim, wan.freq_dim, config.clip.dim)
        blocks = []
        for index in range(wan.num_layers):
            block = SkyReelsV2TransformerBlock(
                dim, wan.ffn_dim, wan.num_heads, "rms_norm_across_heads", cross_attn_norm=True, eps=wan.eps
            )
            if index in config.action.layers:
                block.action_model = ActionModule(config.action, dim)
            blocks.append(block)
        self.blocks = nn.ModuleList(blocks)
        self.norm_out = FP32LayerNorm(dim, wan.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, wan.latent_channels * math.prod(wan.patch))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def action_modules(self) -> list[tuple[int, ActionModule]]:
        """(block index, module) of every block with an action module, in order."""
        found = []
        for index, block in enumerate(self.blocks):
            module: Any = getattr(block, "action_model", None)
            if isinstance(module, ActionModule):
                found.append((index, module))
        return found


def build_transformer(config: MatrixGameConfig) -> MatrixGameTransformer:
    """A randomly initialised transformer of ``config``'s size and variant (float32)."""
    return MatrixGameTransformer(config)
