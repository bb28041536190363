"""The UMT5 text encoder as Wan2.1 publishes it, or as a Diffusers/transformers folder, and its tokenizer.

Owns: :func:`original_t5_layout` (the key names and shapes of Wan's own T5 encoder,
``wan/modules/t5.py``: ``token_embedding``, ``blocks.N.attn.{q,k,v,o}``,
``blocks.N.pos_embedding.embedding`` (one relative-position table per layer: umt5),
``blocks.N.ffn.{gate.0,fc1,fc2}``, ``blocks.N.norm1/norm2``, ``norm``), :func:`umt5_names`
(the key-by-key mapping onto transformers' ``UMT5EncoderModel``: transformers has no
conversion for this file, so it is written here and tested key by key and forward for forward),
:func:`load_text_encoder` (``models_t5_umt5-xxl-enc-bf16.pth``, a transformers folder such as a
Diffusers snapshot's ``text_encoder/``, or one folder holding encoder and tokenizer) and
:func:`load_tokenizer` / :func:`clean_prompt` (Wan's ``clean='whitespace'``: HTML entities
unescaped twice, runs of whitespace collapsed; ftfy's mojibake repair is not applied). The
architecture is read from the weights' shapes (vocabulary, width, layers, FFN width, heads
from the relative-position table), so nothing is downloaded. Must not know: the transformer,
sessions.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from worldserve.models.wan.statedict import WeightsError, check_shapes, one_line, read_tensors

__all__ = ["TOKENIZER_FILES", "clean_prompt", "load_text_encoder", "load_tokenizer", "original_t5_layout", "umt5_names"]

_BLOCK = re.compile(r"blocks\.(\d+)\.")
#: The files a tokenizer folder holds one of (transformers' fast tokenizer, sentencepiece's model, the config).
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json")
_SPACE = re.compile(r"\s+")


def clean_prompt(text: str) -> str:
    """Wan's ``whitespace`` cleaning of a prompt (without ftfy)."""
    return _SPACE.sub(" ", html.unescape(html.unescape(text)).strip()).strip()


def original_t5_layout(
    vocab: int, dim: int, dim_attn: int, dim_ffn: int, heads: int, layers: int, buckets: int
) -> dict[str, tuple[int, ...]]:
    """Wan's ``T5Encoder`` (``shared_pos=False``, as ``umt5_xxl``) parameters by name."""
    shapes: dict[str, tuple[int, ...]] = {"token_embedding.weight": (vocab, dim)}
    for i in range(layers):
        shapes[f"blocks.{i}.norm1.weight"] = (dim,)
        for proj in "qkv":
            shapes[f"blocks.{i}.attn.{proj}.weight"] = (dim_attn, dim)
        shapes[f"blocks.{i}.attn.o.weight"] = (dim, dim_attn)
        shapes[f"blocks.{i}.norm2.weight"] = (dim,)
        shapes[f"blocks.{i}.ffn.gate.0.weight"] = (dim_ffn, dim)
        shapes[f"blocks.{i}.ffn.fc1.weight"] = (dim_ffn, dim)
        shapes[f"blocks.{i}.ffn.fc2.weight"] = (dim, dim_ffn)
        shapes[f"blocks.{i}.pos_embedding.embedding.weight"] = (buckets, heads)
    shapes["norm.weight"] = (dim,)
    return shapes


def umt5_names(layers: int) -> dict[str, str]:
    """Original Wan T5 key -> ``UMT5EncoderModel`` key.

    Wan's feed-forward is ``fc2(fc1(x) * gelu_tanh(gate(x)))``; transformers' gated one is
    ``wo(act(wi_0(x)) * wi_1(x))``, so ``gate.0`` is ``wi_0`` and ``fc1`` is ``wi_1``.
    """
    names = {"token_embedding.weight": "shared.weight", "norm.weight": "encoder.final_layer_norm.weight"}
    for i in range(layers):
        attn = f"encoder.block.{i}.layer.0"
        ffn = f"encoder.block.{i}.layer.1"
        names[f"blocks.{i}.norm1.weight"] = f"{attn}.layer_norm.weight"
        for proj in "qkvo":
            names[f"blocks.{i}.attn.{proj}.weight"] = f"{attn}.SelfAttention.{proj}.weight"
        names[f"blocks.{i}.pos_embedding.embedding.weight"] = f"{attn}.SelfAttention.relative_attention_bias.weight"
        names[f"blocks.{i}.norm2.weight"] = f"{ffn}.layer_norm.weight"
        names[f"blocks.{i}.ffn.gate.0.weight"] = f"{ffn}.DenseReluDense.wi_0.weight"
        names[f"blocks.{i}.ffn.fc1.weight"] = f"{ffn}.DenseReluDense.wi_1.weight"
        names[f"blocks.{i}.ffn.fc2.weight"] = f"{ffn}.DenseReluDense.wo.weight"
    return names


