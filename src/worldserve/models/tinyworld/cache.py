"""Per-session KV cache: an attention sink and a sliding window of keyframes, fixed size.

Owns: :class:`KVCache`. Slot 0 holds the start frame's keys and values (the attention
sink, kept forever); slots ``1 .. window`` are a ring holding the last ``window``
keyframes (the last frame of each generated chunk). Memory is fixed, so a session can run
forever; attention over the cache ignores slot order (the network has no temporal position
code across keyframes), so the ring needs no reordering. :func:`gather` stacks sessions'
caches for one batched forward. Must not know: sampling, sessions, ticks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from worldserve.models.tinyworld.config import TinyWorldConfig

__all__ = ["KVCache", "gather"]


class KVCache:
    """One session's keys and values, ``[depth, slots * tokens_per_frame, dim]`` each."""

    __slots__ = ("keys", "tokens_per_frame", "valid", "values", "window", "written")

    def __init__(self, config: TinyWorldConfig, device: torch.device | str = "cpu") -> None:
        size = config.cache_slots * config.tokens_per_frame
        self.keys = torch.zeros(config.depth, size, config.dim, device=device)
        self.values = torch.zeros(config.depth, size, config.dim, device=device)
        self.valid = torch.zeros(size, dtype=torch.bool, device=device)
        self.tokens_per_frame = config.tokens_per_frame
        self.window = config.window
        #: Keyframes written so far (the sink is keyframe 0).
        self.written = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.valid.nbytes

    def slot_of(self, keyframe: int) -> int:
        """The slot keyframe number ``keyframe`` lives in: 0 for the sink, then a ring."""
        return 0 if keyframe == 0 else 1 + (keyframe - 1) % self.window

    def write(self, layers: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Store the next keyframe's per-layer keys and values (``[P, dim]`` each)."""
        slot = self.slot_of(self.written)
        rows = slice(slot * self.tokens_per_frame, (slot + 1) * self.tokens_per_frame)
        for layer, (k, v) in enumerate(layers):
            self.keys[layer, rows] = k
            self.values[layer, rows] = v
        self.valid[rows] = True
        self.written += 1

    def clone(self) -> KVCache:
        """An independent copy (same device, same ring position)."""
        twin = KVCache.__new__(KVCache)
        twin.keys = self.keys.clone()
        twin.values = self.values.clone()
        twin.valid = self.valid.clone()
        twin.tokens_per_frame = self.tokens_per_frame
        twin.window = self.window
        twin.written = self.written
        return twin

    def clear(self) -> None:
        self.keys.zero_()
        self.values.zero_()
        self.valid.zero_()
        self.written = 0


def gather(caches: Sequence[KVCache]) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Per-layer ``(keys, values)`` ``[B, S, dim]`` and ``valid`` ``[B, S]`` of a batch of sessions."""
    keys = torch.stack([cache.keys for cache in caches], dim=1)  # [depth, B, S, dim]
    values = torch.stack([cache.values for cache in caches], dim=1)
    valid = torch.stack([cache.valid for cache in caches])
    return [(keys[layer], values[layer]) for layer in range(keys.shape[0])], valid
