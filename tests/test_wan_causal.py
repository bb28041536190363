"""The ``wan-causal`` model family against diffusers' own code (tiny config, CPU, float32).

The reference is the library's dense block-causal forward (``SkyReelsV2Transformer3DModel``
with ``num_frame_per_block`` and per-frame timesteps) and its one-shot VAE decode; the
cached, batched, streaming path must equal them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from torch import Tensor  # noqa: E402

from worldserve.models.wancausal.build import ActionEmbedding, build_transformer  # noqa: E402
from worldserve.models.wancausal.cache import KVCache  # noqa: E402
from worldserve.models.wancausal.config import CONFIGS, WanCausalConfig, get_config  # noqa: E402
from worldserve.models.wancausal.forward import CachedForward  # noqa: E402
from worldserve.models.wancausal.rope import FrameRope  # noqa: E402
from worldserve.models.wancausal.sampler import StepRecord, commit_block, draw_noise, sample_block  # noqa: E402

CPU = torch.device("cpu")
TOL = 1e-5


def network(config: WanCausalConfig, seed: int = 0) -> CachedForward:
    torch.manual_seed(seed)
    transformer = build_transformer(config).eval()
    actions = ActionEmbedding(config.action_dim, config.dim).eval()
    return CachedForward(transformer, actions, config)


@contextmanager
def actions_in_reference(forward: CachedForward, per_frame: Tensor) -> Iterator[None]:
    """Add the action embedding to the library's timestep projection (a public forward hook)."""

    def hook(module: object, inputs: object, output: Tensor) -> Tensor:
        return output + forward.actions(per_frame)

    handle = forward.transformer.condition_embedder.time_proj.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def block_shape(config: WanCausalConfig) -> tuple[int, int, int, int]:
    return (config.latent_channels, config.block_frames, config.latent_height, config.latent_width)


def test_1_3b_config_is_wan_2_1_t2v_1_3b() -> None:
    config = CONFIGS["1.3b"]
    assert (config.num_layers, config.num_heads, config.head_dim, config.ffn_dim) == (30, 12, 128, 8960)
    assert (config.width, config.height, config.tokens_per_frame) == (832, 480, 1560)
    assert (config.video_frames_per_block, config.fps, len(config.denoising_steps)) == (12, 16.0, 4)
    assert [round(s * 1000, 3) for s in config.sigmas()] == [1000.0, 937.5, 833.333, 625.0]


@torch.no_grad()
def test_cached_generation_equals_the_library_dense_block_causal_forward_at_every_step() -> None:
    config = get_config("tiny").with_window(30)  # the window holds everything: dense reference
    forward = network(config)
    rope = FrameRope(config, CPU)
    cache = KVCache(config, CPU, torch.float32)
    text = torch.randn(1, config.text_len, config.text_dim)
    shape = block_shape(config)
    generator = torch.Generator().manual_seed(1)
    block = config.block_frames
    prime = torch.randn(1, *shape)
    committed = [prime]
    actions = [torch.zeros(1, block, config.action_dim)]
    commit_block(forward, [cache], prime, text, actions[0], rope([0], block), config)
    steps: list[tuple[int, StepRecord]] = []
    for index in range(3):
        act = torch.randn(1, block, config.action_dim)  # keys/camera differ per block
        record: list[StepRecord] = []
        noise = lambda: draw_noise([generator], shape, CPU)  # noqa: E731
        x0 = sample_block(forward, [cache], noise, text, act, rope([cache.next_frame], block), config, record)
        commit_block(forward, [cache], x0, text, act, rope([cache.next_frame], block), config)
        steps += [(index + 1, r) for r in record]
        committed.append(x0)
        actions.append(act)
    assert len(steps) == 3 * len(config.denoising_steps)
    for blocks_before, (x, timesteps, flow) in steps:
        dense = torch.cat([*committed[:blocks_before], x], dim=2)
        frames = dense.shape[2]
        dense_t = torch.cat([torch.full((1, frames - block), config.context_timestep), timesteps], dim=1)
        per_frame = torch.cat(actions[: blocks_before + 1], dim=1)
        with actions_in_reference(forward, per_frame):
            reference = forward.transformer(dense, dense_t, text, enable_diffusion_forcing=True, return_dict=False)[0]
        assert (reference[:, :, -block:] - flow).abs().max().item() <= TOL


class Rollout:
    """One session driven by hand: its cache, generator, prompt and a log of committed blocks."""

    def __init__(self, config: WanCausalConfig, seed: int) -> None:
        self.cache = KVCache(config, CPU, torch.float32)
        self.generator = torch.Generator().manual_seed(seed)
        self.text = torch.randn(1, config.text_len, config.text_dim, generator=torch.Generator().manual_seed(seed))
        self.committed: list[Tensor] = []

    def clone(self) -> Rollout:
        twin = Rollout.__new__(Rollout)
        twin.cache = self.cache.clone()
        twin.generator = torch.Generator().manual_seed(0)
        twin.generator.set_state(self.generator.get_state())
        twin.text = self.text
        twin.committed = list(self.committed)
        return twin


def advance(forward: CachedForward, sessions: list[Rollout], rope: FrameRope, actions: Tensor) -> Tensor:
    """One AR block for every session in ONE batched forward; returns the clean block ``[B, ...]``."""
    config = forward.config
    caches = [s.cache for s in sessions]
    text = torch.cat([s.text for s in sessions])
    shape = block_shape(config)
    offsets = [c.next_frame for c in caches]
    frames = config.block_frames
    x0 = sample_block(
        forward,
        caches,
        lambda: draw_noise([s.generator for s in sessions], shape, CPU),
        text,
        actions,
        rope(offsets, frames),
        config,
    )
    commit_block(forward, caches, x0, text, actions, rope(offsets, frames), config)
    for row, session in enumerate(sessions):
        session.committed.append(x0[row : row + 1])
    return x0