def _original_sizes(raw: Mapping[str, Tensor], where: str) -> dict[str, int]:
    try:
        vocab, dim = raw["token_embedding.weight"].shape
        buckets, heads = raw["blocks.0.pos_embedding.embedding.weight"].shape
        dim_attn = raw["blocks.0.attn.q.weight"].shape[0]
        dim_ffn = raw["blocks.0.ffn.fc1.weight"].shape[0]
    except KeyError as error:
        raise WeightsError(
            f"it lacks {error.args[0]!r}: not Wan's T5 layout (models_t5_umt5-xxl-enc-bf16.pth; "
            f"keys start: {sorted(raw)[:5]})",
            path=where,
        ) from None
    layers = len({int(m.group(1)) for k in raw if (m := _BLOCK.match(k))})
    return {
        "vocab": int(vocab),
        "dim": int(dim),
        "dim_attn": int(dim_attn),
        "dim_ffn": int(dim_ffn),
        "heads": int(heads),
        "layers": layers,
        "buckets": int(buckets),
    }


def _from_original(path: Path, dtype: torch.dtype) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    raw = read_tensors(path, unwrap=False)
    sizes = _original_sizes(raw, str(path))
    check_shapes(raw, original_t5_layout(**sizes), where=str(path), part="the file (Wan T5 layout)")
    config = UMT5Config(
        vocab_size=sizes["vocab"],
        d_model=sizes["dim"],
        d_kv=sizes["dim_attn"] // sizes["heads"],
        d_ff=sizes["dim_ffn"],
        num_layers=sizes["layers"],
        num_heads=sizes["heads"],
        relative_attention_num_buckets=sizes["buckets"],
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        dropout_rate=0.0,
    )
    with torch.device("meta"):  # no second copy of a 5.7 B-parameter encoder in memory
        model = UMT5EncoderModel(config)
    names = umt5_names(sizes["layers"])
    state = {names[key]: value.to(dtype) for key, value in raw.items()}
    state["encoder.embed_tokens.weight"] = state["shared.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model


def _is_transformers_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists()


def load_text_encoder(path: str | Path, dtype: torch.dtype) -> Any:
    """A ``UMT5EncoderModel`` from Wan's ``.pth`` or a transformers folder (``text_encoder/``), local only."""
    path = Path(path)
    if not path.exists():
        raise WeightsError("no such file or folder", path=path)
    if _is_transformers_folder(path):
        from transformers import UMT5EncoderModel

        try:
            return UMT5EncoderModel.from_pretrained(str(path), local_files_only=True, torch_dtype=dtype)
        except (OSError, ValueError) as error:
            raise WeightsError(
                f"not a loadable transformers UMT5 encoder folder ({one_line(error)})", path=path
            ) from None
    if path.is_dir():
        raise WeightsError(
            "a folder without a transformers config.json (a Diffusers snapshot's text_encoder/ has one); "
            "or pass Wan's models_t5_umt5-xxl-enc-bf16.pth file",
            path=path,
        )
    return _from_original(path, dtype)


def load_tokenizer(path: str | Path) -> Any:
    """A local tokenizer folder (Wan's ``google/umt5-xxl/``, or a Diffusers snapshot's ``tokenizer/``)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise WeightsError("no such folder", path=path)
    if not path.is_dir():
        raise WeightsError("a file, not a folder: a tokenizer is a folder (google/umt5-xxl/ or tokenizer/)", path=path)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise WeightsError(f"a folder with none of {', '.join(TOKENIZER_FILES)}", path=path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # transformers and tokenizers raise many kinds (JSON, Rust, sentencepiece)
        raise WeightsError(f"not a loadable tokenizer folder ({one_line(error)})", path=path) from None
