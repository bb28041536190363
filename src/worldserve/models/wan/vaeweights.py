"""The VAE's weights as Wan2.1 publishes them (``Wan2.1_VAE.pth``) or as a Diffusers ``vae/`` folder.

Owns: :func:`original_vae_layout` (the original key names and shapes of Wan2.1's causal VAE
at a configuration's widths, as ``wan/modules/vae.py`` names them: ``encoder.downsamples.N``,
``decoder.upsamples.N``, ``decoder.head.0.gamma``, the ``conv1``/``conv2`` quant convolutions;
194 keys at the released size) and :func:`load_vae_weights` (a file or folder in either
layout; the original layout goes through diffusers' own public ``convert_wan_vae_to_diffusers``,
one key at a time so every error names the user's key; strict, with shapes). Must not know:
the transformer, sessions.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path

import torch
from torch import Tensor, nn

from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.statedict import WeightsError, check_shapes, read_tensors

__all__ = ["load_vae_weights", "original_vae_layout", "vae_layout_of"]

_DIFFUSERS_MARKERS = ("encoder.down_blocks.", "decoder.up_blocks.", "quant_conv.", "post_quant_conv.")


def _residual(prefix: str, in_dim: int, out_dim: int, shapes: dict[str, tuple[int, ...]]) -> None:
    shapes[f"{prefix}.residual.0.gamma"] = (in_dim, 1, 1, 1)
    shapes[f"{prefix}.residual.2.weight"] = (out_dim, in_dim, 3, 3, 3)
    shapes[f"{prefix}.residual.2.bias"] = (out_dim,)
    shapes[f"{prefix}.residual.3.gamma"] = (out_dim, 1, 1, 1)
    shapes[f"{prefix}.residual.6.weight"] = (out_dim, out_dim, 3, 3, 3)
    shapes[f"{prefix}.residual.6.bias"] = (out_dim,)
    if in_dim != out_dim:
        shapes[f"{prefix}.shortcut.weight"] = (out_dim, in_dim, 1, 1, 1)
        shapes[f"{prefix}.shortcut.bias"] = (out_dim,)


def _attention(prefix: str, dim: int, shapes: dict[str, tuple[int, ...]]) -> None:
    shapes[f"{prefix}.norm.gamma"] = (dim, 1, 1)
    shapes[f"{prefix}.to_qkv.weight"] = (3 * dim, dim, 1, 1)
    shapes[f"{prefix}.to_qkv.bias"] = (3 * dim,)
    shapes[f"{prefix}.proj.weight"] = (dim, dim, 1, 1)
    shapes[f"{prefix}.proj.bias"] = (dim,)


def _middle(prefix: str, dim: int, shapes: dict[str, tuple[int, ...]]) -> None:
    _residual(f"{prefix}.middle.0", dim, dim, shapes)
    _attention(f"{prefix}.middle.1", dim, shapes)
    _residual(f"{prefix}.middle.2", dim, dim, shapes)


def original_vae_layout(config: WanCausalConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of Wan2.1's VAE (no attention below the middle, as released) by its original name."""
    base, z, mult, res = config.vae_base_dim, config.latent_channels, config.vae_dim_mult, config.vae_res_blocks
    temporal = (False, True, True)[: len(mult) - 1]
    shapes: dict[str, tuple[int, ...]] = {}
    # Encoder3d(dim, z_dim * 2): conv1, downsamples (residual blocks, then a resample per level), middle, head.
    dims = [base * u for u in (1, *mult)]
    shapes["encoder.conv1.weight"] = (dims[0], 3, 3, 3, 3)
    shapes["encoder.conv1.bias"] = (dims[0],)
    index = 0
    out_dim = dims[0]
    for level, (in_dim, out_dim) in enumerate(pairwise(dims)):
        for _ in range(res):
            _residual(f"encoder.downsamples.{index}", in_dim, out_dim, shapes)
            index += 1
            in_dim = out_dim
        if level != len(mult) - 1:
            shapes[f"encoder.downsamples.{index}.resample.1.weight"] = (out_dim, out_dim, 3, 3)
            shapes[f"encoder.downsamples.{index}.resample.1.bias"] = (out_dim,)
            if temporal[level]:
                shapes[f"encoder.downsamples.{index}.time_conv.weight"] = (out_dim, out_dim, 3, 1, 1)
                shapes[f"encoder.downsamples.{index}.time_conv.bias"] = (out_dim,)
            index += 1
    _middle("encoder", out_dim, shapes)
    shapes["encoder.head.0.gamma"] = (out_dim, 1, 1, 1)
    shapes["encoder.head.2.weight"] = (2 * z, out_dim, 3, 3, 3)
    shapes["encoder.head.2.bias"] = (2 * z,)
    # The quant convolutions around the latent.
    shapes["conv1.weight"] = (2 * z, 2 * z, 1, 1, 1)
    shapes["conv1.bias"] = (2 * z,)
    shapes["conv2.weight"] = (z, z, 1, 1, 1)
    shapes["conv2.bias"] = (z,)
    # Decoder3d: conv1, middle, upsamples (res + 1 residual blocks, then a resample per level), head.
    dims = [base * u for u in (mult[-1], *mult[::-1])]
    shapes["decoder.conv1.weight"] = (dims[0], z, 3, 3, 3)
    shapes["decoder.conv1.bias"] = (dims[0],)
    _middle("decoder", dims[0], shapes)
    upsample_temporal = temporal[::-1]
    index = 0
    for level, (in_dim, out_dim) in enumerate(pairwise(dims)):
        if level in (1, 2, 3):
            in_dim //= 2
        for _ in range(res + 1):
            _residual(f"decoder.upsamples.{index}", in_dim, out_dim, shapes)
            index += 1
            in_dim = out_dim
        if level != len(mult) - 1:
            shapes[f"decoder.upsamples.{index}.resample.1.weight"] = (out_dim // 2, out_dim, 3, 3)
            shapes[f"decoder.upsamples.{index}.resample.1.bias"] = (out_dim // 2,)
            if upsample_temporal[level]:
                shapes[f"decoder.upsamples.{index}.time_conv.weight"] = (2 * out_dim, out_dim, 3, 1, 1)
                shapes[f"decoder.upsamples.{index}.time_conv.bias"] = (2 * out_dim,)
            index += 1
    shapes["decoder.head.0.gamma"] = (out_dim, 1, 1, 1)
    shapes["decoder.head.2.weight"] = (3, out_dim, 3, 3, 3)
    shapes["decoder.head.2.bias"] = (3,)
    return shapes


def vae_layout_of(keys: Mapping[str, object]) -> str:
    """``"diffusers"`` or ``"original"``: which naming a VAE state dict uses."""
    return "diffusers" if any(k.startswith(_DIFFUSERS_MARKERS) for k in keys) else "original"


def _convert(name: str) -> str:
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    (converted,) = convert_wan_vae_to_diffusers({name: None})  # type: ignore[no-untyped-call]
    return str(converted)


def load_vae_weights(path: str | Path, vae: nn.Module, config: WanCausalConfig) -> str:
    """Load a VAE file/folder (original ``Wan2.1_VAE.pth`` or Diffusers layout) into ``vae``; returns the layout.

    The original layout's converter assumes the released structure (2 residual blocks per level,
    4 levels); ``config`` must have it.
    """
    raw = read_tensors(path, unwrap=False)
    layout = vae_layout_of(raw)
    expected = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    names: dict[str, str] = {}
    if layout == "diffusers":
        tensors: dict[str, Tensor] = dict(raw)
    else:
        if config.vae_res_blocks != 2 or len(config.vae_dim_mult) != 4:
            raise WeightsError(
                "the original VAE layout is converted by diffusers' convert_wan_vae_to_diffusers, which "
                f"takes the released structure (2 residual blocks, 4 levels); config {config.name} has "
                f"{config.vae_res_blocks} and {len(config.vae_dim_mult)}",
                path=path,
            )
        tensors = {}
        for key, value in raw.items():
            target = _convert(key)
            tensors[target] = value
            names[target] = key
        for original in original_vae_layout(config):  # keys the file lacks, in the authors' names
            names.setdefault(_convert(original), original)
    check_shapes(
        tensors,
        expected,
        where=str(path),
        part=f"the file ({layout} layout)",
        user_name=lambda key: names.get(key, key),
    )
    with torch.no_grad():
        vae.load_state_dict(tensors, strict=True)
    return layout
