"""A Wan transformer checkpoint as its authors publish it -> the model's (Diffusers layout) names.

Owns: :class:`TransformerState` (a checkpoint's tensors under the model's names, each remembering
its name in the user's file, the layout it was in and the ``config.json`` beside it: the one
shape every Wan family's loader reads and reports errors from), :func:`transformer_state` (either
layout -> that state: the original layout through diffusers' own public
``convert_wan_transformer_to_diffusers``, :func:`diffusers_name`; the Diffusers layout through the
family's own renaming, if any), :func:`is_diffusers_layout`, :func:`rename_keys` (the renaming,
two keys onto one name being an error naming both), :func:`block_layout` (one Wan2.1 block's
original names and shapes, as ``wan/modules/model.py`` names them), :func:`original_layout` (the
whole transformer's: the stem, the head and every block, which each family's loader extends with
its own keys: wan-causal's text embedding, Matrix-Game's image and action modules, ABot-World's
text embedding and control adapter) and :func:`load_renamed`
(strict: a key missing, extra or of the wrong shape is a :class:`~.statedict.WeightsError` naming
the user's key, the file and both shapes). Which keys a family's transformer has besides the
blocks, and what its sizes are, is the family's. Must not know: sessions, the sampler, caches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.statedict import WeightsError, check_shapes, read_json

__all__ = [
    "TransformerState",
    "block_layout",
    "config_beside",
    "diffusers_name",
    "is_diffusers_layout",
    "load_renamed",
    "rename_keys",
    "transformer_state",
]

#: A few names only the Diffusers layout has (FastVideo's own names included: ``attn1``, ``to_q``).
_DIFFUSERS_MARKERS = ("condition_embedder.", "proj_out.", "scale_shift_table")


@dataclass(slots=True)
class TransformerState:
    """A transformer checkpoint in the model's (Diffusers layout) names, remembering the user's names."""

    tensors: dict[str, Tensor]
    #: model name -> the name in the user's file
    user_names: dict[str, str]
    source: str
    layout: str  # "original" or "diffusers"
    #: The config.json beside the weights (Diffusers', Wan's own, the reference's), if any.
    file_config: dict[str, object] | None = None

    def user_name(self, key: str) -> str:
        return self.user_names.get(key, key)


def is_diffusers_layout(keys: Iterable[str]) -> bool:
    return any(k.startswith(_DIFFUSERS_MARKERS) or ".attn1." in k or ".to_q." in k for k in keys)


def diffusers_name(name: str) -> str:
    """One original key's diffusers name, by the library's own conversion."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    (converted,) = convert_wan_transformer_to_diffusers({name: None})  # type: ignore[no-untyped-call]
    return str(converted)


def transformer_state(
    raw: Mapping[str, Tensor],
    source: str,
    *,
    model_key: Callable[[str], str] | None = None,
    keep: tuple[str, ...] = (),
) -> TransformerState:
    """``raw`` (either layout) in the model's names.

    ``model_key``: a Diffusers-layout key as the family's model names it (default: as it is);
    ``keep``: prefixes of the family's own keys, kept under their names in either layout (and not
    read to tell the layout).
    """
    layout = "diffusers" if is_diffusers_layout(k for k in raw if not k.startswith(keep)) else "original"
    rename = (model_key or _same) if layout == "diffusers" else diffusers_name
    tensors, names = rename_keys(raw, lambda key: key if key.startswith(keep) else rename(key), source)
    return TransformerState(tensors, names, source, layout)


def _same(key: str) -> str:
    return key


def config_beside(path: Path, *, file_too: bool) -> dict[str, object] | None:
    """The ``config.json`` in a weights folder ``path`` (``file_too``: also the one beside a weights file)."""
    config_file = path / "config.json" if path.is_dir() else (path.parent / "config.json" if file_too else None)
    return read_json(config_file) if config_file is not None and config_file.exists() else None


