"""Wan2.2's VAE streamed per session by the shared ``VaeStream`` (tiny widths, random weights, CPU, float32).

Wan2.2's VAE is diffusers' ``AutoencoderKLWan`` with residual up/down blocks, a wider decoder
than encoder, 48 latent channels and pixels in 2x2 patches (16x spatial). The reference is the
library's own one-shot ``decode`` / ``encode`` of the whole video; the streamed path, chunk by
chunk and batched across sessions, must equal it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from diffusers import AutoencoderKLWan  # noqa: E402

from wan_files import one_thread  # noqa: E402, F401 (one_thread: the autouse fixture)
from worldserve.models.wan.build import build_vae  # noqa: E402
from worldserve.models.wan.config import CONFIGS, WanCausalConfig  # noqa: E402
from worldserve.models.wan.vae import VaeStream, decoder_cache_bytes  # noqa: E402

TOL = 1e-5
Z = 12  # Wan2.2's 48 latent channels, cut down; every other structural choice is its own

#: Wan2.2's VAE structure at tiny widths: the encoder 8 wide, the decoder 16 (Wan2.2: 160 and 256).
TINY22 = replace(
    CONFIGS["tiny"],
    name="tiny-wan2.2-vae",
    latent_channels=Z,
    vae_base_dim=8,
    vae_decoder_base_dim=16,
    vae_residual=True,
    vae_patch=2,
    vae_latents_mean=tuple(0.1 * i for i in range(Z)),
    vae_latents_std=tuple(1.0 + 0.05 * i for i in range(Z)),
)


def wan22_vae(config: WanCausalConfig) -> AutoencoderKLWan:
    """The VAE as diffusers' Wan2.2 configuration writes it, built here directly (not through ``build_vae``)."""
    return AutoencoderKLWan(
        base_dim=config.vae_base_dim,
        decoder_base_dim=config.vae_decoder_base_dim,
        z_dim=config.latent_channels,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=list(config.vae_latents_mean or ()),
        latents_std=list(config.vae_latents_std or ()),
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
    )


def test_build_vae_builds_wan22s_structure_from_the_config() -> None:
    assert (TINY22.latent_height, TINY22.latent_width) == (4, 4)  # 64x64 at 16x spatial
    built = {k: tuple(v.shape) for k, v in build_vae(TINY22).state_dict().items()}
    direct = {k: tuple(v.shape) for k, v in wan22_vae(TINY22).state_dict().items()}
    assert built == direct
    assert built["encoder.conv_in.weight"][1] == built["decoder.conv_out.weight"][0] == 12  # 2x2 patches of RGB
    assert built["decoder.conv_in.weight"][0] == 4 * 16  # the decoder's own (wider) base width
    with pytest.raises(ValueError, match=r"Wan2\.1's VAE decoder"):
        TINY22.vae_decode_flops()


@torch.no_grad()
def test_streamed_decode_of_batched_sessions_equals_the_library_one_shot_decode() -> None:
    torch.manual_seed(7)
    vae = wan22_vae(TINY22).eval()
    stream = VaeStream(vae)
    assert stream.patch == 2
    latents = torch.randn(2, Z, 12, TINY22.latent_height, TINY22.latent_width)
    caches = [stream.new_cache(), stream.new_cache()]
    # Each session's first chunk alone (its first latent frame decodes to one frame), then 3 chunks batched.
    parts = [torch.cat([stream.decode(latents[i : i + 1, :, :3], [caches[i]], first=True) for i in range(2)])]
    for start in (3, 6, 9):
        parts.append(stream.decode(latents[:, :, start : start + 3], caches))
    streamed = torch.cat(parts, dim=2)
    one_shot = vae.decode(stream.denormalize(latents)).sample
    assert streamed.shape == one_shot.shape == (2, 3, 45, TINY22.height, TINY22.width)
    assert (streamed - one_shot).abs().max().item() <= TOL
    assert sum(stream.nbytes(cache) for cache in caches) == 2 * decoder_cache_bytes(TINY22, 4)


@torch.no_grad()
def test_streamed_encode_equals_the_library_one_shot_encode() -> None:
    torch.manual_seed(8)
    vae = wan22_vae(TINY22).eval()
    stream = VaeStream(vae)
    video = torch.rand(1, 3, 13, TINY22.height, TINY22.width) * 2 - 1
    cache = stream.new_encoder_cache()
    chunks = [stream.encode_chunk(video[:, :, :1], cache)]
    chunks += [stream.encode_chunk(video[:, :, 1 + 4 * i : 5 + 4 * i], cache) for i in range(3)]
    streamed = torch.cat(chunks, dim=2)
    one_shot = stream.encode(video)
    assert streamed.shape == one_shot.shape == (1, Z, 4, TINY22.latent_height, TINY22.latent_width)
    assert (streamed - one_shot).abs().max().item() <= TOL
