"""Driving ``matrix-game-2``'s forward by hand in tests: the reference beside it, actions, conditions, noise.

The per-video-frame action sequences are the reference's (``conditional_dict``'s ``keyboard_cond`` /
``mouse_cond``); the model takes each block's 12 slots and the 12 video frames before them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from matrix_reference import Geometry, ReferenceMatrixGame, original_name
from worldserve.models.matrixgame.action import action_windows, first_block_actions
from worldserve.models.matrixgame.config import MatrixGameConfig
from worldserve.models.matrixgame.forward import MatrixConditions, MatrixGameForward
from worldserve.models.matrixgame.transformer import build_transformer
from worldserve.models.wan.noise import batch_noise

BLOCK = 3


def network(config: MatrixGameConfig, seed: int = 0) -> MatrixGameForward:
    torch.manual_seed(seed)
    return MatrixGameForward(build_transformer(config).eval(), config)


def reference(forward: MatrixGameForward, weights: dict[str, Tensor] | None = None) -> ReferenceMatrixGame:
    """The reference on ``weights`` (original names; by default the forward's own, renamed)."""
    config = forward.config
    if weights is None:
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


def noise_for(seeds: list[int], draws: list[int], config: MatrixGameConfig) -> Callable[[], Tensor]:
    wan = config.wan
    shape = (wan.latent_channels, BLOCK, wan.latent_height, wan.latent_width)
    count = [0]

    def draw() -> Tensor:
        count[0] += 1
        return batch_noise(torch.tensor(seeds), torch.tensor(draws) + count[0] - 1, shape)

    return draw


def rollout_against_reference(
    forward: MatrixGameForward, ref: ReferenceMatrixGame, blocks: int, seed: int = 3, tol: float = 1e-5
) -> int:
    """Roll ``blocks`` blocks out through the cached forward and the shared sampler, checking every denoising
    step's flow against the reference's on the same input (with the reference's own commit pass after
    each block); returns the steps checked. New keys every latent frame, new mouse every video frame."""
    from worldserve.models.matrixgame.forward import MatrixBatchKV, MatrixCaches
    from worldserve.models.wan.rope import FrameRope
    from worldserve.models.wan.sampler import StepRecord, commit_block, sample_block

    config = forward.config
    wan = config.wan
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(1, config.clip.tokens, config.clip.dim, generator=generator)
    extra = config.in_channels - wan.latent_channels
    image_latents = torch.randn(1, extra, blocks * BLOCK, wan.latent_height, wan.latent_width, generator=generator)
    keys, mouse = video_actions(config, blocks, seed=seed + 1)
    caches = MatrixCaches(config, torch.device("cpu"), torch.float32)
    rope = FrameRope(wan, torch.device("cpu"))
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
            assert (expected - flow).abs().max().item() <= tol
            checked += 1
        ref(x0, torch.zeros_like(record[0][1]), image, cond.image_latents, ref_mouse, keys[:, :last], BLOCK * block)
    return checked
