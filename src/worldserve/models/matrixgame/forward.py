"""Matrix-Game 2.0's cached, block-causal forward over several sessions at different positions.

Owns: :class:`MatrixConditions` (what a block is conditioned on besides its latents: the start
image's latents and mask for its frames, each latent frame's windows of keyboard and mouse
actions, each row's first frame), :class:`MatrixCaches` (a session's caches: the
self-attention's and, per action block, the keyboard's and the mouse's, all on the same frames:
no sink, a window of the most recent committed frames), :class:`MatrixBatchKV` (one step's
batched view of them, recording and committing the commit pass's K/V of all three) and
:class:`MatrixGameForward`. The forward embeds (the 36-channel patch embedding of latents + mask
+ image latents, per-frame timesteps, the CLIP features through the image embedder) and then runs
the SAME blocks and head as ``wan-causal`` (:class:`~worldserve.models.wan.blocks.BlockRunner`:
one self-attention call per layer per pass over the batch's caches, RoPE at each row's own
frames), with each block's action module run between its cross-attention and its FFN, itself one
call per attention per layer for the whole batch. It is a
:class:`~worldserve.models.wan.sampler.BlockForward`, so the shared sampler and commit pass
drive it. Must not know: the sampler's schedule, the VAE, sessions' control plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from worldserve.models.matrixgame.action import ActionRope
from worldserve.models.matrixgame.config import MatrixGameConfig
from worldserve.models.matrixgame.transformer import MatrixGameTransformer
from worldserve.models.wan.blocks import BlockRunner
from worldserve.models.wan.cache import BatchKV, KVCache

__all__ = ["MatrixBatchKV", "MatrixCaches", "MatrixConditions", "MatrixGameForward"]


@dataclass(frozen=True, slots=True)
class MatrixConditions:
    """One block's conditions for every row of a batch."""

    #: ``[B, mask + C, F, h, w]``: the first-frame mask and the start image's latents at the block's frames.
    image_latents: Tensor
    #: ``[B, F, 12, keyboard_dim]``: each latent frame's window of video-frame keyboard actions.
    keyboard: Tensor
    #: ``[B, F, 12, 2]`` (pitch, yaw) windows, or None for a variant without a mouse.
    mouse: Tensor | None
    #: Each row's first latent frame (the action attentions' RoPE positions).
    offsets: tuple[int, ...]


class MatrixCaches:
    """One session's K/V: the self-attention's, the keyboard's and (with a mouse) the mouse's."""

    __slots__ = ("attention", "keyboard", "mouse")

    def __init__(self, config: MatrixGameConfig, device: torch.device, dtype: torch.dtype) -> None:
        action = config.action
        layers = len(action.layers)
        self.attention = KVCache(config.wan, device, dtype)
        self.keyboard = KVCache(
            config.wan, device, dtype, layers=layers, heads=action.heads, head_dim=action.head_dim, tokens_per_frame=1
        )
        self.mouse: KVCache | None = (
            KVCache(config.wan, device, dtype, layers=layers, heads=action.heads, head_dim=action.head_dim)
            if action.mouse
            else None
        )

    @property
    def next_frame(self) -> int:
        return self.attention.next_frame

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.parts())

    def parts(self) -> list[KVCache]:
        return [self.attention, self.keyboard] + ([self.mouse] if self.mouse is not None else [])

    def clone(self) -> MatrixCaches:
        twin = MatrixCaches.__new__(MatrixCaches)
        twin.attention = self.attention.clone()
        twin.keyboard = self.keyboard.clone()
        twin.mouse = self.mouse.clone() if self.mouse is not None else None
        return twin

    def flush(self) -> None:
        """Keep a staged block (see :meth:`KVCache.stage`)."""
        for cache in self.parts():
            cache.flush()

    def unstage(self) -> None:
        """Drop a staged block: the caches are as before the step that staged it."""
        for cache in self.parts():
            cache.unstage()

    @property
    def staged(self) -> bool:
        return self.attention.staged

    def clear(self) -> None:
        for cache in self.parts():
            cache.clear()


class MatrixBatchKV:
    """One step's batched view of a batch's :class:`MatrixCaches` (a ``StepCaches``).

    Making it keeps any block the caches have staged; :meth:`commit` *stages* the commit pass's K/V
    of all three caches (kept by the next step's view; a rollback drops them at no cost).
    """

    __slots__ = ("attention", "keyboard", "mouse")

    def __init__(self, caches: Sequence[MatrixCaches]) -> None:
        self.attention = BatchKV([c.attention for c in caches])
        self.keyboard = BatchKV([c.keyboard for c in caches])
        mice = [c.mouse for c in caches]
        self.mouse = BatchKV([m for m in mice if m is not None]) if all(m is not None for m in mice) else None

    def record(self) -> None:
        for kv in self._all():
            kv.record()

    def commit(self) -> None:
        for kv in self._all():
            kv.stage()

    def _all(self) -> list[BatchKV]:
        return [self.attention, self.keyboard] + ([self.mouse] if self.mouse is not None else [])


class MatrixGameForward:
    """The cached forward of :class:`MatrixGameTransformer` over a batch (see the module docstring)."""

    def __init__(
        self,
        transformer: MatrixGameTransformer,
        config: MatrixGameConfig,
        *,
        attention: str = "batched",
        compile: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        self.transformer = transformer
        self.config = config
        self.blocks = BlockRunner(
            transformer, config.wan, attention=attention, compile=compile, compile_backend=compile_backend
        )
        self.rope = ActionRope(config.action, transformer.scale_shift_table.device)
        self.modules = dict(
            (index, (slot, module)) for slot, (index, module) in enumerate(transformer.action_modules())
        )

    @property
    def dtype(self) -> torch.dtype:
        weight: Tensor = self.transformer.patch_embedding.weight
        return weight.dtype

    def __call__(
        self,
        latents: Tensor,
        timesteps: Tensor,
        text: Tensor,
        actions: MatrixConditions,
        caches: MatrixBatchKV,
        rope: tuple[Tensor, Tensor],
        *,
        head: bool = True,
    ) -> Tensor | None:
        """Flow prediction for ``latents`` ``[B, C, F, h, w]`` at ``timesteps`` ``[B, F]``; ``text`` is
        the start image's CLIP features ``[B, tokens, image_dim]`` (what the cross-attention reads),
        ``actions`` the block's :class:`MatrixConditions`, ``rope`` the self-attention's tables."""
        tr = self.transformer
        wan = self.config.wan
        _, _, frames, height, width = latents.shape
        _, p_h, p_w = wan.patch
        x = torch.cat([latents.to(self.dtype), actions.image_latents.to(self.dtype)], dim=1)
        hidden = tr.patch_embedding(x).flatten(2).transpose(1, 2)
        temb, timestep_proj, context = tr.condition_embedder(timesteps, text, self.dtype)
        grid = (frames, height // p_h, width // p_w)
        action_rope = self.rope(actions.offsets, frames)
        tokens = grid[1] * grid[2]

        def inject(layer: int, hidden: Tensor) -> Tensor:
            found = self.modules.get(layer)
            if found is None:
                return hidden
            slot, module = found
            out: Any = module(
                hidden,
                (frames, tokens),
                actions.keyboard,
                actions.mouse,
                action_rope,
                caches.keyboard,
                caches.mouse,
                slot,
            )
            result: Tensor = out
            return result

        return self.blocks(hidden, temb, timestep_proj, context, caches.attention, rope, grid, head=head, inject=inject)
