"""Gaussian noise for a whole batch in one set of device ops, each row from its own session's counter.

Owns: :func:`batch_noise` and :class:`SessionNoise` (a step's ``noise()``: each call the next
draw for every row, counted so the caller can advance its sessions' counters once the step
commits). Every element is a pure function of (the session's seed, the
session's draw counter, the element's index): a counter-based generator (a 32-bit integer hash,
Chris Wellons' ``lowbias32``, in int64 tensor arithmetic so it runs the same on every device),
two hashed uniforms per element turned into a standard normal by Box-Muller. So a session's
noise does not depend on the batch it is drawn in, the batch is drawn with no per-session
launch and no host sync (the seeds and counters go up as one small tensor), and a step that
fails leaves nothing to restore: the counter a session keeps advances only when its step
commits. Must not know: the model, caches, sessions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["SessionNoise", "batch_noise"]

_MASK = 0xFFFFFFFF


def _mul32(x: Tensor, constant: int) -> Tensor:
    """``x * constant mod 2**32`` for ``x`` in [0, 2**32) without leaving int64 (16-bit halves)."""
    high, low = constant >> 16, constant & 0xFFFF
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK


def _hash(x: Tensor) -> Tensor:
    """lowbias32: a 32-bit integer hash with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def batch_noise(seeds: Tensor, draws: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Standard normal ``[B, *shape]`` (float32): row b from ``seeds[b]`` (< 2**32) and draw counter ``draws[b]``."""
    count = math.prod(shape)
    device = seeds.device
    key = _hash(_hash(seeds.long() & _MASK) ^ (draws.long() & _MASK))  # [B]
    key = _hash(key ^ ((draws.long() >> 32) & _MASK))
    index = torch.arange(count, device=device, dtype=torch.int64)
    first = _hash(_hash((key[:, None] + 2 * index[None, :]) & _MASK))
    second = _hash(_hash((key[:, None] + 2 * index[None, :] + 1) & _MASK))
    # 24 bits of each, centred: uniforms in (0, 1), never 0, so the log is finite.
    u1 = ((first >> 8).float() + 0.5) / 16777216.0
    u2 = ((second >> 8).float() + 0.5) / 16777216.0
    normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return normal.view(-1, *shape)


class SessionNoise:
    """A step's noise for a batch: each call draws ``[B, *shape]``, row b from ``(seed, draws + calls so far)``.

    ``counters`` are the rows' ``(seed, draws so far)``; they go to ``device`` as one small tensor.
    :attr:`drawn` counts the calls: what each row's counter advances by when the step commits.
    """

    def __init__(self, counters: Sequence[tuple[int, int]], shape: tuple[int, ...], device: torch.device) -> None:
        self.counters = torch.tensor([list(pair) for pair in counters]).to(device, non_blocking=True)
        self.shape = shape
        self.drawn = 0

    def __call__(self) -> Tensor:
        self.drawn += 1
        return batch_noise(self.counters[:, 0], self.counters[:, 1] + (self.drawn - 1), self.shape)
