"""wan-causal's transformer weights as the Wan2.1 families publish them -> the diffusers modules.

Owns: :func:`read_transformer` (a checkpoint in either layout -> the shared
:class:`~worldserve.models.wan.checkpoint.TransformerState` in diffusers'
``SkyReelsV2Transformer3DModel`` names, the action embedding's keys kept as they are),
:func:`merge_lora` (LongLive's ``lora.pt``, a peft state dict, merged into the weights:
``W += alpha / rank * B @ A``), :func:`infer_config` (the named configuration whose shapes the
checkpoint has) and :func:`load_transformer` (strict, through the shared
:func:`~worldserve.models.wan.checkpoint.load_renamed`: a key missing, extra or of the wrong shape
is a :class:`~worldserve.models.wan.statedict.WeightsError` naming the user's key, the file and
both shapes). The action embedding's weights, if present, are ``action_embedding.linear_1.weight``
and ``action_embedding.linear_2.weight``. Must not know: sessions, the sampler, caches.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import Tensor, nn

from worldserve.models.wan.checkpoint import (
    TransformerState,
    config_beside,
    diffusers_name,
    load_renamed,
    original_layout,
    transformer_state,
)
from worldserve.models.wan.config import CONFIGS, WanCausalConfig
from worldserve.models.wan.statedict import WeightsError, check_shapes, read_tensors

__all__ = [
    "ACTION_PREFIX",
    "WAN_HEAD_DIM",
    "infer_config",
    "load_transformer",
    "merge_lora",
    "read_transformer",
]

ACTION_PREFIX = "action_embedding."
#: Wan2.1's attention head width (1.3B: 12 x 128, 14B: 40 x 128); the weights do not record it.
WAN_HEAD_DIM = 128
_BLOCK = re.compile(r"blocks\.(\d+)\.")


def read_transformer(path: str | Path, *, ema: bool = True) -> TransformerState:
    """A transformer checkpoint file, or a Diffusers ``transformer/`` folder (with its config.json)."""
    path = Path(path)
    state = transformer_state(read_tensors(path, ema=ema), str(path), keep=(ACTION_PREFIX,))
    state.file_config = config_beside(path, file_too=False)
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
            f"(keys start: {sorted(v for v in state.user_names.values() if not v.startswith(ACTION_PREFIX))[:6]})",
            path=state.source,
        ) from None
    config = state.file_config or {}
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
    weights = {k: v for k, v in state.tensors.items() if not k.startswith(ACTION_PREFIX)}
    found = {k[len(ACTION_PREFIX) :]: v for k, v in state.tensors.items() if k.startswith(ACTION_PREFIX)}
    load_renamed(
        transformer,
        weights,
        state.user_names,
        original=original_layout(config) if state.layout == "original" else None,
        where=state.source,
        part=f"the file ({state.layout} layout, config {config.name})",
    )
    if found:
        wanted = {k: tuple(v.shape) for k, v in actions.state_dict().items()}
        check_shapes(
            found,
            wanted,
            where=state.source,
            part="its action embedding",
            user_name=lambda k: ACTION_PREFIX + k,
        )
        actions.load_state_dict(found, strict=True)
    return bool(found)