def rename_keys(
    raw: Mapping[str, Tensor], rename: Callable[[str], str], source: str
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``raw`` under the model's names (``rename`` of each key), and model name -> the user's key.

    Two of the user's keys that map to one model name are an error naming both.
    """
    tensors: dict[str, Tensor] = {}
    names: dict[str, str] = {}
    for key, value in raw.items():
        target = rename(key)
        if target in tensors:
            raise WeightsError(f"keys {names[target]!r} and {key!r} both map to {target!r}", path=source)
        tensors[target] = value
        names[target] = key
    return tensors, names


def block_layout(index: int, dim: int, ffn_dim: int) -> dict[str, tuple[int, ...]]:
    """One Wan2.1 block's parameters by their original names: modulation, self- and cross-attention, norm3, FFN."""
    d, f, p = dim, ffn_dim, f"blocks.{index}."
    shapes: dict[str, tuple[int, ...]] = {p + "modulation": (1, 6, d)}
    for attn in ("self_attn", "cross_attn"):
        for proj in "qkvo":
            shapes[f"{p}{attn}.{proj}.weight"] = (d, d)
            shapes[f"{p}{attn}.{proj}.bias"] = (d,)
        shapes[f"{p}{attn}.norm_q.weight"] = (d,)
        shapes[f"{p}{attn}.norm_k.weight"] = (d,)
    shapes[p + "norm3.weight"] = (d,)  # the affine cross-attention norm (diffusers' norm2)
    shapes[p + "norm3.bias"] = (d,)
    shapes[p + "ffn.0.weight"] = (f, d)
    shapes[p + "ffn.0.bias"] = (f,)
    shapes[p + "ffn.2.weight"] = (d, f)
    shapes[p + "ffn.2.bias"] = (d,)
    return shapes


def original_layout(
    config: WanCausalConfig, *, in_channels: int | None = None, text: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every parameter of a Wan transformer of ``config``'s size by its original name: the patch embedding
    (``in_channels``: the latent channels unless the family concatenates more), the timestep embedding and
    projection, the text embedding (``text=False``: a family without one, Matrix-Game), the head and the
    blocks (:func:`block_layout`)."""
    d, f, c = config.dim, config.ffn_dim, config.latent_channels
    p_t, p_h, p_w = config.patch
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (d, c if in_channels is None else in_channels, p_t, p_h, p_w),
        "patch_embedding.bias": (d,),
        "time_embedding.0.weight": (d, config.freq_dim),
        "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d),
        "time_embedding.2.bias": (d,),
        "time_projection.1.weight": (6 * d, d),
        "time_projection.1.bias": (6 * d,),
        "head.modulation": (1, 2, d),
        "head.head.weight": (p_t * p_h * p_w * c, d),
        "head.head.bias": (p_t * p_h * p_w * c,),
    }
    if text:
        shapes.update({
            "text_embedding.0.weight": (d, config.text_dim),
            "text_embedding.0.bias": (d,),
            "text_embedding.2.weight": (d, d),
            "text_embedding.2.bias": (d,),
        })  # fmt: skip
    for i in range(config.num_layers):
        shapes.update(block_layout(i, d, f))
    return shapes


def load_renamed(
    module: nn.Module,
    tensors: Mapping[str, Tensor],
    user_names: Mapping[str, str],
    *,
    original: Iterable[str] | None,
    where: str,
    part: str,
) -> None:
    """Load ``tensors`` (in the model's names) strictly into ``module``, errors in the user's names.

    ``original``: the original layout's names when the file is in that layout, so a key the file
    lacks is named as the authors' layout names it.
    """
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    names = dict(user_names)
    for name in original or ():
        names.setdefault(diffusers_name(name), name)
    check_shapes(tensors, expected, where=where, part=part, user_name=lambda key: names.get(key, key))
    with torch.no_grad():
        module.load_state_dict(tensors, strict=True)
