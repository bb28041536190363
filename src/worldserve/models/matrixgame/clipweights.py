"""The image encoder's weights as published: Wan's OpenCLIP file, or a transformers ``image_encoder/`` folder.

Owns: :func:`load_image_encoder_weights` (a file or folder in either layout -> transformers'
``CLIPVisionModel``; strict, with shapes; errors name the user's key) and :func:`clip_layout_of`.
Wan's ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`` (``wan/modules/clip.py``) holds
the whole XLM-RoBERTa CLIP; only its vision tower (``visual.*``) is read, mapped here (nothing in
transformers converts it): ``cls_embedding`` -> ``embeddings.class_embedding``, ``pos_embedding``
-> ``embeddings.position_embedding.weight``, ``patch_embedding`` (no bias) ->
``embeddings.patch_embedding``, ``pre_norm``/``post_norm`` -> ``pre_layrnorm``/``post_layernorm``,
``transformer.N.attn.to_qkv`` -> the layer's ``q_proj``/``k_proj``/``v_proj`` (split in three),
``attn.proj`` -> ``out_proj``, ``norm1``/``norm2`` -> ``layer_norm1``/``layer_norm2``, ``mlp.0``/
``mlp.2`` -> ``mlp.fc1``/``mlp.fc2``. The projection head (``visual.head``) and the text tower are
not used (Matrix-Game reads the hidden states before the last block). Must not know: the
transformer, sessions.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from worldserve.models.wan.statedict import WeightsError, check_shapes, read_tensors

__all__ = ["clip_layout_of", "load_image_encoder_weights", "wan_clip_name"]

_VISION_PREFIX = "vision_model."
_LAYER_PARTS = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.proj": "self_attn.out_proj",
    "mlp.0": "mlp.fc1",
    "mlp.2": "mlp.fc2",
}


def clip_layout_of(keys: Mapping[str, object]) -> str:
    """``"wan"`` (OpenCLIP names, ``visual.*``) or ``"transformers"`` (``CLIPVisionModel``'s)."""
    return "wan" if any(k.startswith("visual.") for k in keys) else "transformers"


def wan_clip_name(name: str) -> str:
    """The Wan/OpenCLIP name a ``CLIPVisionModel`` parameter (unprefixed) comes from (q/k/v: the fused ``to_qkv``)."""
    fixed = {
        "embeddings.class_embedding": "visual.cls_embedding",
        "embeddings.position_embedding.weight": "visual.pos_embedding",
        "embeddings.patch_embedding.weight": "visual.patch_embedding.weight",
    }
    if name in fixed:
        return fixed[name]
    for ours, theirs in (("pre_layrnorm.", "visual.pre_norm."), ("post_layernorm.", "visual.post_norm.")):
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    parts = name.split(".")
    if parts[:2] == ["encoder", "layers"]:
        index, rest = parts[2], ".".join(parts[3:])
        prefix = f"visual.transformer.{index}."
        for projection in ("q_proj", "k_proj", "v_proj"):
            if rest.startswith(f"self_attn.{projection}."):
                return prefix + "attn.to_qkv." + rest.split(".")[-1]
        for theirs, ours in _LAYER_PARTS.items():
            if rest.startswith(ours + "."):
                return prefix + theirs + rest[len(ours) :]
    raise KeyError(name)


def _from_wan(raw: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]], where: str) -> dict[str, Tensor]:
    """Wan's OpenCLIP tensors under ``CLIPVisionModel``'s (unprefixed) names."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for name, shape in expected.items():
        source = wan_clip_name(name)
        tensor = raw.get(source)
        if tensor is None:
            continue  # reported missing by the shape check, in Wan's name
        used.add(source)
        if source.endswith("to_qkv.weight") or source.endswith("to_qkv.bias"):
            which = ("q_proj", "k_proj", "v_proj").index(name.split(".")[-2])
            if tensor.shape[0] % 3:
                raise WeightsError(f"{source} {tuple(tensor.shape)} does not split into q, k and v", path=where)
            tensor = tensor.chunk(3, dim=0)[which]
        elif source in ("visual.cls_embedding", "visual.pos_embedding"):
            tensor = tensor.reshape(shape) if tensor.numel() == torch.Size(shape).numel() else tensor
        out[name] = tensor
    unexpected = sorted(k for k in raw if k.startswith("visual.") and k not in used and k != "visual.head")
    for key in unexpected:
        out[key] = raw[key]  # the shape check names it as not in the model
    return out


def load_image_encoder_weights(path: str | Path, model: nn.Module, where_config: str) -> str:
    """Load a file or folder (Wan's OpenCLIP ``.pth``, or a transformers ``image_encoder/``) into ``model``;
    returns the layout. ``where_config`` names the configuration in the errors."""
    raw = read_tensors(path, unwrap=False)
    state = model.state_dict()
    prefix = _VISION_PREFIX if any(k.startswith(_VISION_PREFIX) for k in state) else ""
    expected = {k.removeprefix(prefix): tuple(v.shape) for k, v in state.items()}
    layout = clip_layout_of(raw)
    names: dict[str, str] = {}
    if layout == "wan":
        tensors = _from_wan(raw, expected, str(path))
        names = {name: wan_clip_name(name) for name in expected}
    else:
        tensors = {k.removeprefix(_VISION_PREFIX): v for k, v in raw.items()}
        tensors.pop("embeddings.position_ids", None)  # a buffer older transformers saved
        file_prefix = _VISION_PREFIX if any(k.startswith(_VISION_PREFIX) for k in raw) else ""
        names = {k: file_prefix + k for k in expected}
    check_shapes(
        tensors,
        expected,
        where=str(path),
        part=f"the file ({'Wan OpenCLIP' if layout == 'wan' else 'transformers CLIPVisionModel'} layout, "
        f"config {where_config})",
        user_name=lambda key: names.get(key, key),
    )
    with torch.no_grad():
        model.load_state_dict({prefix + k: v for k, v in tensors.items()}, strict=True)
    return layout
