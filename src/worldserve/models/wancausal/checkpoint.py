"""Self-Forcing / CausVid checkpoints (original Wan2.1 key names) -> the diffusers modules.

Owns: :func:`diffusers_key` (one original key -> its ``SkyReelsV2Transformer3DModel``
name), :func:`read_state_dict` (safetensors or a torch file; unwraps ``generator_ema`` /
``generator`` / ``model`` / ``state_dict``, strips the ``model.`` and ``module.`` prefixes
and drops the ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.`` parts training
wrappers add) and :func:`load_checkpoint`
(maps every key, loads strictly: any key left unmapped, missing or unexpected is an error
that names it). The action embedding's weights, if the checkpoint has them, are under
``action_embedding.linear_1.weight`` and ``action_embedding.linear_2.weight``; without
them it stays random-initialised and the report says so. Must not know: sessions, the
sampler, caches.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["CheckpointReport", "diffusers_key", "load_checkpoint", "read_state_dict"]

_WB = ("weight", "bias")

#: Top-level modules: original prefix -> diffusers prefix.
_TOP = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
}
#: Inside ``blocks.N.``: original prefix -> diffusers prefix (``norm3`` is the affine
#: cross-attention norm, diffusers' ``norm2``).
_BLOCK = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "norm3": "norm2",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_BLOCK_WEIGHT_ONLY = {
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
}
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")
_WRAPPERS = ("generator_ema", "generator", "model", "state_dict")
_PREFIXES = ("module.", "model.")
#: Module names FSDP and activation checkpointing insert anywhere in a key.
_INNER_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
ACTION_PREFIX = "action_embedding."


def diffusers_key(original: str) -> str | None:
    """The transformer's parameter name for an original Wan2.1 key, or None if it has none."""
    if original == "head.modulation":
        return "scale_shift_table"
    for prefix, target in _TOP.items():
        for kind in _WB:
            if original == f"{prefix}.{kind}":
                return f"{target}.{kind}"
    match = _BLOCK_KEY.fullmatch(original)
    if match is None:
        return None
    index, rest = match.groups()
    if rest == "modulation":
        return f"blocks.{index}.scale_shift_table"
    for prefix, target in _BLOCK.items():
        for kind in _WB:
            if rest == f"{prefix}.{kind}":
                return f"blocks.{index}.{target}.{kind}"
    for prefix, target in _BLOCK_WEIGHT_ONLY.items():
        if rest == f"{prefix}.weight":
            return f"blocks.{index}.{target}.weight"
    return None


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """A checkpoint's tensors with training wrappers and prefixes removed."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw: object = load_file(str(path))
    else:
        raw = torch.load(str(path), map_location="cpu", weights_only=True)
    while isinstance(raw, Mapping) and not any(isinstance(v, Tensor) for v in raw.values()):
        for wrapper in _WRAPPERS:
            if wrapper in raw:
                raw = raw[wrapper]
                break
        else:
            raise ValueError(f"{path}: no state dict found (top-level keys: {sorted(raw)[:10]}).")
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: expected a mapping of tensors; got {type(raw).__name__}.")
    out: dict[str, Tensor] = {}
    for key, value in raw.items():
        if not isinstance(value, Tensor):
            continue
        name = str(key)
        for wrapper in _INNER_WRAPPERS:
            name = name.replace(wrapper, "")
        stripped = True
        while stripped:
            stripped = False
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    stripped = True
        out[name] = value
    return out


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    mapped: int
    action_from_checkpoint: bool


def load_checkpoint(path: str | Path, transformer: nn.Module, actions: nn.Module) -> CheckpointReport:
    """Load ``path`` into ``transformer`` (and ``actions`` if present); every key must map."""
    state = read_state_dict(path)
    mapped: dict[str, Tensor] = {}
    action_state: dict[str, Tensor] = {}
    unmapped: list[str] = []
    for key, value in state.items():
        if key.startswith(ACTION_PREFIX):
            action_state[key[len(ACTION_PREFIX) :]] = value
            continue
        target = diffusers_key(key)
        if target is None:
            unmapped.append(key)
        else:
            mapped[target] = value
    expected = set(transformer.state_dict())
    missing = sorted(expected - set(mapped))
    unexpected = sorted(set(mapped) - expected)
    if unmapped or missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not fit the model: unmapped {unmapped[:8]} ({len(unmapped)}), "
            f"missing {missing[:8]} ({len(missing)}), unexpected {unexpected[:8]} ({len(unexpected)})."
        )
    transformer.load_state_dict(mapped, strict=True)
    if action_state:
        actions.load_state_dict(action_state, strict=True)
    return CheckpointReport(mapped=len(mapped), action_from_checkpoint=bool(action_state))
