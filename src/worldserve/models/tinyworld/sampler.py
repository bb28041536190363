"""The few-step sampler: rectified flow with x0 prediction, re-noising between steps.

Owns: :func:`sample_chunk` (denoise one chunk per session through the KV cache),
:func:`encode_keyframes` (the cache pass that appends each session's newest keyframe),
pixel conversions, and :func:`chunk_noise` (each session's own noise generator, so a
session's frames do not depend on which other sessions share its batch).

With ``x_t = (1 - t) x0 + t eps``, each step predicts ``x0`` at level ``t_s`` and, unless
it is the last, re-noises it to ``t_{s+1}`` with fresh noise (as in CausVid and
Self-Forcing's few-step generators). Must not know: sessions, ticks, training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from worldserve.models.tinyworld.cache import KVCache, gather
from worldserve.models.tinyworld.network import TinyWorldNet

__all__ = ["SampleTrace", "chunk_noise", "encode_keyframes", "sample_chunk", "to_pixels", "to_uint8"]


def to_pixels(frames: npt.NDArray[np.uint8]) -> Tensor:
    """``uint8 [..., H, W, 3]`` -> float ``[..., 3, H, W]`` in ``[-1, 1]``."""
    tensor = torch.from_numpy(np.ascontiguousarray(frames)).float()
    return tensor.movedim(-1, -3) / 127.5 - 1.0


def to_uint8(x: Tensor) -> npt.NDArray[np.uint8]:
    """float ``[..., 3, H, W]`` in ``[-1, 1]`` -> ``uint8 [..., H, W, 3]``."""
    scaled = ((x.detach().float().clamp(-1.0, 1.0) + 1.0) * 127.5).round()
    out: npt.NDArray[np.uint8] = scaled.movedim(-3, -1).to(torch.uint8).cpu().numpy()
    return out


def chunk_noise(generator: torch.Generator, steps: int, shape: Sequence[int]) -> Tensor:
    """One chunk's noise ``[steps, *shape]`` from a session's own generator."""
    return torch.randn((steps, *shape), generator=generator)


@dataclass(slots=True)
class SampleTrace:
    """What the sampler fed the network at each step (for the correctness oracle)."""

    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)


@torch.no_grad()
def sample_chunk(
    net: TinyWorldNet,
    caches: Sequence[KVCache],
    noise: Tensor,
    text: Tensor,
    controls: Tensor,
    keyframe: Tensor,
    trace: SampleTrace | None = None,
) -> Tensor:
    """Generate one chunk per session: x0 ``[B, F, 3, H, W]`` in ``[-1, 1]``.

    ``noise`` [steps, B, F, 3, H, W]; ``text`` [B, words]; ``controls`` [B, F, 4];
    ``keyframe`` [B, 3, H, W] (each session's last keyframe).
    """
    steps = net.config.steps
    context, valid = gather(caches)
    b = noise.shape[1]
    x = noise[0]
    x0 = x
    for index, level in enumerate(steps):
        t = torch.full((b,), level, device=noise.device)
        if index == 0 and level < 1.0:
            raise ValueError("the sampler starts from pure noise: steps[0] must be 1.0")
        x0 = net.denoise_chunk(x, t, text, controls, keyframe, context, valid)
        if trace is not None:
            trace.inputs.append(x.clone())
            trace.outputs.append(x0.clone())
        if index + 1 < len(steps):
            following = steps[index + 1]
            x = (1.0 - following) * x0 + following * noise[index + 1]
    return x0.clamp(-1.0, 1.0)


@torch.no_grad()
def encode_keyframes(
    net: TinyWorldNet,
    caches: Sequence[KVCache],
    frames: Tensor,
    text: Tensor,
    controls: Tensor,
) -> None:
    """The cache pass: each session's new keyframe ``frames`` [B, 3, H, W] attends to its cache, then joins it."""
    context, valid = gather(caches)
    sink = torch.tensor([cache.written == 0 for cache in caches], device=frames.device)
    layers = net.encode_keyframe(frames, text, controls, sink, context, valid)
    for row, cache in enumerate(caches):
        cache.write([(k[row], v[row]) for k, v in layers])
