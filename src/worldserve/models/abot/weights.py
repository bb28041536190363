"""Which weights ``abot-world`` runs with, from which files: its folder as published, resolved and loaded.

Owns: :data:`PUBLISHED` (the names in ABot-World's checkpoint folder, ``ABot-World-0-5B-LF``:
``diffusion_pytorch_model.safetensors``, ``Wan2.2_VAE.pth``, ``models_t5_umt5-xxl-enc-bf16.pth``,
``google/umt5-xxl/``; ``taew2_2.pth`` is the decoder's, found by ``decoder=taehv``), :data:`PART_NAMES`
and :func:`expected` (a part's name in errors and what its loader expects),
:class:`ABotWeightOptions` (``weights=DIR``, the per-part overrides ``checkpoint=``, ``vae=``,
``text_encoder=``, ``tokenizer=``, ``load=dummy``, ``text=hashed``), :func:`find_parts` and
:func:`load_abot_weights` (build the modules of the configuration asked for, ``5b`` by default with
weights and ``tiny`` without, and load every part strictly, every error naming the part, its file
and what was expected). The rules are wan-causal's: a trained checkpoint needs its text encoder
unless ``text=hashed``, and its VAE (the start image's encoder) always; random weights
(``load=dummy``) take the stand-ins and say so. Must not know: sessions, the sampler, caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worldserve.models.abot.checkpoint import build_adapter, load_checkpoint, read_checkpoint
from worldserve.models.abot.config import ABotConfig, get_config
from worldserve.models.abot.control_adapter import ControlAdapter
from worldserve.models.wan.build import build_transformer, build_vae, seeded_init
from worldserve.models.wan.files import expected_from, single_candidate, walk_published
from worldserve.models.wan.statedict import WeightsError, part_errors, weights_digest
from worldserve.models.wan.t5 import load_text_encoder, load_tokenizer
from worldserve.models.wan.vaeweights import load_vae_part

__all__ = [
    "PART_NAMES",
    "PUBLISHED",
    "ABotParts",
    "ABotWeightOptions",
    "LoadedABot",
    "expected",
    "find_parts",
    "load_abot_weights",
]

_MODEL = "abot-world"

#: Published names in ABot-World's checkpoint folder -> part (``README.md``, ``configs/*.yaml``). Folders end in "/".
PUBLISHED: dict[str, tuple[str, str | None]] = {
    "diffusion_pytorch_model.safetensors": ("transformer", None),
    "diffusion_pytorch_model.safetensors.index.json": ("transformer", None),
    "Wan2.2_VAE.pth": ("vae", None),
    "models_t5_umt5-xxl-enc-bf16.pth": ("text_encoder", None),
    "umt5-xxl/": ("tokenizer", None),
}
_WHAT = {
    "transformer": "ABot-World's transformer (Wan2.2-TI2V-5B with the control adapter)",
    "vae": "Wan2.2's VAE",
    "text_encoder": "Wan's UMT5 text encoder",
    "tokenizer": "the UMT5 tokenizer folder",
}
PART_NAMES = {"transformer": "transformer", "vae": "VAE", "text_encoder": "text encoder", "tokenizer": "tokenizer"}


@dataclass(frozen=True, slots=True)
class ABotWeightOptions:
    """The weight options as the user gave them (paths as strings; None: not given)."""

    config: str | ABotConfig | None = None
    weights: str | None = None
    checkpoint: str | None = None
    vae: str | None = None
    text_encoder: str | None = None
    tokenizer: str | None = None
    load: str | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.config, str):
            get_config(self.config)  # an unknown size is refused before anything loads
        if self.load not in (None, "dummy", "checkpoint"):
            raise ValueError(f"{_MODEL} option load must be 'dummy' or 'checkpoint'; got {self.load!r}.")
        if self.text not in (None, "hashed", "encoder"):
            raise ValueError(f"{_MODEL} option text must be 'hashed' or 'encoder'; got {self.text!r}.")
        if self.load == "dummy" and (self.checkpoint is not None or self.weights is not None):
            raise ValueError(f"{_MODEL} takes load=dummy or checkpoint=PATH / weights=DIR, not both.")
        if self.text == "hashed" and (self.text_encoder is not None or self.tokenizer is not None):
            raise ValueError(f"{_MODEL} takes text=hashed or text_encoder=PATH, not both.")


@dataclass(slots=True)
class ABotParts:
    """The parts picked (None: not found) and every candidate by part."""

    transformer: Path | None = None
    vae: Path | None = None
    text_encoder: Path | None = None
    tokenizer: Path | None = None
    candidates: dict[str, list[Path]] = field(default_factory=dict)


def _kind(path: Path) -> tuple[str, str | None] | None:
    name = path.name + ("/" if path.is_dir() else "")
    if name.startswith("diffusion_pytorch_model") and name.endswith(".safetensors"):
        return ("transformer", None)  # the file, or one of its shards
    return PUBLISHED.get(name)


def find_parts(folder: str | Path) -> ABotParts:
    """The parts under ``folder`` by their published names (several candidates for one: an error listing them)."""
    folder = Path(folder)
    parts = ABotParts()
    for path, (part, _) in walk_published(folder, _kind):
        if part == "transformer" and path.name != "diffusion_pytorch_model.safetensors":
            path = path.parent  # shards and their index: read as the folder
        if path not in parts.candidates.setdefault(part, []):
            parts.candidates[part].append(path)
    for part in ("transformer", "vae", "text_encoder", "tokenizer"):
        setattr(parts, part, single_candidate(folder, parts.candidates, part))
    return parts


def expected(part: str) -> str:
    """What a part's loader expects (its published name and what it is), for errors and ``worldserve inspect``."""
    return expected_from(PUBLISHED, part, _WHAT[part])


