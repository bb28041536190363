"""The transformer's weights as the Wan2.1 family publishes them -> the diffusers modules.

Owns: :func:`original_layout` (the original Wan2.1 key names and shapes of a configuration, as
``wan/modules/model.py`` names them and Self-Forcing, CausVid, LongLive and Krea save them; one
block's: :func:`block_layout`), :func:`transformer_state` (a checkpoint in either layout -> the
diffusers ``SkyReelsV2Transformer3DModel`` names, through diffusers' own public
``convert_wan_transformer_to_diffusers`` for the original layout, remembering each key's name in
the user's file: :func:`rename_keys`), :func:`merge_lora` (LongLive's ``lora.pt``, a peft state
dict, merged into the weights: ``W += alpha / rank * B @ A``), :func:`infer_config` (the named
configuration whose shapes the checkpoint has) and :func:`load_transformer` (strict, through
:func:`load_renamed`: a key missing, extra or of the wrong shape is a
:class:`~.statedict.WeightsError` naming the user's key, the file and both shapes). The action
embedding's weights, if present, are ``action_embedding.linear_1.weight`` and
``action_embedding.linear_2.weight``. Must not know: sessions, the sampler, caches.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from worldserve.models.wancausal.config import CONFIGS, WanCausalConfig
from worldserve.models.wancausal.statedict import WeightsError, check_shapes, read_json, read_tensors

__all__ = [
    "ACTION_PREFIX",
    "diffusers_name",
    "TransformerState",
    "block_layout",
    "infer_config",
    "load_renamed",
    "load_transformer",
    "merge_lora",
    "original_layout",
    "read_transformer",
    "rename_keys",
    "transformer_state",
]

ACTION_PREFIX = "action_embedding."
#: Wan2.1's attention head width (1.3B: 12 x 128, 14B: 40 x 128); the weights do not record it.
WAN_HEAD_DIM = 128
_BLOCK = re.compile(r"blocks\.(\d+)\.")
#: A few names only the diffusers layout has.
_DIFFUSERS_MARKERS = ("condition_embedder.", "proj_out.", "scale_shift_table")


def original_layout(config: WanCausalConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a Wan2.1 T2V transformer of ``config``'s size, by its original name."""
    d, f, c = config.dim, config.ffn_dim, config.latent_channels
    p_t, p_h, p_w = config.patch
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (d, c, p_t, p_h, p_w),
        "patch_embedding.bias": (d,),
        "text_embedding.0.weight": (d, config.text_dim),
        "text_embedding.0.bias": (d,),
        "text_embedding.2.weight": (d, d),
        "text_embedding.2.bias": (d,),
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
    for i in range(config.num_layers):
        shapes.update(block_layout(i, d, f))
    return shapes


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


