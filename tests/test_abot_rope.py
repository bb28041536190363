"""ABot-World's relative RoPE over a stream of blocks: worldserve's absolute positions and re-rotated
reference slots against a re-typed reference of the path its inference runs.

The reference is ``tests/abot_reference.py``'s re-typing of ``amap-cvlab/ABot-World``'s
``CausalWanSelfAttention.forward`` KV-cache branch with ``use_relative_rope`` and ``REL_ROPE_CACHE``
on, no sink frames (:class:`~abot_reference.RelativeAttention`). One attention layer, random Q/K/V per
frame, float64 on both sides.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from abot_reference import RelativeAttention, attend  # noqa: E402
from worldserve.models.wan.cache import KVCache  # noqa: E402
from worldserve.models.wan.config import WanCausalConfig  # noqa: E402
from worldserve.models.wan.rope import FrameRope, RelativeWindow, apply_rope, slot_times  # noqa: E402

HEADS, HEAD_DIM = 2, 12
GRID = (2, 3)  # a latent frame's patches
TPF = GRID[0] * GRID[1]
REF_GRID = (1, 2, 2)  # a reference slot's (t, h, w) patches
SLOTS = 5
TPS = REF_GRID[1] * REF_GRID[2]
LOCAL = 6  # local_attn_size: latent frames a query sees, its block's included
LIMIT = 20  # REL_ROPE_REBASE_MAX_POS, small so that the stream rebases several times
BLOCK = 3


# -- the reference (tests/abot_reference.py) ---------------------------------------------------


def _Reference() -> RelativeAttention:
    return RelativeAttention(head_dim=HEAD_DIM, grid=GRID, slots=SLOTS, ref_grid=REF_GRID, local=LOCAL, limit=LIMIT)


# -- worldserve's side -------------------------------------------------------------------------


def _config():
    return WanCausalConfig(
        name="rope-test",
        num_layers=1,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        ffn_dim=8,
        text_dim=8,
        freq_dim=8,
        latent_channels=4,
        height=GRID[0] * 16,
        width=GRID[1] * 16,
        block_frames=BLOCK,
        sink_frames=0,
        window_frames=LOCAL - BLOCK,
    )


class _Ours:
    def __init__(self, *, follow_base=True):
        self.config = _config()
        self.rope = FrameRope(self.config, torch.device("cpu"))
        self.window = RelativeWindow(LOCAL, limit=LIMIT)
        self.cache = KVCache(self.config, torch.device("cpu"), torch.float64, ref_tokens=SLOTS * TPS)
        self.base = 0
        self.follow_base = follow_base

    def _slots(self):
        return self.rope.slots(slot_times(self.base, SLOTS, TPS), REF_GRID[1:])

    def block(self, start, q, k, v, refs=None):
        nvf = q.shape[1] // TPF
        cos, sin = self.rope([start], nvf)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if refs is not None:  # the first block: the references are queries too, and written once
            ref_cos, ref_sin = self._slots()
            ref_q, ref_k = apply_rope(refs[0], ref_cos, ref_sin), apply_rope(refs[1], ref_cos, ref_sin)
            self.cache.write_refs(refs[1].permute(0, 2, 1, 3), refs[2].permute(0, 2, 1, 3), ref_cos, ref_sin)
            out = attend(torch.cat([ref_q, q], 1), torch.cat([ref_k, k], 1), torch.cat([refs[2], v], 1))
            self.cache.write_scratch(0, k[0].transpose(0, 1), v[0].transpose(0, 1))
            self.cache.commit(frames=nvf)
            return out
        base = self.window.base_for(self.base, start, nvf)
        if base != self.base and self.follow_base:
            self.base = base
            self.cache.rotate_refs(*self._slots())
        self.cache.write_scratch(0, k[0].transpose(0, 1), v[0].transpose(0, 1))
        keys, values = self.cache.visible(0)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys[None], values[None]).transpose(1, 2)
        self.cache.commit()
        return out


def _stream(blocks, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(tokens):
        return torch.randn(1, tokens, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)

    out = [(0, rand(TPF), rand(TPF), rand(TPF), (rand(SLOTS * TPS), rand(SLOTS * TPS), rand(SLOTS * TPS)))]
    for index in range(blocks):
        tokens = BLOCK * TPF
        out.append((1 + index * BLOCK, rand(tokens), rand(tokens), rand(tokens), None))
    return out


def test_the_window_rebases_where_the_reference_does():
    window = RelativeWindow(21)  # the shipped local_attn_size and limit
    base, bases = 0, []
    for start in range(1, 1 + 3 * 200, 3):
        base = window.base_for(base, start, 3)
        bases.append(base)
    # Positions stay within 256 of the base; each rebase moves it to the oldest visible frame.
    assert all(start - b + 3 <= 256 for start, b in zip(range(1, 601, 3), bases, strict=True))
    starts, befores = range(1, 601, 3), [0, *bases[:-1]]
    moves = [(start, b) for start, b, before in zip(starts, bases, befores, strict=True) if b != before]
    assert moves
    assert all(b == start + 3 - 21 for start, b in moves)
    assert slot_times(0, 5, 1280) == [-6400, -5120, -3840, -2560, -1280]
    assert slot_times(7, 2, 100) == [7 - 512, 7 - 256]


def test_absolute_positions_and_rotated_slots_equal_the_references_relative_path():
    reference, ours, stale = _Reference(), _Ours(), _Ours(follow_base=False)
    rebases, stale_differs = 0, False
    for start, q, k, v, refs in _stream(blocks=24):
        base_before = reference.base
        want = reference.block(start, q, k, v, refs)
        got = ours.block(start, q, k, v, refs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the tables are float32 (diffusers)
        assert ours.base == reference.base
        rebases += reference.base != base_before
        if not torch.allclose(stale.block(start, q, k, v, refs), want, rtol=1e-3, atol=1e-3):
            stale_differs = True
    assert rebases >= 3  # the stream crossed the limit several times
    # Slots left at their first times see the window from ever farther: the test can tell.
    assert stale_differs
    assert ours.cache.cached_frames == LOCAL - BLOCK  # the window, full; evicted frames are gone
    assert math.isclose(ours.cache.next_frame, 1 + 24 * BLOCK)


def test_a_cache_without_references_is_laid_out_as_before():
    config = _config()
    plain = KVCache(config, torch.device("cpu"), torch.float32)
    refs = KVCache(config, torch.device("cpu"), torch.float32, ref_tokens=7)
    assert plain.keys.shape[2] + 7 == refs.keys.shape[2]
    for cache in (plain, refs):
        cache.write_scratch(0, torch.ones(HEADS, BLOCK * TPF, HEAD_DIM), torch.ones(HEADS, BLOCK * TPF, HEAD_DIM))
        cache.commit()
    assert plain.valid_tokens == 2 * BLOCK * TPF
    assert refs.valid_tokens == 2 * BLOCK * TPF + 7
    assert torch.equal(refs.keys[0, :, BLOCK * TPF + 7 : 2 * BLOCK * TPF + 7], plain.keys[0, :, BLOCK * TPF :])
    with pytest.raises(ValueError, match="no reference slots"):
        refs.rotate_refs(torch.ones(1, 7, 1, HEAD_DIM), torch.zeros(1, 7, 1, HEAD_DIM))
    with pytest.raises(ValueError, match="1 to 3 frames"):
        plain.commit(frames=4)