def primed(forward: CachedForward, seed: int, rope: FrameRope) -> Rollout:
    config = forward.config
    session = Rollout(config, seed)
    prime = torch.randn(1, *block_shape(config), generator=torch.Generator().manual_seed(seed + 7))
    zeros = torch.zeros(1, config.block_frames, config.action_dim)
    commit_block(forward, [session.cache], prime, session.text, zeros, rope([0], config.block_frames), config)
    session.committed.append(prime)
    return session


@torch.no_grad()
def test_a_batch_of_sessions_at_different_chunk_indexes_equals_each_run_alone() -> None:
    config = get_config("tiny")  # window of 6 frames: the oldest session's window has slid
    forward = network(config)
    rope = FrameRope(config, CPU)
    sessions = [primed(forward, seed, rope) for seed in (11, 12, 13)]
    moves = torch.randn(3, config.block_frames, config.action_dim, generator=torch.Generator().manual_seed(5))
    for index, lead in enumerate((4, 1, 0)):  # session i is `lead` blocks ahead before the shared step
        for _ in range(lead):
            advance(forward, [sessions[index]], rope, moves[index : index + 1])
    assert [s.cache.next_frame for s in sessions] == [15, 6, 3]
    alone = [advance(forward, [s.clone()], rope, moves[i : i + 1]) for i, s in enumerate(sessions)]
    together = advance(forward, sessions, rope, moves)
    for row in range(3):
        assert (together[row] - alone[row][0]).abs().max().item() <= TOL
    assert (together[0] - together[1]).abs().max().item() > 0.01  # the rows are different sessions


def windowed_reference(
    forward: CachedForward, latents: Tensor, timesteps: Tensor, text: Tensor, mask: Tensor
) -> Tensor:
    """The library's forward, step by step through its public modules, with ``mask`` instead of its own."""
    tr = forward.transformer
    batch, _, frames, height, width = latents.shape
    pph, ppw = height // 2, width // 2
    rotary = tr.rope(latents)
    hidden = tr.patch_embedding(latents).flatten(2).transpose(1, 2)
    temb, proj, context, _ = tr.condition_embedder(timesteps, text)
    proj = proj.unflatten(-1, (6, -1)).view(batch, frames, 1, 1, 6, -1)
    proj = proj.repeat(1, 1, pph, ppw, 1, 1).flatten(1, 3).transpose(1, 2).contiguous()
    temb = temb.view(batch, frames, 1, 1, -1).repeat(1, 1, pph, ppw, 1).flatten(1, 3)
    for block in tr.blocks:
        hidden = block(hidden, context, proj, rotary, mask)
    shift, scale = (tr.scale_shift_table.unsqueeze(2) + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden = tr.proj_out(tr.norm_out(hidden) * (1 + scale.squeeze(1)) + shift.squeeze(1))
    hidden = hidden.reshape(batch, frames, pph, ppw, 1, 2, 2, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def frame_mask(config: WanCausalConfig, frames: int, window: int | None) -> Tensor:
    """Token mask: a frame sees its own block, the sink and (if ``window``) the ``window`` frames before its block."""
    block = torch.arange(frames) // config.block_frames
    start = block * config.block_frames
    key = torch.arange(frames)[None, :]
    seen = block[None, :] <= block[:, None]
    if window is not None:
        recent = (key >= start[:, None] - window) & (key < start[:, None])
        seen = (block[None, :] == block[:, None]) | (key < config.sink_frames) | recent
    tpf = config.tokens_per_frame
    return seen.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)[None, None]


@torch.no_grad()
def test_sink_and_window_after_the_window_slides_equal_a_windowed_mask_reference() -> None:
    config = get_config("tiny").with_window(3)  # sink: the primed block; window: one block
    forward = network(config)
    rope = FrameRope(config, CPU)
    session = primed(forward, 21, rope)
    moves = torch.zeros(1, config.block_frames, config.action_dim)
    for _ in range(3):
        advance(forward, [session], rope, moves)
    assert (session.cache.ring_written, session.cache.cached_frames) == (9, 6)  # slid twice
    record: list[StepRecord] = []
    offsets = [session.cache.next_frame]
    noise = lambda: draw_noise([session.generator], block_shape(config), CPU)  # noqa: E731
    sample_block(forward, [session.cache], noise, session.text, moves, rope(offsets, 3), config, record)
    frames = session.cache.next_frame + config.block_frames
    dense_context = torch.cat(session.committed, dim=2)
    # The reference rebuilt from the library's blocks equals the library's forward under its own mask.
    x, timesteps, flow = record[-1]
    dense = torch.cat([dense_context, x], dim=2)
    dense_t = torch.cat([torch.zeros(1, frames - 3), timesteps], dim=1)
    library = forward.transformer(dense, dense_t, session.text, enable_diffusion_forcing=True, return_dict=False)[0]
    rebuilt = windowed_reference(forward, dense, dense_t, session.text, frame_mask(config, frames, None))
    assert (library - rebuilt).abs().max().item() <= TOL
    for x, timesteps, flow in record:
        dense = torch.cat([dense_context, x], dim=2)
        dense_t = torch.cat([torch.zeros(1, frames - 3), timesteps], dim=1)
        mask = frame_mask(config, frames, config.window_frames)
        reference = windowed_reference(forward, dense, dense_t, session.text, mask)[:, :, -3:]
        assert (reference - flow).abs().max().item() <= TOL
        full = forward.transformer(dense, dense_t, session.text, enable_diffusion_forcing=True, return_dict=False)
        assert (full[0][:, :, -3:] - flow).abs().max().item() > 1e-3  # the window did cut something off
