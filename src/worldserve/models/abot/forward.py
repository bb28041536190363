"""``abot-world``'s cached forward: Wan2.2-TI2V-5B's blocks over a batch of AR blocks, keys and reference slots.

Owns: :class:`ABotForward`, the forward of ABot-World's ``CausalWanModel`` (``model_type: ci2v``,
``wan/modules/causal_model.py`` ``_forward_inference``) for one AR block of every session in a batch,
written on diffusers' Wan layout (``SkyReelsV2Transformer3DModel``'s patch embedding, condition
embedder and blocks: Wan2.2-TI2V-5B has Wan2.1's block structure, 48 channels in and out):

- the block's patch embeddings plus the control adapter's features for its keys, at scale 1
  (``_apply_control_adapters``; :class:`~worldserve.models.abot.control_adapter.ControlAdapter`);
- per-frame timesteps (a session's first block has its first frame, the start image, at 0);
- in a session's first block only, its reference slots' tokens (:meth:`ABotForward.ref_tokens`: the
  patch embedding of each slot's latents, times the slot's mask) before the frames', modulated at
  timestep 0, attending and attended with the block; their keys and values stay in the cache's
  reference slots for every later block (:class:`~worldserve.models.wan.cache.KVCache`), their
  rotations at the relative RoPE's slot times (:mod:`~worldserve.models.wan.rope`);
- then the shared blocks and head (:class:`~worldserve.models.wan.blocks.BlockRunner`, the prefix
  path), the head over the frames' tokens only.

The rows of one call are all first blocks or none (a first block's pass is longer). Must not know:
the sampler's schedule, the VAE, how keys are read from a session's controls, sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from worldserve.models.abot.config import ABotConfig
from worldserve.models.abot.control_adapter import ControlAdapter
from worldserve.models.wan.blocks import BlockRunner
from worldserve.models.wan.cache import BatchKV, KVCache

__all__ = ["ABotForward"]


class ABotForward:
    """The block-causal ``ci2v`` forward against the KV caches of a batch of sessions."""

    def __init__(
        self,
        transformer: nn.Module,
        adapter: ControlAdapter,
        config: ABotConfig,
        *,
        compile: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        self.blocks = BlockRunner(transformer, config.wan, compile=compile, compile_backend=compile_backend)
        self.transformer = transformer
        self.adapter = adapter
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        transformer: Any = self.transformer
        weight: Tensor = transformer.patch_embedding.weight
        return weight.dtype

    def ref_tokens(self, latents: Tensor, mask: Tensor) -> Tensor:
        """The reference slots' tokens ``[B, slots * tokens per slot, dim]`` from their latents
        ``[B, slots, C, 1, h, w]`` and ``mask`` ``[B, slots]`` (0: no image, the slot's tokens zero)."""
        batch, slots = latents.shape[:2]
        if slots != self.config.ref_slots or mask.shape != (batch, slots):
            raise ValueError(
                f"{self.config.ref_slots} reference slots and a mask per slot; got {tuple(latents.shape)}"
                f" and a mask {tuple(mask.shape)}."
            )
        tr: Any = self.transformer
        embedded = tr.patch_embedding(latents.flatten(0, 1).to(self.dtype))  # [B * slots, dim, 1, h', w']
        tokens = embedded.flatten(2).transpose(1, 2).unflatten(0, (batch, slots))
        tokens = tokens * mask.to(tokens.dtype)[:, :, None, None]
        result: Tensor = tokens.flatten(1, 2)
        return result

    def __call__(
        self,
        latents: Tensor,
        timesteps: Tensor,
        text: Tensor,
        keys: Sequence[Sequence[int]],
        caches: Sequence[KVCache] | BatchKV,
        rope: tuple[Tensor, Tensor],
        *,
        refs: Tensor | None = None,
        ref_rope: tuple[Tensor, Tensor] | None = None,
        head: bool = True,
    ) -> Tensor | None:
        """Flow prediction for ``latents`` ``[B, C, F, h, w]`` at ``timesteps`` ``[B, F]``.

        ``text`` is ``[B, text_len, text_dim]``, ``keys`` each row's key bits for the block, ``rope``
        the (cos, sin) of each row's frames. In sessions' first blocks, ``refs`` (:meth:`ref_tokens`)
        and ``ref_rope`` (their slots' cos/sin, ``[B, ref tokens, 1, head_dim]``). With ``head=False``
        (the commit pass) the output head is skipped.
        """
        if (refs is None) != (ref_rope is None):
            raise ValueError("refs and ref_rope go together (a session's first block).")
        kv = caches if isinstance(caches, BatchKV) else BatchKV(list(caches))
        tr: Any = self.transformer
        _, _, frames, height, width = latents.shape
        _, p_h, p_w = self.config.wan.patch
        grid = (height // p_h, width // p_w)
        embedded = tr.patch_embedding(latents.to(self.dtype))  # [B, dim, F, h', w']
        embedded = embedded + self.adapter.block_features(keys, frames, grid).to(embedded.dtype)
        hidden = embedded.flatten(2).transpose(1, 2)
        prefix_proj = None
        if refs is None or ref_rope is None:
            temb, timestep_proj, context, _ = tr.condition_embedder(timesteps, text.to(self.dtype))
        else:  # the slots' modulation is timestep 0's: one more "frame" through the same embedder
            with_zero = torch.cat([torch.zeros_like(timesteps[:, :1]), timesteps], 1)
            temb, timestep_proj, context, _ = tr.condition_embedder(with_zero, text.to(self.dtype))
            prefix_proj, temb, timestep_proj = timestep_proj[:, 0], temb[:, 1:], timestep_proj[:, 1:]
            hidden = torch.cat([refs.to(hidden.dtype), hidden], dim=1)
            rope = (torch.cat([ref_rope[0], rope[0]], dim=1), torch.cat([ref_rope[1], rope[1]], dim=1))
        return self.blocks(
            hidden, temb, timestep_proj, context, kv, rope, (frames, *grid), head=head, prefix_proj=prefix_proj
        )
