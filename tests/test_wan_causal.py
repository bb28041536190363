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