def diffusers_name(name: str) -> str:
    """One original key's diffusers name, by the library's own conversion."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    (converted,) = convert_wan_transformer_to_diffusers({name: None})  # type: ignore[no-untyped-call]
    return str(converted)


def is_diffusers_layout(keys: Mapping[str, object]) -> bool:
    return any(key.startswith(_DIFFUSERS_MARKERS) for key in keys)


@dataclass(slots=True)
class TransformerState:
    """A transformer checkpoint in the model's (diffusers) names, remembering the user's names."""

    tensors: dict[str, Tensor]
    #: model name -> the name in the user's file
    user_names: dict[str, str]
    actions: dict[str, Tensor]
    source: str
    layout: str  # "original" or "diffusers"
    #: The Diffusers config.json next to the weights, if any.
    diffusers_config: dict[str, object] | None = None

    def user_name(self, key: str) -> str:
        return self.user_names.get(key, key)


def transformer_state(raw: Mapping[str, Tensor], source: str) -> TransformerState:
    """``raw`` (either layout) in the diffusers names; the action embedding split off."""
    actions = {k[len(ACTION_PREFIX) :]: v for k, v in raw.items() if k.startswith(ACTION_PREFIX)}
    rest = {k: v for k, v in raw.items() if not k.startswith(ACTION_PREFIX)}
    if is_diffusers_layout(rest):
        return TransformerState(dict(rest), {k: k for k in rest}, actions, source, "diffusers")
    tensors, names = rename_keys(rest, diffusers_name, source)
    return TransformerState(tensors, names, actions, source, "original")


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


def read_transformer(path: str | Path, *, ema: bool = True) -> TransformerState:
    """A transformer checkpoint file, or a Diffusers ``transformer/`` folder (with its config.json)."""
    path = Path(path)
    state = transformer_state(read_tensors(path, ema=ema), str(path))
    config_file = path / "config.json" if path.is_dir() else None
    if config_file is not None and config_file.exists():
        state.diffusers_config = read_json(config_file)
    return state


def merge_lora(state: TransformerState, path: str | Path, alpha: float | None = None) -> int:
    """Merge a peft LoRA (LongLive's ``lora.pt``) into ``state``; returns the number of layers changed.

    Each adapted linear layer has ``<name>.lora_A.weight`` [rank, in] and ``<name>.lora_B.weight``
    [out, rank]; its weight becomes ``W + alpha / rank * B @ A`` (``alpha`` defaults to the
    rank, LongLive's released ``alpha == rank``).
    """
    raw = read_tensors(path, unwrap=False)
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in raw.items():
        name = key.removeprefix("base_model.model.").removeprefix("model.")
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.default)?\.weight", name)
        if match is None:
            raise WeightsError(f"key {key!r} is not <layer>.lora_A.weight or <layer>.lora_B.weight", path=path)
        pairs.setdefault(match.group(1), {})[match.group(2)] = value
    for layer, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise WeightsError(f"layer {layer!r} has only lora_{''.join(pair)}", path=path)
        original = f"{layer}.weight"
        target = original if state.layout == "diffusers" else diffusers_name(original)
        if target not in state.tensors:
            raise WeightsError(f"layer {layer!r} adapts {original!r}, which the transformer lacks", path=path)
        down, up = pair["A"].float(), pair["B"].float()
        rank = down.shape[0]
        weight = state.tensors[target]
        if up.shape[1] != rank or (up.shape[0], down.shape[1]) != tuple(weight.shape):
            raise WeightsError(
                f"layer {layer!r}: B {tuple(up.shape)} @ A {tuple(down.shape)} does not fit the transformer's "
                f"{state.user_name(target)} {tuple(weight.shape)}",
                path=path,
            )
        scale = (alpha if alpha is not None else rank) / rank
        state.tensors[target] = (weight.float() + scale * (up @ down)).to(weight.dtype)
    return len(pairs)


def _found_config(state: TransformerState) -> dict[str, int]:
    t = state.tensors
    try:
        patch = t["patch_embedding.weight"]
        found = {
            "dim": int(patch.shape[0]),
            "latent_channels": int(patch.shape[1]),
            "num_layers": len({int(m.group(1)) for k in t if (m := _BLOCK.match(k))}),
            "ffn_dim": int(t["blocks.0.ffn.net.0.proj.weight"].shape[0]),
            "text_dim": int(t["condition_embedder.text_embedder.linear_1.weight"].shape[1]),
            "freq_dim": int(t["condition_embedder.time_embedder.linear_1.weight"].shape[1]),
        }
    except KeyError as error:
        key = error.args[0]
        raise WeightsError(
            f"not a Wan2.1 transformer checkpoint: it lacks {state.user_name(key)!r} "
            f"(keys start: {sorted(state.user_names.values())[:6]})",
            path=state.source,
        ) from None
    config = state.diffusers_config or {}
    heads = config.get("num_attention_heads", config.get("num_heads"))  # Diffusers' or Wan's own config.json
    found["num_heads"] = int(heads) if isinstance(heads, int) else max(1, found["dim"] // WAN_HEAD_DIM)
    return found


def _sizes(config: WanCausalConfig) -> dict[str, int]:
    return {
        "dim": config.dim,
        "latent_channels": config.latent_channels,
        "num_layers": config.num_layers,
        "ffn_dim": config.ffn_dim,
        "text_dim": config.text_dim,
        "freq_dim": config.freq_dim,
        "num_heads": config.num_heads,
    }


def infer_config(state: TransformerState) -> WanCausalConfig:
    """The named configuration (``tiny``, ``1.3b``, ``14b``) of the checkpoint's width.

    The width names the size; any other shape that differs from it is reported key by key
    when the weights are loaded.
    """
    found = _found_config(state)
    for config in CONFIGS.values():
        if config.dim == found["dim"]:
            return config
    raise WeightsError(
        f"a transformer of {found} matches no known config "
        f"({', '.join(f'{name}: dim {c.dim}, {c.num_layers} layers' for name, c in CONFIGS.items())})",
        path=state.source,
    )


def load_transformer(
    state: TransformerState, transformer: nn.Module, actions: nn.Module, config: WanCausalConfig
) -> bool:
    """Load ``state`` strictly into ``transformer`` (and ``actions`` if present); True if the actions were."""
    load_renamed(
        transformer,
        state.tensors,
        state.user_names,
        original=original_layout(config) if state.layout == "original" else None,
        where=state.source,
        part=f"the file ({state.layout} layout, config {config.name})",
    )
    if state.actions:
        wanted = {k: tuple(v.shape) for k, v in actions.state_dict().items()}
        check_shapes(
            state.actions,
            wanted,
            where=state.source,
            part="its action embedding",
            user_name=lambda k: ACTION_PREFIX + k,
        )
        actions.load_state_dict(state.actions, strict=True)
    return bool(state.actions)


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
