"""Self-attention KV caches: a session's sink + sliding window, and a batch's view of several.

Owns: :class:`KVCache`. Per layer it holds K and V for ``block + sink + window`` latent
frames in one buffer laid out ``[scratch block | sink | window ring]``. Only
:meth:`KVCache.commit` (after the commit pass at the context noise level, once the whole step
succeeded) writes the block's K/V into the sink (until it is full) or over the oldest ring
slots. Keys already carry their rotary position, so the order of slots does not matter to
attention: the valid slots are always the buffer's prefix.

:class:`BatchKV` is one step's view of a batch's caches, so that each layer's self-attention
is ONE call for the whole batch, whatever each session's cache length: per layer and pass it
gathers the sessions' buffers into one ``[B, heads, L, head_dim]`` tensor (one stack; for a
batch of one, the buffer itself, no copy), writes the block's new K/V into its scratch slots
(one copy), and masks each row past its own valid length (no mask when all are equal, the
steady state once windows are full). The commit pass's K/V are kept for the whole batch in one
``[layers, B, heads, block tokens, head_dim]`` tensor each, from which each session's commit
copies its row (all layers at once). A cache's geometry defaults to the self-attention's; another
attention over the same frames (Matrix-Game's action modules) sizes its own. :class:`StepCaches` is
what the sampler asks of a step's caches (:class:`BatchKV`, or a model's bundle of several). A
block can also be *staged* (kept in the scratch slots, moved into the sink or window by the next
step's :class:`BatchKV`), so a step can be undone without a copy of what it overwrites. Also
:class:`BlockLog` (the clean latents a re-cache
recomputes the context from).

A cache may also hold *reference slots* (``ref_tokens``: ABot-World's reference images' tokens, which
every query attends to): laid out ``[scratch block | reference | sink | window ring]``, written once
(:meth:`KVCache.write_refs`, unrotated keys kept beside) and rotated again at the times the model's
relative RoPE puts them (:meth:`KVCache.rotate_refs`; :mod:`~worldserve.models.wan.rope`). And a
block shorter than the configured one (ABot-World's first, the start image's one latent frame)
is committed with ``frames``. Must not know: the transformer's weights, the sampler, sessions.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.rope import apply_rope

__all__ = ["BatchKV", "BlockLog", "KVCache", "StepCaches"]


class StepCaches(Protocol):
    """What a sampler needs of a step's caches: keep the next pass's K/V, and commit them."""

    def record(self) -> None: ...

    def commit(self) -> None: ...


class KVCache:
    """K/V of one session for every layer; a fixed size, set at creation."""

    __slots__ = (
        "block",
        "keys",
        "next_frame",
        "ref",
        "ref_keys",
        "ring_written",
        "sink",
        "sink_filled",
        "staged",
        "tpf",
        "values",
        "window",
    )

    def __init__(
        self,
        config: WanCausalConfig,
        device: torch.device,
        dtype: torch.dtype,
        *,
        layers: int | None = None,
        heads: int | None = None,
        head_dim: int | None = None,
        tokens_per_frame: int | None = None,
        ref_tokens: int = 0,
    ) -> None:
        """The self-attention's cache of ``config``; ``layers``/``heads``/``head_dim``/``tokens_per_frame``
        size another attention's cache on the same frames (block, sink and window are ``config``'s);
        ``ref_tokens``: reference slots' tokens every query sees (none: the Wan2.1 families)."""
        self.tpf = tokens_per_frame if tokens_per_frame is not None else config.tokens_per_frame
        self.block = config.block_frames
        self.sink = config.sink_frames
        self.window = config.window_frames
        self.ref = ref_tokens
        shape = (
            layers if layers is not None else config.num_layers,
            heads if heads is not None else config.num_heads,
            config.cache_frames * self.tpf + ref_tokens,
            head_dim if head_dim is not None else config.head_dim,
        )
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        #: The reference slots' keys before rotation (rotated again when the relative RoPE's base moves).
        self.ref_keys: Tensor | None = None
        self.sink_filled = 0
        self.ring_written = 0
        #: The absolute latent-frame index (the RoPE position) of the next block's first frame.
        self.next_frame = 0
        #: A block staged in the scratch slots (:meth:`stage`), kept at the next :meth:`flush`.
        self.staged = False

    @property
    def cached_frames(self) -> int:
        """Committed latent frames attention can see (sink + window, excluding the scratch)."""
        return self.sink_filled + min(self.ring_written, self.window)

    @property
    def nbytes(self) -> int:
        refs = 0 if self.ref_keys is None else self.ref_keys.numel() * self.ref_keys.element_size()
        return self.keys.numel() * self.keys.element_size() * 2 + refs

    def write_scratch(self, layer: int, keys: Tensor, values: Tensor) -> None:
        """The current block's K and V (``[heads, block * tpf, head_dim]``; a shorter block's fewer) for ``layer``."""
        span = keys.shape[1]
        self.keys[layer, :, :span] = keys
        self.values[layer, :, :span] = values

    @property
    def valid_tokens(self) -> int:
        """Tokens attention reads: the scratch block, the reference slots, the sink and the filled window."""
        return (self.block + self.cached_frames) * self.tpf + self.ref

    def visible(self, layer: int) -> tuple[Tensor, Tensor]:
        """K and V attention reads for ``layer``: the scratch block, the references, the sink and the filled window."""
        end = self.valid_tokens
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def write_refs(self, keys: Tensor, values: Tensor, cos: Tensor, sin: Tensor) -> None:
        """The reference slots' K (unrotated) and V, ``[layers, heads, ref_tokens, head_dim]``; the keys are
        kept rotated by ``cos``/``sin`` (``[1, ref_tokens, 1, head_dim]``, their times now)."""
        if keys.shape[2] != self.ref:
            raise ValueError(f"this cache holds {self.ref} reference tokens; got {keys.shape[2]}.")
        self.ref_keys = keys.clone()
        start = self.block * self.tpf
        self.values[:, :, start : start + self.ref] = values
        self.rotate_refs(cos, sin)

    def keep_refs(self, keys: Tensor, rotated: Tensor, values: Tensor) -> None:
        """:meth:`write_refs` with the keys' rotation already done (a first block's pass rotated them)."""
        if keys.shape[2] != self.ref:
            raise ValueError(f"this cache holds {self.ref} reference tokens; got {keys.shape[2]}.")
        self.ref_keys = keys.clone()
        start = self.block * self.tpf
        self.keys[:, :, start : start + self.ref] = rotated
        self.values[:, :, start : start + self.ref] = values

    def rotate_refs(self, cos: Tensor, sin: Tensor) -> None:
        """Rotate the reference slots' keys to new times (the relative RoPE's base moved)."""
        if self.ref_keys is None:
            raise ValueError("no reference slots written yet.")
        start = self.block * self.tpf
        rotated = apply_rope(self.ref_keys.transpose(1, 2), cos[0], sin[0]).transpose(1, 2)
        self.keys[:, :, start : start + self.ref] = rotated

    def _token(self, slot: int) -> int:
        """The first token of frame slot ``slot`` (slots after the scratch block come after the references)."""
        return slot * self.tpf + (self.ref if slot >= self.block else 0)

    def _slots(self, *, advance: bool = True, frames: int | None = None) -> list[tuple[int, int, int]]:
        """(first frame of the block, first slot, frames) runs the block's frames go to; advances the counters
        (and ``next_frame`` unless the block was staged, which advanced it then)."""
        runs: list[tuple[int, int, int]] = []
        count = self.block if frames is None else frames
        for frame in range(count):
            if self.sink_filled < self.sink:
                slot = self.block + self.sink_filled
                self.sink_filled += 1
            else:
                slot = self.block + self.sink + self.ring_written % self.window
                self.ring_written += 1
            if runs and runs[-1][1] + runs[-1][2] == slot and runs[-1][0] + runs[-1][2] == frame:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((frame, slot, 1))
        if advance:
            self.next_frame += count
        return runs

    def commit(self, keys: Tensor | None = None, values: Tensor | None = None, *, frames: int | None = None) -> None:
        """Keep the block's K/V in the sink or the window: ``keys``/``values`` ``[layers, heads, block tokens,
        head_dim]`` (a :class:`BatchKV`'s row), else the scratch slots (the per-session path); ``frames``:
        a block shorter than the configured one (its first frames)."""
        if frames is not None and not 0 < frames <= self.block:
            raise ValueError(f"a block commits 1 to {self.block} frames; got {frames}.")
        self._write(keys, values, advance=True, frames=frames)

    def stage(self, keys: Tensor | None = None, values: Tensor | None = None) -> None:
        """Keep the block's K/V (a :class:`BatchKV` row, else what the scratch holds) in the scratch slots,
        to be moved into the sink or window by the next :meth:`flush`; the block counts as done
        (``next_frame`` advances). Until then :meth:`unstage` drops it at no cost: a step can be rolled
        back without the cache holding a copy of what the block overwrites."""
        if keys is not None and values is not None:
            span = self.block * self.tpf
            self.keys[:, :, :span] = keys
            self.values[:, :, :span] = values
        self.staged = True
        self.next_frame += self.block

    def flush(self) -> None:
        """Move a staged block from the scratch slots into the sink or window (before the next block's passes)."""
        if self.staged:
            self._write(None, None, advance=False)
            self.staged = False

    def unstage(self) -> None:
        """Drop a staged block: the cache is as before it."""
        if self.staged:
            self.staged = False
            self.next_frame -= self.block

    def _write(self, keys: Tensor | None, values: Tensor | None, *, advance: bool, frames: int | None = None) -> None:
        tpf = self.tpf
        span = self.block * tpf
        new_keys = keys if keys is not None else self.keys[:, :, :span]
        new_values = values if values is not None else self.values[:, :, :span]
        for frame, slot, count in self._slots(advance=advance, frames=frames):  # a few runs, all layers at once
            source = slice(frame * tpf, (frame + count) * tpf)
            first = self._token(slot)
            target = slice(first, first + count * tpf)
            self.keys[:, :, target] = new_keys[:, :, source]
            self.values[:, :, target] = new_values[:, :, source]

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
        self.ref_keys = None


