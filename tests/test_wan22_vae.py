"""Wan2.2's VAE streamed per session by the shared ``VaeStream``, and its published file's layout (tiny widths,
random weights, CPU, float32).

Wan2.2's VAE is diffusers' ``AutoencoderKLWan`` with residual up/down blocks, a wider decoder
than encoder, 48 latent channels and pixels in 2x2 patches (16x spatial). The reference is the
library's own one-shot ``decode`` / ``encode`` of the whole video; the streamed path, chunk by
chunk and batched across sessions, must equal it. ``Wan2.2_VAE.pth`` names its parameters as
Wan2.2's ``wan/modules/vae2_2.py`` does; the test enumerates that layout from the module's structure
and renames it to diffusers' with its own table, independently of the loader's mapping.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from diffusers import AutoencoderKLWan  # noqa: E402
from torch import Tensor  # noqa: E402

from wan_files import one_thread  # noqa: E402, F401 (one_thread: the autouse fixture)
from worldserve.models.wan.build import build_vae  # noqa: E402
from worldserve.models.wan.config import CONFIGS, WanCausalConfig  # noqa: E402
from worldserve.models.wan.statedict import WeightsError  # noqa: E402
from worldserve.models.wan.vae import VaeStream, decoder_cache_bytes  # noqa: E402
from worldserve.models.wan.vaeweights import load_vae_part, original_vae_layout, wan22_original_name  # noqa: E402

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


# --- Wan2.2_VAE.pth as published (wan/modules/vae2_2.py's names), re-typed here ---------------------------


def published_wan22_layout(config: WanCausalConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``WanVAE_`` (Wan-Video/Wan2.2 ``wan/modules/vae2_2.py``) by its name, at ``config``'s
    widths: levels nest their residual blocks and resample (``Down_ResidualBlock.downsamples``, ``Up_ResidualBlock
    .upsamples``; the average shortcuts hold no parameters), resamples keep the width, RGB in 2x2 patches."""
    z, res, mult = config.latent_channels, config.vae_res_blocks, config.vae_dim_mult
    out: dict[str, tuple[int, ...]] = {}

    def conv(name: str, o: int, i: int, *kernel: int) -> None:
        out[f"{name}.weight"] = (o, i, *kernel)
        out[f"{name}.bias"] = (o,)

    def resblock(name: str, i: int, o: int) -> None:
        out[f"{name}.residual.0.gamma"] = (i, 1, 1, 1)
        conv(f"{name}.residual.2", o, i, 3, 3, 3)
        out[f"{name}.residual.3.gamma"] = (o, 1, 1, 1)
        conv(f"{name}.residual.6", o, o, 3, 3, 3)
        if i != o:
            conv(f"{name}.shortcut", o, i, 1, 1, 1)

    def middle(side: str, d: int) -> None:
        resblock(f"{side}.middle.0", d, d)
        out[f"{side}.middle.1.norm.gamma"] = (d, 1, 1)
        conv(f"{side}.middle.1.to_qkv", 3 * d, d, 1, 1)
        conv(f"{side}.middle.1.proj", d, d, 1, 1)
        resblock(f"{side}.middle.2", d, d)

    dims = [config.vae_base_dim * u for u in (1, *mult)]
    conv("encoder.conv1", dims[0], 12, 3, 3, 3)
    for level in range(len(mult)):
        i, o = dims[level], dims[level + 1]
        for j in range(res):
            resblock(f"encoder.downsamples.{level}.downsamples.{j}", i if j == 0 else o, o)
        if level != len(mult) - 1:
            conv(f"encoder.downsamples.{level}.downsamples.{res}.resample.1", o, o, 3, 3)
            if (False, True, True)[level]:
                conv(f"encoder.downsamples.{level}.downsamples.{res}.time_conv", o, o, 3, 1, 1)
    middle("encoder", dims[-1])
    out["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("encoder.head.2", 2 * z, dims[-1], 3, 3, 3)
    conv("conv1", 2 * z, 2 * z, 1, 1, 1)
    conv("conv2", z, z, 1, 1, 1)
    dims = [(config.vae_decoder_base_dim or config.vae_base_dim) * u for u in (mult[-1], *mult[::-1])]
    conv("decoder.conv1", dims[0], z, 3, 3, 3)
    middle("decoder", dims[0])
    for level in range(len(mult)):
        i, o = dims[level], dims[level + 1]
        for j in range(res + 1):
            resblock(f"decoder.upsamples.{level}.upsamples.{j}", i if j == 0 else o, o)
        if level != len(mult) - 1:
            conv(f"decoder.upsamples.{level}.upsamples.{res + 1}.resample.1", o, o, 3, 3)
            if (True, True, False)[level]:
                conv(f"decoder.upsamples.{level}.upsamples.{res + 1}.time_conv", 2 * o, o, 3, 1, 1)
    out["decoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("decoder.head.2", 12, dims[-1], 3, 3, 3)
    return out


_TO_DIFFUSERS = [  # the test's own renaming, original -> diffusers, applied in order
    (r"^conv1\.", "quant_conv."),
    (r"^conv2\.", "post_quant_conv."),
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.head\.0\.", r"\1.norm_out."),
    (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
    (r"^(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0."),
    (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
    (r"^(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1."),
    (r"^encoder\.downsamples\.(\d+)\.downsamples\.2\.", r"encoder.down_blocks.\1.downsampler."),
    (r"^encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
    (r"^decoder\.upsamples\.(\d+)\.upsamples\.3\.", r"decoder.up_blocks.\1.upsampler."),
    (r"^decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2."),
    (r"\.residual\.0\.", ".norm1."),
    (r"\.residual\.2\.", ".conv1."),
    (r"\.residual\.3\.", ".norm2."),
    (r"\.residual\.6\.", ".conv2."),
    (r"\.shortcut\.", ".conv_shortcut."),
]


def to_diffusers(key: str) -> str:
    for pattern, replacement in _TO_DIFFUSERS:
        key = re.sub(pattern, replacement, key)
    return key


def write_published(vae: AutoencoderKLWan, path: Path) -> dict[str, Tensor]:
    """``vae``'s weights saved under ``vae2_2.py``'s names, as ``Wan2.2_VAE.pth`` holds them (a plain state dict)."""
    state = vae.state_dict()
    published = {key: state[to_diffusers(key)].clone() for key in published_wan22_layout(TINY22)}
    torch.save(published, path)
    return published


def test_the_published_layout_is_the_diffusers_module_renamed() -> None:
    layout = published_wan22_layout(TINY22)
    shapes = {k: tuple(v.shape) for k, v in wan22_vae(TINY22).state_dict().items()}
    assert {to_diffusers(k): v for k, v in layout.items()} == shapes
    assert {wan22_original_name(k) for k in shapes} == set(layout)  # the loader's names are vae2_2.py's


@torch.no_grad()
def test_a_published_wan22_vae_file_loads_key_by_key_and_decodes_as_the_module_it_came_from(tmp_path: Path) -> None:
    torch.manual_seed(21)
    source = wan22_vae(TINY22).eval()
    published = write_published(source, tmp_path / "Wan2.2_VAE.pth")
    torch.manual_seed(22)
    target = build_vae(TINY22).eval()
    assert load_vae_part(tmp_path / "Wan2.2_VAE.pth", target, TINY22) == "original"
    state = target.state_dict()
    assert len(state) == len(published)
    for key, value in published.items():
        assert torch.equal(state[to_diffusers(key)], value), key
    latents = torch.randn(1, Z, 4, TINY22.latent_height, TINY22.latent_width)
    assert torch.equal(target.decode(latents).sample, source.decode(latents).sample)


def test_a_wrong_published_wan22_vae_file_is_refused_naming_the_part_file_and_key(tmp_path: Path) -> None:
    torch.manual_seed(23)
    published = write_published(wan22_vae(TINY22), tmp_path / "ok.pth")

    def refused(name: str, state: dict[str, Tensor], match: str) -> None:
        torch.save(state, tmp_path / name)
        with pytest.raises(WeightsError, match=match):
            load_vae_part(tmp_path / name, build_vae(TINY22), TINY22)

    key = "decoder.upsamples.1.upsamples.3.time_conv.weight"
    missing = {k: v for k, v in published.items() if k != key}
    refused(
        "missing.pth",
        missing,
        rf"^VAE \S*missing\.pth: the file \(original layout\) has .*missing \(1\): {re.escape(key)} "
        r"\(128, 64, 3, 1, 1\)"
        r".*; expected Wan2\.2's VAE: Wan2\.2_VAE\.pth \(original Wan layout\)",
    )
    extra = {**published, "decoder.upsamples.0.upsamples.9.residual.0.gamma": torch.ones(1)}
    refused("extra.pth", extra, r"^VAE \S*extra\.pth: .*not in the model \(1\): decoder\.upsamples\.0\.upsamples\.9\.")
    wrong = {**published, "encoder.head.2.weight": torch.zeros(2 * Z, 16, 3, 3, 3)}
    refused("wrong.pth", wrong, r"^VAE \S*wrong\.pth: .*encoder\.head\.2\.weight: expected \(24, 32, 3, 3, 3\), found")
    wan21 = {k: torch.zeros(v) for k, v in original_vae_layout(CONFIGS["tiny"]).items()}
    refused("Wan2.1_VAE.pth", wan21, r"^VAE \S*Wan2\.1_VAE\.pth: the file is Wan2\.1's VAE in the original layout")
