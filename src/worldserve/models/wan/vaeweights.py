"""The VAE's weights as Wan2.1 / Wan2.2 publish them (``Wan2.1_VAE.pth``, ``Wan2.2_VAE.pth``) or as Diffusers'.

Owns: :func:`original_vae_layout` (the original key names and shapes of Wan2.1's causal VAE
at a configuration's widths, as ``wan/modules/vae.py`` names them: ``encoder.downsamples.N``,
``decoder.upsamples.N``, ``decoder.head.0.gamma``, the ``conv1``/``conv2`` quant convolutions;
194 keys at the released size), :func:`wan22_original_name` (the name Wan2.2's
``wan/modules/vae2_2.py`` gives each parameter of diffusers' residual ``AutoencoderKLWan``:
``encoder.downsamples.I.downsamples.J`` for ``encoder.down_blocks.I.resnets.J`` / ``.downsampler``,
``decoder.upsamples.I.upsamples.J`` for ``decoder.up_blocks.I.resnets.J`` / ``.upsampler``, the
rest as Wan2.1's; diffusers 0.42.1's converter takes only Wan2.1's layout), :func:`load_vae_weights`
(a file or folder in either layout, for either VAE; Wan2.1's original layout goes through
diffusers' own public ``convert_wan_vae_to_diffusers``, Wan2.2's through
:func:`wan22_original_name`, one key at a time so every error names the user's key; strict, with
shapes; an original file of the other Wan's VAE is named as such) and :func:`load_vae_part` (the
same inside :func:`~worldserve.models.wan.statedict.part_errors`, so an error also names the part
and the file given). Must not know: the transformer, sessions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path

import torch
from torch import Tensor, nn

from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.statedict import WeightsError, check_shapes, part_errors, read_tensors

__all__ = [
    "VAE22_FILE",
    "VAE_FILE",
    "load_vae_part",
    "load_vae_weights",
    "original_vae_layout",
    "vae_layout_of",
    "wan22_original_name",
]

_DIFFUSERS_MARKERS = ("encoder.down_blocks.", "decoder.up_blocks.", "quant_conv.", "post_quant_conv.")
#: The published VAE files (Wan-Video/Wan2.1, Wan-Video/Wan2.2; ABot-World's folder ships the latter).
VAE_FILE = "Wan2.1_VAE.pth"
VAE22_FILE = "Wan2.2_VAE.pth"
#: An original-layout key of Wan2.2's VAE: its levels nest their blocks (``Down_ResidualBlock.downsamples``).
_WAN22_NESTED = re.compile(r"^(encoder\.downsamples|decoder\.upsamples)\.\d+\.(downsamples|upsamples)\.")
_RESNET = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6"}


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


def _wan22_resnet(name: str) -> str:
    """A residual block's parameter (``conv1.weight``, ``conv_shortcut.bias``, ...) by ``vae2_2.py``'s name."""
    layer, _, rest = name.partition(".")
    if layer == "conv_shortcut":
        return f"shortcut.{rest}"
    return f"{_RESNET[layer]}.{rest}"


def wan22_original_name(key: str, res_blocks: int = 2) -> str:
    """The name ``wan/modules/vae2_2.py`` (``WanVAE_``) gives diffusers' ``AutoencoderKLWan(is_residual=True)``
    parameter ``key``; ``res_blocks``: residual blocks per encoder level (the resample follows them; a decoder
    level has one more). A key outside that structure is returned as it is."""
    side, _, rest = key.partition(".")
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    if side in top:
        return f"{top[side]}.{rest}"
    if side not in ("encoder", "decoder"):
        return key
    part, _, rest = rest.partition(".")
    if part in ("conv_in", "conv_out", "norm_out"):
        renamed = {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}[part]
        return f"{side}.{renamed}.{rest}"
    if part == "mid_block":
        kind, _, rest = rest.partition(".")
        index, _, rest = rest.partition(".")
        if kind == "attentions":
            return f"{side}.middle.1.{rest}"
        if kind == "resnets" and index in ("0", "1"):
            return f"{side}.middle.{2 * int(index)}.{_wan22_resnet(rest)}"
        return key
    blocks = {"down_blocks": ("downsamples", "downsampler", res_blocks), "up_blocks": ("upsamples", "upsampler", 0)}
    if part not in blocks:
        return key
    nested, sampler, count = blocks[part]
    count = count or res_blocks + 1
    level, _, rest = rest.partition(".")
    kind, _, rest = rest.partition(".")
    if kind == "resnets":
        index, _, rest = rest.partition(".")
        return f"{side}.{nested}.{level}.{nested}.{index}.{_wan22_resnet(rest)}"
    if kind == sampler:
        return f"{side}.{nested}.{level}.{nested}.{count}.{rest}"
    return key


def _original_names(config: WanCausalConfig, expected: Mapping[str, object]) -> dict[str, str]:
    """Each of the model's keys by the original layout's name for ``config``'s VAE (Wan2.1's or Wan2.2's)."""
    if config.vae_residual:
        return {key: wan22_original_name(key, config.vae_res_blocks) for key in expected}
    names = {}
    for original in original_vae_layout(config):
        names[_convert(original)] = original
    return names


