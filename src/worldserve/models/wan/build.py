"""Build the diffusers modules a Wan configuration names.

Owns: :func:`build_transformer` (diffusers' ``SkyReelsV2Transformer3DModel``: it takes a
Wan2.1 state dict, and its dense block-causal forward is the numerical reference of the
cached forwards built on its blocks), :func:`build_vae` (``AutoencoderKLWan``, the causal video
VAE) and :func:`seeded_init` (modules built under it are initialised on the device from a seed,
the caller's random state left as it was).
Must not know: caches, sessions, the sampler, checkpoints' key names, any family's conditioning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from diffusers import AutoencoderKLWan, SkyReelsV2Transformer3DModel
from torch import nn

from worldserve.models.wan.config import WanCausalConfig

__all__ = ["build_transformer", "build_vae", "seeded_init"]


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
    """A randomly initialised ``AutoencoderKLWan`` of ``config``'s size: Wan2.1's (8x spatial, 4x temporal), or
    Wan2.2's (``vae_residual``, ``vae_patch`` 2: 16x spatial) as diffusers' Wan2.2 configuration builds it."""
    kwargs: dict[str, object] = {}
    if config.vae_latents_mean is not None and config.vae_latents_std is not None:
        kwargs = {"latents_mean": list(config.vae_latents_mean), "latents_std": list(config.vae_latents_std)}
    if config.vae_residual or config.vae_patch != 1 or config.vae_decoder_base_dim is not None:
        pixels = 3 * config.vae_patch**2  # Wan2.2's: the encoder reads 2x2 patches of RGB, the decoder writes them
        kwargs |= {
            "decoder_base_dim": config.vae_decoder_base_dim,
            "is_residual": config.vae_residual,
            "patch_size": config.vae_patch if config.vae_patch != 1 else None,
            "in_channels": pixels,
            "out_channels": pixels,
            "scale_factor_spatial": config.vae_spatial,
        }
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
