"""A session's self-attention KV cache: attention sink + sliding window of latent frames.

Owns: :class:`KVCache`. Per layer it holds K and V for ``block + sink + window`` latent
frames in one buffer laid out ``[scratch block | sink | window ring]``: the block being
denoised writes its K/V to the scratch slots on every pass, and only :meth:`KVCache.commit`
(called after the commit pass at the context noise level) copies them into the sink (until
it is full) or over the oldest ring slots. Keys already carry their rotary position, so the
order of slots does not matter to attention: the valid slots are always the buffer's prefix
and attention reads them as one view, without a copy or a mask. Must not know: the
transformer's weights, the sampler, sessions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worldserve.models.wancausal.config import WanCausalConfig

__all__ = ["BlockLog", "KVCache"]


class KVCache:
    """K/V of one session for every layer; a fixed size, set at creation."""

    __slots__ = ("block", "keys", "next_frame", "ring_written", "sink", "sink_filled", "tpf", "values", "window")

    def __init__(self, config: WanCausalConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.tpf = config.tokens_per_frame
        self.block = config.block_frames
        self.sink = config.sink_frames
        self.window = config.window_frames
        shape = (config.num_layers, config.num_heads, config.cache_frames * self.tpf, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.sink_filled = 0
        self.ring_written = 0
        #: The absolute latent-frame index (the RoPE position) of the next block's first frame.
        self.next_frame = 0

    @property
    def cached_frames(self) -> int:
        """Committed latent frames attention can see (sink + window, excluding the scratch)."""
        return self.sink_filled + min(self.ring_written, self.window)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def write_scratch(self, layer: int, keys: Tensor, values: Tensor) -> None:
        """The current block's K and V (``[heads, block * tpf, head_dim]``) for ``layer``."""
        span = self.block * self.tpf
        self.keys[layer, :, :span] = keys
        self.values[layer, :, :span] = values

    def visible(self, layer: int) -> tuple[Tensor, Tensor]:
        """K and V attention reads for ``layer``: the scratch block, the sink and the filled window."""
        end = (self.block + self.cached_frames) * self.tpf
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def commit(self) -> None:
        """Keep the scratch block (just written by the commit pass) in the sink or the window."""
        tpf = self.tpf
        for frame in range(self.block):
            source = slice(frame * tpf, (frame + 1) * tpf)
            if self.sink_filled < self.sink:
                slot = self.block + self.sink_filled
                self.sink_filled += 1
            else:
                slot = self.block + self.sink + self.ring_written % self.window
                self.ring_written += 1
            target = slice(slot * tpf, (slot + 1) * tpf)
            self.keys[:, :, target] = self.keys[:, :, source]
            self.values[:, :, target] = self.values[:, :, source]
        self.next_frame += self.block

    def restart(self, *, keep_sink: bool) -> None:
        """Forget the window (and the sink unless ``keep_sink``) before the context is written again."""
        if not keep_sink:
            self.sink_filled = 0
        self.ring_written = 0

    def live_frames(self) -> tuple[range, range]:
        """Absolute indices of the committed frames attention still sees: the sink's and the window's."""
        window = min(self.ring_written, self.window)
        return range(self.sink_filled), range(self.next_frame - window, self.next_frame)

    def clone(self) -> KVCache:
        twin = KVCache.__new__(KVCache)
        for name in KVCache.__slots__:
            value = getattr(self, name)
            setattr(twin, name, value.clone() if isinstance(value, Tensor) else value)
        return twin

    def clear(self) -> None:
        """Drop the buffers (a released session's memory goes back at once)."""
        self.keys = self.keys.new_zeros(0)
        self.values = self.values.new_zeros(0)


class BlockLog:
    """The clean latents and action features of every block with a frame still in a session's cache.

    What a re-cache recomputes the context from; a few hundred KiB per block at 832x480, next
    to the 274 MiB of K/V per latent frame.
    """

    __slots__ = ("block", "blocks")

    def __init__(self, block_frames: int) -> None:
        self.block = block_frames
        #: block index (its first frame // block_frames) -> (latents [1, C, F, h, w], actions [1, F, A])
        self.blocks: dict[int, tuple[Tensor, Tensor]] = {}

    def add(self, first_frame: int, latents: Tensor, actions: Tensor) -> None:
        self.blocks[first_frame // self.block] = (latents, actions)

    def trim(self, cache: KVCache) -> None:
        """Drop the blocks none of whose frames the cache still holds."""
        live = {frame // self.block for part in cache.live_frames() for frame in part}
        for index in [i for i in self.blocks if i not in live]:
            del self.blocks[index]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.blocks.values() for t in pair)

    @staticmethod
    def max_blocks(config: WanCausalConfig) -> int:
        """Blocks with a frame in the cache at most: the sink's, the window's, one it straddles."""
        block = config.block_frames
        return (
            -(-config.sink_frames // block)
            + -(-config.window_frames // block)
            + (1 if config.window_frames % block else 0)
        )

    def clone(self) -> BlockLog:
        twin = BlockLog(self.block)
        twin.blocks = dict(self.blocks)
        return twin
