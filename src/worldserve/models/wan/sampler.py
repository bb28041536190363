"""The few-step sampler on a family's schedule, and the commit pass.

Owns: :func:`sample_block` (flow matching on the configuration's schedule of (timestep,
sigma) pairs: start from noise; at each step predict the flow ``v`` at that timestep, take
``x0 = x - sigma * v``, and move to the next sigma: the distilled families' ``renoise`` rule
re-noises ``x0`` with fresh noise, ``(1 - s') x0 + s' n``, as Self-Forcing/CausVid/LongLive/
Krea do; ``euler`` takes the ODE step ``x + (s' - s) v``; return the last ``x0``), :func:`commit_block`
(one more pass over the clean block at the context timestep, whose K/V the caches keep) and
:func:`recache_context` (a prompt switch's re-cache). The noise comes from the caller
(``noise()``: :func:`~worldserve.models.wan.noise.batch_noise` in the model). Must not
know: attention, the VAE, sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from worldserve.models.wan.cache import BatchKV, BlockLog, KVCache, StepCaches
from worldserve.models.wan.config import WanCausalConfig

__all__ = ["BlockForward", "StepRecord", "commit_block", "recache_context", "sample_block"]

#: What a forward is conditioned on besides the latents and timesteps: wan-causal's per-frame action
#: features, or another model's own conditions (Matrix-Game's start image and keyboard/mouse windows).
Conditions = TypeVar("Conditions", contravariant=True)


class BlockForward(Protocol[Conditions]):
    """A block-causal forward over a batch against its caches (``CachedForward``, or another model's)."""

    def __call__(
        self,
        latents: Tensor,
        timesteps: Tensor,
        text: Tensor,
        actions: Conditions,
        caches: Any,
        rope: tuple[Tensor, Tensor],
        *,
        head: bool = True,
    ) -> Tensor | None: ...


C = TypeVar("C")


#: (noisy input, timesteps, predicted flow) of one denoising step, for tests and tools.
StepRecord = tuple[Tensor, Tensor, Tensor]


def _batch(caches: Sequence[KVCache] | StepCaches) -> StepCaches:
    """A sequence of caches as one :class:`BatchKV`; a step's caches (a ``BatchKV`` or a model's bundle,
    which its forward takes: ``caches`` in :class:`BlockForward`) as they are."""
    if isinstance(caches, Sequence):
        return BatchKV(list(caches))
    return caches


def sample_block(
    forward: BlockForward[C],
    caches: Sequence[KVCache] | StepCaches,
    noise: Callable[[], Tensor],
    text: Tensor,
    actions: C,
    rope: tuple[Tensor, Tensor],
    config: WanCausalConfig,
    record: list[StepRecord] | None = None,
    held: Tensor | None = None,
) -> Tensor:
    """Denoise one block for every row; ``noise()`` gives a fresh ``[B, C, F, h, w]`` draw.

    ``held`` (``[B, C, k, h, w]``): the block's first ``k`` latent frames are these, clean, at timestep 0
    in every pass and in the result (ABot-World's start image in a session's first block).
    """
    kv = _batch(caches)
    schedule = config.schedule()
    x = _hold(noise(), held)
    batch, frames = x.shape[0], x.shape[2]
    x0 = x
    for index, (timestep, sigma) in enumerate(schedule):
        timesteps = torch.full((batch, frames), timestep, device=x.device)
        if held is not None:
            timesteps[:, : held.shape[2]] = 0
        flow = forward(x, timesteps, text, actions, kv, rope)
        assert flow is not None
        if record is not None:
            record.append((x, timesteps, flow))
        velocity = flow.float()
        x0 = _hold(x - sigma * velocity, held)
        if index + 1 < len(schedule):
            following = schedule[index + 1][1]
            if config.sampler == "euler":
                x = _hold(x + (following - sigma) * velocity, held)
            else:
                x = _hold((1.0 - following) * x0 + following * noise(), held)
    return x0


def _hold(x: Tensor, held: Tensor | None) -> Tensor:
    """``x`` with its first frames replaced by ``held`` (None: as it is)."""
    if held is None:
        return x
    return torch.cat([held.to(x.dtype), x[:, :, held.shape[2] :]], dim=2)


def commit_block(
    forward: BlockForward[C],
    caches: Sequence[KVCache] | StepCaches,
    clean: Tensor,
    text: Tensor,
    actions: C,
    rope: tuple[Tensor, Tensor],
    config: WanCausalConfig,
    *,
    keep: bool = True,
    held_frames: int = 0,
) -> None:
    """Run the clean block at the context timestep and keep its K/V in each cache.

    With ``keep=False`` the K/V wait in the :class:`BatchKV` until the caller's ``kv.commit()``
    (so a failure after this pass can leave the caches unchanged); pass the step's ``BatchKV``.
    ``held_frames``: the first frames were held (:func:`sample_block`'s ``held``): at timestep 0 here too.
    """
    kv = _batch(caches)
    kv.record()
    timesteps = torch.full((clean.shape[0], clean.shape[2]), config.context_timestep, device=clean.device)
    timesteps[:, :held_frames] = 0
    forward(clean, timesteps, text, actions, kv, rope, head=False)
    if keep:
        kv.commit()


def recache_context(
    forward: BlockForward[Tensor],
    cache: KVCache,
    log: BlockLog,
    text: Tensor,
    rope: Callable[[Sequence[int], int], tuple[Tensor, Tensor]],
    config: WanCausalConfig,
    *,
    keep_sink: bool,
) -> KVCache:
    """A copy of ``cache`` whose context was recomputed under ``text`` (LongLive's KV re-cache).

    Every logged block (oldest first; with ``keep_sink`` those wholly inside the sink are left as
    they are) runs the commit pass again at its own position and with its own actions, seeing the
    sink and the blocks before it, exactly as when it was first committed; the window then holds
    the same frames as before. ``cache`` itself is untouched (a failed step keeps it).
    """
    fresh = cache.clone()
    fresh.restart(keep_sink=keep_sink)
    next_frame = cache.next_frame
    block = config.block_frames
    for index in sorted(log.blocks):
        first = index * block
        if keep_sink and first + block <= cache.sink:
            continue
        latents, actions = log.blocks[index]
        commit_block(forward, [fresh], latents, text, actions, rope([first], block), config)
    fresh.next_frame = next_frame
    return fresh