class BatchKV:
    """One step's batched view of the caches of a batch (same configuration); see the module docstring."""

    __slots__ = ("batch", "caches", "keys", "length", "lengths", "mask", "pending", "pending_refs", "span", "values")

    def __init__(self, caches: list[KVCache] | tuple[KVCache, ...]) -> None:
        self.caches = list(caches)
        for cache in self.caches:  # a block staged by the last step is kept before this one's passes
            cache.flush()
        self.batch = len(self.caches)
        first = self.caches[0]
        self.span = first.block * first.tpf
        self.lengths = [cache.valid_tokens for cache in self.caches]
        self.length = max(self.lengths)
        device = first.keys.device
        self.mask: Tensor | None = None
        if len(set(self.lengths)) > 1:  # [B, 1, 1, L]: each row's valid prefix (one small upload)
            valid = torch.tensor(self.lengths).to(device, non_blocking=True)
            self.mask = (torch.arange(self.length, device=device)[None, :] < valid[:, None])[:, None, None, :]
        # Per layer, the sessions' buffers up to the longest valid length (views, made once per step).
        layers = first.keys.shape[0]
        self.keys = [[cache.keys[layer, :, : self.length] for cache in self.caches] for layer in range(layers)]
        self.values = [[cache.values[layer, :, : self.length] for cache in self.caches] for layer in range(layers)]
        self.pending: tuple[Tensor, Tensor] | None = None
        #: The commit pass's reference-slot K (unrotated, rotated) and V, when it wrote them.
        self.pending_refs: tuple[Tensor, Tensor, Tensor] | None = None

    def record(self) -> None:
        """Keep the next pass's block K/V (the commit pass) for :meth:`commit`."""
        keys = self.caches[0].keys
        layers, heads, _, head_dim = keys.shape
        shape = (layers, self.batch, heads, self.span, head_dim)
        self.pending = (keys.new_empty(shape), keys.new_empty(shape))
        self.pending_refs = None

    def attend(
        self, layer: int, keys: Tensor, values: Tensor, *, refs: tuple[Tensor, Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """K, V ``[B, heads, L, head_dim]`` and the mask for ``layer``, the block's new ``keys``/``values``
        (``[B, heads, block tokens, head_dim]``) in the scratch slots; ``refs`` (rotated K, V, unrotated
        K, ``[B, heads, ref tokens, head_dim]``): the reference slots' too (a session's first block),
        kept by the commit pass."""
        if self.pending is not None:
            self.pending[0][layer] = keys
            self.pending[1][layer] = values
        if self.batch == 1:  # the session's own buffer: no copy
            all_keys, all_values = self.keys[layer][0][None], self.values[layer][0][None]
        else:
            all_keys, all_values = torch.stack(self.keys[layer]), torch.stack(self.values[layer])
        all_keys[:, :, : self.span] = keys
        all_values[:, :, : self.span] = values
        if refs is not None:
            rotated, ref_values, unrotated = refs
            end = self.span + rotated.shape[2]
            if any(cache.ref != rotated.shape[2] for cache in self.caches):
                raise ValueError(f"{rotated.shape[2]} reference tokens for caches holding {self.caches[0].ref}.")
            all_keys[:, :, self.span : end] = rotated
            all_values[:, :, self.span : end] = ref_values
            if self.pending is not None:
                if self.pending_refs is None:
                    layers = len(self.keys)
                    shape = (layers, *rotated.shape)
                    self.pending_refs = (rotated.new_empty(shape), rotated.new_empty(shape), rotated.new_empty(shape))
                self.pending_refs[0][layer] = unrotated
                self.pending_refs[1][layer] = rotated
                self.pending_refs[2][layer] = ref_values
        return all_keys, all_values, self.mask

    def commit(self) -> None:
        """Every cache keeps its row of the recorded commit pass (call once the step succeeded)."""
        assert self.pending is not None, "record() the commit pass first"
        keys, values = self.pending
        for row, cache in enumerate(self.caches):
            cache.commit(keys[:, row], values[:, row])
        self._keep_refs()

    def _keep_refs(self) -> None:
        """The reference slots a first block's commit pass wrote, kept by every cache."""
        if self.pending_refs is not None:
            unrotated, rotated, values = self.pending_refs
            for row, cache in enumerate(self.caches):
                cache.keep_refs(unrotated[:, row], rotated[:, row], values[:, row])

    def stage(self) -> None:
        """Every cache stages its row of the recorded commit pass (:meth:`KVCache.stage`)."""
        assert self.pending is not None, "record() the commit pass first"
        keys, values = self.pending
        for row, cache in enumerate(self.caches):
            cache.stage(keys[:, row], values[:, row])
        self._keep_refs()  # read only after the first block: a first block undone and made again rewrites them


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