def load_vae_weights(path: str | Path, vae: nn.Module, config: WanCausalConfig) -> str:
    """Load a VAE file/folder (original ``Wan2.1_VAE.pth`` / ``Wan2.2_VAE.pth`` or Diffusers layout) into ``vae``;
    returns the layout.

    Wan2.1's original layout's converter assumes the released structure (2 residual blocks per
    level, 4 levels); ``config`` must have it. Wan2.2's (``config.vae_residual``) is renamed by
    :func:`wan22_original_name` at any widths and block counts.
    """
    raw = read_tensors(path, unwrap=False)
    layout = vae_layout_of(raw)
    expected = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    names: dict[str, str] = {}
    if layout == "diffusers":
        tensors: dict[str, Tensor] = dict(raw)
    else:
        nested = any(_WAN22_NESTED.match(key) for key in raw)
        if nested != config.vae_residual:
            mine, theirs = ("Wan2.2", "Wan2.1") if config.vae_residual else ("Wan2.1", "Wan2.2")
            raise WeightsError(
                f"the file is {theirs}'s VAE in the original layout ({VAE22_FILE if nested else VAE_FILE}'s key "
                f"names); config {config.name} has {mine}'s VAE",
                path=path,
            )
        if not config.vae_residual and (config.vae_res_blocks != 2 or len(config.vae_dim_mult) != 4):
            raise WeightsError(
                "the original VAE layout is converted by diffusers' convert_wan_vae_to_diffusers, which "
                f"takes the released structure (2 residual blocks, 4 levels); config {config.name} has "
                f"{config.vae_res_blocks} and {len(config.vae_dim_mult)}",
                path=path,
            )
        names = _original_names(config, expected)
        if config.vae_residual:
            to_model = {original: key for key, original in names.items()}
            tensors = {to_model.get(key, key): value for key, value in raw.items()}
            names.update({key: key for key in raw if key not in to_model})
        else:
            tensors = {}
            for key, value in raw.items():
                target = _convert(key)
                tensors[target] = value
                names[target] = key
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


def load_vae_part(path: str | Path, vae: nn.Module, config: WanCausalConfig, part: str = "VAE") -> str:
    """:func:`load_vae_weights` with every error naming ``part``, the file given and the file expected."""
    wan = ("Wan2.2", VAE22_FILE) if config.vae_residual else ("Wan2.1", VAE_FILE)
    expected = f"{wan[0]}'s VAE: {wan[1]} (original Wan layout) or a Diffusers vae/ folder"
    with part_errors(part, path, expected):
        return load_vae_weights(path, vae, config)