def _loading(part: str, path: Path) -> Any:
    return part_errors(PART_NAMES[part], path, expected(part))


def _resolve(options: ABotWeightOptions) -> ABotParts:
    parts = find_parts(options.weights) if options.weights is not None else ABotParts()
    for part in ("checkpoint", "vae", "text_encoder", "tokenizer"):
        value = getattr(options, part)
        if value is not None:
            setattr(parts, "transformer" if part == "checkpoint" else part, Path(value))
    if options.text == "hashed":
        parts.text_encoder = parts.tokenizer = None
    if options.weights is not None and parts.transformer is None:
        raise WeightsError(
            f"weights={options.weights}: no diffusion_pytorch_model.safetensors under it (ABot-World-0-5B-LF's "
            "transformer); pass checkpoint=PATH."
        )
    if options.load == "checkpoint" and parts.transformer is None:
        raise ValueError(f"{_MODEL} load=checkpoint needs checkpoint=PATH or weights=DIR.")
    return parts


@dataclass(slots=True)
class LoadedABot:
    """The modules, built and loaded, and what they were loaded from (for the description and the version)."""

    config: ABotConfig
    transformer: nn.Module
    adapter: ControlAdapter
    vae: nn.Module
    text_encoder: Any
    tokenizer: Any
    parts: ABotParts
    dummy: bool
    version: str


def load_abot_weights(
    options: ABotWeightOptions, device: torch.device, seed: int, text_dtype: torch.dtype
) -> LoadedABot:
    """Resolve, build and load; random initialisation is seeded by ``seed``."""
    parts = _resolve(options)
    dummy = parts.transformer is None
    named = options.config if options.config is not None else ("tiny" if dummy else "5b")
    config = get_config(named) if isinstance(named, str) else named
    if dummy and options.load is None and config.wan.name != "abot-tiny":
        raise ValueError(
            f"{_MODEL} config {options.config!r} needs weights=DIR (ABot-World-0-5B-LF's folder) or checkpoint=PATH, "
            "or load=dummy for random weights; nothing downloads."
        )
    if not dummy:
        if parts.vae is None:
            raise WeightsError(
                f"{parts.transformer}: a trained checkpoint needs its VAE (the start image's encoder): vae=PATH "
                "(Wan2.2_VAE.pth), or weights=DIR holding it."
            )
        if parts.text_encoder is None and options.text != "hashed":
            raise WeightsError(
                f"{parts.transformer}: a trained checkpoint needs its text encoder: text_encoder=PATH "
                "(models_t5_umt5-xxl-enc-bf16.pth) and tokenizer=DIR (google/umt5-xxl/), or weights=DIR holding "
                "them; text=hashed runs it on the hashed-word stand-in instead."
            )
    if parts.text_encoder is not None and parts.tokenizer is None:
        raise WeightsError(
            f"{parts.text_encoder}: the text encoder needs its tokenizer: tokenizer=DIR (google/umt5-xxl/)."
        )
    with seeded_init(device, seed):  # the caller's RNG stays as it was
        transformer = build_transformer(config.wan)
        adapter = build_adapter(config)
        autoencoder = build_vae(config.wan)
    if parts.transformer is not None:
        with _loading("transformer", parts.transformer):
            load_checkpoint(read_checkpoint(parts.transformer), transformer, adapter, config)
    if parts.vae is not None:
        load_vae_part(parts.vae, autoencoder, config.wan)
    encoder = tokenizer = None
    if parts.text_encoder is not None:
        with _loading("text_encoder", parts.text_encoder):
            encoder = load_text_encoder(parts.text_encoder, text_dtype)
            width = int(encoder.config.d_model)
            if width != config.wan.text_dim:
                raise WeightsError(f"an encoder of {width}-dim states; the transformer takes {config.wan.text_dim}")
        assert parts.tokenizer is not None
        with _loading("tokenizer", parts.tokenizer):
            tokenizer = load_tokenizer(parts.tokenizer)
    if parts.transformer is None:
        version = f"{config.wan.name}:dummy-seed-{seed}"
    else:
        version = f"{config.wan.name}:sha256:{weights_digest(parts.transformer)}"
    return LoadedABot(config, transformer, adapter, autoencoder, encoder, tokenizer, parts, dummy, version)
