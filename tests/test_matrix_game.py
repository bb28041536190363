"""``matrix-game-2`` on a tiny config with random weights (CPU, float32).

The reference is an independent re-typing of Matrix-Game 2.0's streaming forward on its original
parameter names (``tests/matrix_reference.py``, one session at a time, its own rolling caches);
the cached, batched forward built on wan-causal's parts must equal it at every denoising step.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from torch import Tensor  # noqa: E402

from matrix_drive import BLOCK, conditions, network, noise_for, reference, rollout_against_reference, video_actions  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models.matrixgame.config import VARIANTS, matrix_config  # noqa: E402
from worldserve.models.matrixgame.forward import MatrixBatchKV, MatrixCaches, MatrixConditions  # noqa: E402
from worldserve.models.wan.rope import FrameRope  # noqa: E402
from worldserve.models.wan.sampler import commit_block, sample_block  # noqa: E402

CPU = torch.device("cpu")
TOL = 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_the_cached_forward_equals_the_reference_at_every_step_with_new_keys_and_mouse_every_latent_frame(
    variant: str,
) -> None:
    config = matrix_config("tiny", variant)
    forward = network(config)
    blocks = 5  # the window (3 frames; GTA: 1) slides from the second block on
    checked = rollout_against_reference(forward, reference(forward), blocks)
    assert checked == blocks * len(config.wan.denoising_steps)


@torch.no_grad()
def test_the_action_modules_steer_the_flow() -> None:
    """Other keys (or another mouse motion) change the prediction: the modules are in the path."""
    config = matrix_config("tiny", "universal")
    forward = network(config)
    wan = config.wan
    image = torch.randn(1, config.clip.tokens, config.clip.dim)
    image_latents = torch.randn(1, 8, BLOCK, wan.latent_height, wan.latent_width)
    keys, mouse = video_actions(config, 1, seed=5)
    x = torch.randn(1, wan.latent_channels, BLOCK, wan.latent_height, wan.latent_width)
    t = torch.full((1, BLOCK), 500.0)
    tables = FrameRope(wan, CPU)([0], BLOCK)

    def flow(keys: Tensor, mouse: Tensor) -> Tensor:
        caches = MatrixCaches(config, CPU, torch.float32)
        result = forward(
            x, t, image, conditions(config, image_latents, keys, mouse, 0), MatrixBatchKV([caches]), tables
        )
        assert result is not None
        return result

    base = flow(keys, mouse)
    assert (flow(1.0 - keys, mouse) - base).abs().max().item() > 1e-3
    assert (flow(keys, -mouse) - base).abs().max().item() > 1e-3


@torch.no_grad()
def test_a_batch_of_sessions_at_different_positions_equals_each_alone() -> None:
    config = matrix_config("tiny", "universal")
    forward = network(config)
    wan = config.wan
    rope = FrameRope(wan, CPU)
    generator = torch.Generator().manual_seed(8)
    leads = (5, 2, 0)
    sessions = []
    for index, lead in enumerate(leads):
        image = torch.randn(1, config.clip.tokens, config.clip.dim, generator=generator)
        latents = torch.randn(1, 8, (lead + 1) * BLOCK, wan.latent_height, wan.latent_width, generator=generator)
        keys, mouse = video_actions(config, lead + 1, seed=20 + index)
        caches = MatrixCaches(config, CPU, torch.float32)
        for block in range(lead):
            cond = conditions(config, latents, keys, mouse, block)
            kv = MatrixBatchKV([caches])
            tables = rope([caches.next_frame], BLOCK)
            x0 = sample_block(forward, kv, noise_for([index], [block * 10], config), image, cond, tables, wan)
            commit_block(forward, kv, x0, image, cond, tables, wan)
        sessions.append((image, conditions(config, latents, keys, mouse, lead), caches))

    def step(rows: list[int], caches: list[MatrixCaches]) -> Tensor:
        conds = [sessions[r][1] for r in rows]
        mice = [c.mouse for c in conds]
        cond = MatrixConditions(
            image_latents=torch.cat([c.image_latents for c in conds]),
            keyboard=torch.cat([c.keyboard for c in conds]),
            mouse=torch.cat([m for m in mice if m is not None]),
            offsets=tuple(c.offsets[0] for c in conds),
        )
        image = torch.cat([sessions[r][0] for r in rows])
        kv = MatrixBatchKV(caches)
        tables = rope([c.next_frame for c in caches], BLOCK)
        noise = noise_for(list(rows), [leads[r] * 10 for r in rows], config)
        x0 = sample_block(forward, kv, noise, image, cond, tables, wan)
        commit_block(forward, kv, x0, image, cond, tables, wan)
        return x0

    alone = [step([row], [sessions[row][2].clone()]) for row in range(3)]
    together = step([0, 1, 2], [s[2] for s in sessions])
    assert [s[2].next_frame for s in sessions] == [18, 9, 3]
    for row in range(3):
        assert (together[row] - alone[row][0]).abs().max().item() <= TOL
    assert (together[0] - together[1]).abs().max().item() > 0.01


@torch.no_grad()
def test_the_flop_arithmetic_at_the_1_3b_widths_is_torchs_count() -> None:
    """``forward_flops`` (what the docs' FLOPs per block come from) against torch's FLOP counter on a forward
    at the released widths (2 blocks, the first with an action module, a 64x64 video), cache full."""
    from dataclasses import replace

    from torch.utils.flop_counter import FlopCounterMode

    from worldserve.models.matrixgame.action import action_windows
    from worldserve.models.wan.rope import FrameRope

    released = matrix_config("1.3b", "universal")
    config = replace(
        released,
        wan=replace(released.wan, num_layers=2, height=64, width=64),
        action=replace(released.action, layers=(0,)),
    )
    forward = network(config)
    wan = config.wan
    caches = MatrixCaches(config, CPU, torch.float32)
    rope = FrameRope(wan, CPU)
    image = torch.randn(1, config.clip.tokens, config.clip.dim)
    x = torch.randn(1, wan.latent_channels, BLOCK, wan.latent_height, wan.latent_width)
    t = torch.full((1, BLOCK), 500.0)

    def conditions_at(first: int) -> MatrixConditions:
        keys, mouse = torch.rand(1, 12, 4), torch.rand(1, 12, 2)
        return MatrixConditions(
            image_latents=torch.randn(1, 20, BLOCK, wan.latent_height, wan.latent_width),
            keyboard=action_windows(keys, keys, config.action),
            mouse=action_windows(mouse, mouse, config.action),
            offsets=(first,),
        )

    for block in range(2):  # fill the window
        kv = MatrixBatchKV([caches])
        kv.record()
        forward(x, t, image, conditions_at(BLOCK * block), kv, rope([BLOCK * block], BLOCK), head=False)
        kv.commit()
    kv = MatrixBatchKV([caches])
    assert caches.attention.cached_frames + BLOCK == wan.cache_frames
    with FlopCounterMode(display=False) as counter:
        forward(x, t, image, conditions_at(2 * BLOCK), kv, rope([2 * BLOCK], BLOCK))
    counted = counter.get_total_flops()
    assert abs(config.forward_flops(BLOCK, wan.cache_frames) - counted) <= 0.02 * counted


@torch.no_grad()
def test_the_image_latents_are_the_one_shot_encode_of_the_image_then_blank_frames_at_any_length() -> None:
    """The reference encodes ``[image, 0, 0, ...]`` for a fixed length in one causal pass; the streamed
    encode stops where the encoder's state repeats and gives the same latents for any length past it."""
    from wan_files import tiny_vae
    from worldserve.models.matrixgame.image import encode_image_latents
    from worldserve.models.wan.vae import VaeStream

    config = matrix_config("tiny", "universal")
    vae = VaeStream(tiny_vae(config.wan))
    image = torch.rand(1, 3, 48, 80, generator=torch.Generator().manual_seed(2)) * 2 - 1
    latents = encode_image_latents(vae, image, config)
    kept = latents.latents.shape[2]
    assert kept < 40  # the fixed point: every later latent frame is the last one kept
    frames = 45
    video = torch.cat([image[:, :, None], torch.zeros(1, 3, 4 * (frames - 1), 48, 80)], dim=2)
    one_shot = vae.encode(video)
    streamed = latents.frames(0, frames)
    assert (streamed[:, 4:] - one_shot).abs().max().item() <= 1e-6
    assert torch.equal(streamed[:, :4, 0], torch.ones_like(streamed[:, :4, 0]))  # the first frame's mask
    assert torch.equal(streamed[:, :4, 1:], torch.zeros_like(streamed[:, :4, 1:]))
    assert torch.equal(latents.frames(60, 3)[:, 4:], one_shot[:, :, -1:].expand(-1, -1, 3, -1, -1))
