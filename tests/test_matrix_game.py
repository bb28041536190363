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

from matrix_reference import Geometry, ReferenceMatrixGame, original_name  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models.matrixgame.action import action_windows, first_block_actions  # noqa: E402
from worldserve.models.matrixgame.config import VARIANTS, MatrixGameConfig, matrix_config  # noqa: E402
from worldserve.models.matrixgame.forward import (  # noqa: E402
    MatrixBatchKV,
    MatrixCaches,
    MatrixConditions,
    MatrixGameForward,
)
from worldserve.models.matrixgame.transformer import build_transformer  # noqa: E402
from worldserve.models.wancausal.noise import batch_noise  # noqa: E402
from worldserve.models.wancausal.rope import FrameRope  # noqa: E402
from worldserve.models.wancausal.sampler import StepRecord, commit_block, sample_block  # noqa: E402

CPU = torch.device("cpu")
TOL = 1e-5
BLOCK = 3


def network(config: MatrixGameConfig, seed: int = 0) -> MatrixGameForward:
    torch.manual_seed(seed)
    return MatrixGameForward(build_transformer(config).eval(), config)


def reference(forward: MatrixGameForward) -> ReferenceMatrixGame:
    config = forward.config
    weights = {original_name(k): v for k, v in forward.transformer.state_dict().items()}
    geometry = Geometry(
        num_heads=config.wan.num_heads,
        local_attn_size=BLOCK + config.wan.window_frames,
        action_blocks=config.action.layers,
        action_heads=config.action.heads,
        mouse=config.action.mouse,
        rope_dims=config.action.rope_dims,
    )
    return ReferenceMatrixGame(weights, geometry, config.tokens_per_frame)


def video_actions(config: MatrixGameConfig, blocks: int, seed: int) -> tuple[Tensor, Tensor]:
    """Keyboard and mouse per video frame, ``1 + 4 (3 blocks - 1)`` frames: a different key combination on
    every latent frame (its 4 video frames), and a different mouse motion on every video frame."""
    generator = torch.Generator().manual_seed(seed)
    latent = blocks * BLOCK
    frames = 1 + 4 * (latent - 1)
    dim = config.action.keyboard_dim
    combos = torch.randint(0, 2, (latent, dim), generator=generator).float()
    combos[torch.arange(latent), torch.arange(latent) % dim] = (
        1.0 - combos[torch.arange(latent) - 1, torch.arange(latent) % dim]
    )
    per_frame = torch.cat([combos[:1], combos[1:].repeat_interleave(4, dim=0)])
    mouse = 0.1 * torch.randn(frames, 2, generator=generator)
    return per_frame[None], mouse[None]


def block_inputs(per_frame: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """(history, block) as the model takes them, cut from the reference's per-video-frame sequence.

    Block k's own 12 slots are video frames 12k - 3 .. 12k + 8 and its history the 12 before; frames
    before the first take the first frame's action (the reference's padding), which is also what
    :func:`first_block_actions` gives a first block of 9 video frames.
    """
    pad = per_frame[:, :1].expand(-1, 15, -1)
    padded = torch.cat([pad, per_frame], dim=1)  # video frame v at 15 + v
    history, own = padded[:, 12 * block : 12 * block + 12], padded[:, 12 * block + 12 : 12 * block + 24]
    if block == 0:
        assert torch.equal(own, first_block_actions(per_frame[:, :9]))
    return history, own


def conditions(
    config: MatrixGameConfig, image_latents: Tensor, keys: Tensor, mouse: Tensor, block: int
) -> MatrixConditions:
    history, own = block_inputs(keys, block)
    mouse_windows = None
    if config.action.mouse:
        mouse_history, mouse_own = block_inputs(mouse, block)
        mouse_windows = action_windows(mouse_history, mouse_own, config.action)
    first = BLOCK * block
    return MatrixConditions(
        image_latents=image_latents[:, :, first : first + BLOCK],
        keyboard=action_windows(history, own, config.action),
        mouse=mouse_windows,
        offsets=(first,),
    )


def noise_for(seeds: list[int], draws: list[int], config: MatrixGameConfig):  # type: ignore[no-untyped-def]
    wan = config.wan
    shape = (wan.latent_channels, BLOCK, wan.latent_height, wan.latent_width)
    count = [0]

    def draw() -> Tensor:
        count[0] += 1
        return batch_noise(torch.tensor(seeds), torch.tensor(draws) + count[0] - 1, shape)

    return draw


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_the_cached_forward_equals_the_reference_at_every_step_with_new_keys_and_mouse_every_latent_frame(
    variant: str,
) -> None:
    config = matrix_config("tiny", variant)
    forward = network(config)
    ref = reference(forward)
    wan = config.wan
    blocks = 5  # the window (3 frames; GTA: 1) slides from the second block on
    generator = torch.Generator().manual_seed(3)
    image = torch.randn(1, config.clip.tokens, config.clip.dim, generator=generator)
    image_latents = torch.randn(
        1,
        config.in_channels - wan.latent_channels,
        blocks * BLOCK,
        wan.latent_height,
        wan.latent_width,
        generator=generator,
    )
    keys, mouse = video_actions(config, blocks, seed=4)
    caches = MatrixCaches(config, CPU, torch.float32)
    rope = FrameRope(wan, CPU)
    checked = 0
    for block in range(blocks):
        cond = conditions(config, image_latents, keys, mouse, block)
        kv = MatrixBatchKV([caches])
        tables = rope([caches.next_frame], BLOCK)
        record: list[StepRecord] = []
        x0 = sample_block(forward, kv, noise_for([7], [block * 10], config), image, cond, tables, wan, record)
        commit_block(forward, kv, x0, image, cond, tables, wan)
        last = 1 + 4 * (BLOCK * block + BLOCK - 1)
        ref_mouse = mouse[:, :last] if config.action.mouse else None
        for x, timesteps, flow in record:
            expected = ref(x, timesteps, image, cond.image_latents, ref_mouse, keys[:, :last], BLOCK * block)
            assert (expected - flow).abs().max().item() <= TOL
            checked += 1
        ref(x0, torch.zeros_like(record[0][1]), image, cond.image_latents, ref_mouse, keys[:, :last], BLOCK * block)
    assert checked == blocks * len(wan.denoising_steps)
    assert caches.attention.cached_frames == wan.window_frames


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
