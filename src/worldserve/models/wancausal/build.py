"""Build the diffusers modules a configuration names, and the action-conditioning module.

Owns: :func:`build_transformer` (diffusers' ``SkyReelsV2Transformer3DModel``: it takes a
Wan2.1 state dict, and its dense block-causal forward is this family's numerical
reference), :func:`build_vae` (``AutoencoderKLWan``, the causal video VAE),
:class:`ActionEmbedding` (keys/camera -> a per-frame addition to the timestep modulation) and
:func:`seeded_init` (modules built under it are initialised on the device from a seed, the
caller's random state left as it was).
Must not know: caches, sessions, the sampler, checkpoints' key names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from diffusers import AutoencoderKLWan, SkyReelsV2Transformer3DModel
from torch import Tensor, nn

from worldserve.models.wancausal.config import WanCausalConfig

__all__ = ["ActionEmbedding", "build_transformer", "build_vae", "seeded_init"]


@contextmanager
def seeded_init(device: torch.device, seed: int) -> Iterator[None]:
    """Build modules on ``device`` with random initialisation seeded by ``seed``; the caller's RNG stays as it was."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        yield


def build_transformer(config: WanCausalConfig) -> nn.Module:
    """A randomly initialised ``SkyReelsV2Transformer3DModel`` of ``config``'s size (float32)."""
    model: nn.Module = SkyReelsV2Transformer3DModel(  # type: ignore[no-untyped-call, assignment]
        patch_size=config.patch,
        num_attention_heads=config.num_heads,
        attention_head_dim=config.head_dim,
        in_channels=config.latent_channels,
        out_channels=config.latent_channels,
        text_dim=config.text_dim,
        freq_dim=config.freq_dim,
        ffn_dim=config.ffn_dim,
        num_layers=config.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=config.eps,
        num_frame_per_block=config.block_frames,
    )
    return model


def build_vae(config: WanCausalConfig) -> nn.Module:
    """A randomly initialised ``AutoencoderKLWan`` of ``config``'s size (8x spatial, 4x temporal)."""
    kwargs: dict[str, object] = {}
    if config.vae_latents_mean is not None and config.vae_latents_std is not None:
        kwargs = {"latents_mean": list(config.vae_latents_mean), "latents_std": list(config.vae_latents_std)}
    model: nn.Module = AutoencoderKLWan(  # type: ignore[no-untyped-call, assignment]
        base_dim=config.vae_base_dim,
        z_dim=config.latent_channels,
        dim_mult=list(config.vae_dim_mult),
        num_res_blocks=config.vae_res_blocks,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        **kwargs,
    )
    return model


class ActionEmbedding(nn.Module):
    """Per-latent-frame action features -> an addition to the transformer's timestep projection.

    The transformer modulates every block with ``time_proj(silu(temb))`` (shift, scale and
    gate of its norms, 6 x dim per frame); this module adds ``W2 silu(W1 a)`` to it, so a
    frame's keys/camera steer it the way its noise level does (adaLN conditioning, as
    camera-conditioned video models do). Neither layer has a bias, so "no action" adds exactly
    zero and the model is then exactly the transformer alone. Random-initialised unless a
    checkpoint supplies ``action_embedding.*``.
    """

    def __init__(self, action_dim: int, dim: int) -> None:
        super().__init__()
        self.action_dim = action_dim
        self.dim = dim
        self.linear_1 = nn.Linear(action_dim, dim, bias=False)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, 6 * dim, bias=False)
        with torch.no_grad():
            self.linear_2.weight.mul_(0.1)

    def forward(self, actions: Tensor) -> Tensor:
        """``actions`` [..., action_dim] -> [..., 6 * dim]."""
        return self.linear_2(self.act(self.linear_1(actions)))  # type: ignore[no-any-return]
