"""Which weights the model runs with, from which files: the options a user gives, resolved and loaded.

Owns: :class:`WeightOptions` (``weights=DIR``, the per-part overrides ``checkpoint=``,
``vae=``, ``text_encoder=``, ``tokenizer=``, ``lora=``, and ``load=dummy``, ``text=hashed``,
``vae=random``, ``ema=``), :func:`resolve` (the parts found by their published names, the
per-part options winning; the family a checkpoint's published name implies) and
:func:`load_weights` (build the diffusers modules of the configuration the checkpoint's
shapes name, or the one asked for, and load every part strictly; every error reading or
loading a part names the part, its file and what was expected: :func:`loading`). The rules: a trained
checkpoint without a text encoder is an error unless ``text=hashed`` is given, and without a
VAE unless ``vae=random`` is given (random weights, ``load=dummy``, take both stand-ins by
default and say so). Must not know: sessions, the sampler, caches.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worldserve.models.wan.build import build_transformer, build_vae, seeded_init
from worldserve.models.wan.checkpoint import TransformerState
from worldserve.models.wan.config import WanCausalConfig, get_config
from worldserve.models.wan.statedict import WeightsError, part_errors, weights_digest
from worldserve.models.wan.t5 import TOKENIZER_FILES, load_text_encoder, load_tokenizer
from worldserve.models.wan.vaeweights import load_vae_weights
from worldserve.models.wancausal.actions import ActionEmbedding
from worldserve.models.wancausal.checkpoint import infer_config, load_transformer, merge_lora, read_transformer
from worldserve.models.wancausal.families import Family, get_family, guess_family
from worldserve.models.wancausal.files import PART_NAMES, Parts, expected, find_parts

__all__ = ["LoadedWeights", "WeightOptions", "load_weights", "loading", "resolve"]


@dataclass(frozen=True, slots=True)
class WeightOptions:
    """The weight options as the user gave them (paths as strings; None: not given)."""

    config: str | WanCausalConfig | None = None
    weights: str | None = None
    checkpoint: str | None = None
    vae: str | None = None
    text_encoder: str | None = None
    tokenizer: str | None = None
    lora: str | None = None
    lora_alpha: float | None = None
    load: str | None = None
    text: str | None = None
    ema: bool | None = None
    family: str | None = None

    def __post_init__(self) -> None:
        if self.family is not None:
            get_family(self.family)  # an unknown family is refused before anything loads
        if self.load not in (None, "dummy", "checkpoint"):
            raise ValueError(f"wan-causal option load must be 'dummy' or 'checkpoint'; got {self.load!r}.")
        if self.text not in (None, "hashed", "encoder"):
            raise ValueError(f"wan-causal option text must be 'hashed' or 'encoder'; got {self.text!r}.")
        if self.load == "dummy" and (self.checkpoint is not None or self.weights is not None):
            raise ValueError("wan-causal takes load=dummy or checkpoint=PATH / weights=DIR, not both.")
        if self.text == "hashed" and (self.text_encoder is not None or self.tokenizer is not None):
            raise ValueError("wan-causal takes text=hashed or text_encoder=PATH, not both.")


def _tokenizer_in(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).exists() for name in TOKENIZER_FILES)


def loading(part: str, path: Path) -> AbstractContextManager[None]:
    """Errors inside name ``part`` (``transformer``, ``vae``, ``text_encoder``, ``tokenizer``, ``lora``),
    its file ``path`` and what wan-causal expects there."""
    return part_errors(PART_NAMES[part], path, expected(part))


def resolve(options: WeightOptions) -> Parts:
    """The parts to load: found under ``weights=`` by their published names, the per-part options winning."""
    parts = find_parts(options.weights, options.family) if options.weights is not None else Parts()
    for part in ("checkpoint", "vae", "text_encoder", "tokenizer", "lora"):
        value = getattr(options, part)
        if value is None or (part == "vae" and value == "random"):
            continue
        setattr(parts, "transformer" if part == "checkpoint" else part, Path(value))
    if options.vae == "random":
        parts.vae = None
    if options.text == "hashed":
        parts.text_encoder = parts.tokenizer = None
    if parts.text_encoder is not None and parts.tokenizer is None and _tokenizer_in(parts.text_encoder):
        parts.tokenizer = parts.text_encoder  # one folder holding both (transformers' save_pretrained of each)
    if options.weights is not None and parts.transformer is None:
        raise WeightsError(
            f"weights={options.weights}: no transformer checkpoint under it by a published name (self_forcing_dmd.pt, "
            "model.pt, longlive_base.pt, krea-realtime-video-14b.safetensors, diffusion_pytorch_model*.safetensors, "
            "transformer/); pass checkpoint=PATH."
        )
    if options.load == "checkpoint" and parts.transformer is None:
        raise ValueError("wan-causal load=checkpoint needs checkpoint=PATH or weights=DIR.")
    return parts


@dataclass(slots=True)
class LoadedWeights:
    """The modules, built and loaded, and what they were loaded from (for the description)."""

    family: Family
    config: WanCausalConfig
    transformer: nn.Module
    actions: ActionEmbedding
    vae: nn.Module
    text_encoder: Any
    tokenizer: Any
    parts: Parts
    dummy: bool
    action_from_checkpoint: bool
    version: str

    @property
    def vae_from_file(self) -> bool:
        return self.parts.vae is not None


def load_weights(options: WeightOptions, device: torch.device, seed: int, text_dtype: torch.dtype) -> LoadedWeights:
    """Resolve, build and load; random initialisation (diffusers') is seeded by ``seed``."""
    parts = resolve(options)
    named = options.family or parts.family
    state: TransformerState | None = None
    inferred: WanCausalConfig | None = None
    if parts.transformer is not None:
        ema = options.ema if options.ema is not None else (get_family(named).ema if named else True)
        with loading("transformer", parts.transformer):
            state = read_transformer(parts.transformer, ema=ema)
            inferred = infer_config(state) if options.config is None else None
        if parts.lora is not None:
            with loading("lora", parts.lora):
                merge_lora(state, parts.lora, options.lora_alpha)
    if options.config is None:
        config = inferred if inferred is not None else get_config("tiny")
    else:
        config = get_config(options.config) if isinstance(options.config, str) else options.config
    dummy = state is None
    if dummy and options.load is None and config.name != "tiny":
        raise ValueError(
            f"wan-causal config {config.name!r} needs weights=DIR or checkpoint=PATH (a Self-Forcing, CausVid, "
            "LongLive or Krea checkpoint, or Wan2.1's own), or load=dummy for random weights; nothing downloads."
        )
    if not dummy:
        if parts.text_encoder is None and options.text != "hashed":
            raise WeightsError(
                f"{parts.transformer}: a trained checkpoint needs its text encoder: text_encoder=PATH "
                "(models_t5_umt5-xxl-enc-bf16.pth, or a Diffusers text_encoder/ folder) and tokenizer=DIR, or "
                "weights=DIR holding them; text=hashed runs it on the hashed-word stand-in instead."
            )
        if parts.vae is None and options.vae != "random":
            raise WeightsError(
                f"{parts.transformer}: a trained checkpoint needs its VAE: vae=PATH (Wan2.1_VAE.pth, or a Diffusers "
                "vae/ folder), or weights=DIR holding it; vae=random decodes with random weights instead."
            )
    if parts.text_encoder is not None and parts.tokenizer is None:
        raise WeightsError(
            f"{parts.text_encoder}: the text encoder needs its tokenizer: tokenizer=DIR (Wan's google/umt5-xxl/ "
            "or a Diffusers tokenizer/ folder)."
        )
    with seeded_init(device, seed):  # the caller's RNG stays as it was
        transformer = build_transformer(config)
        actions = ActionEmbedding(config.action_dim, config.dim)
        autoencoder = build_vae(config)
    action_from_checkpoint = False
    if state is not None:
        assert parts.transformer is not None
        with loading("transformer", parts.transformer):
            action_from_checkpoint = load_transformer(state, transformer, actions, config)
    if parts.vae is not None:
        with loading("vae", parts.vae):
            load_vae_weights(parts.vae, autoencoder, config)
    encoder = tokenizer = None
    if parts.text_encoder is not None:
        with loading("text_encoder", parts.text_encoder):
            encoder = load_text_encoder(parts.text_encoder, text_dtype)
            width = int(encoder.config.d_model)
            if width != config.text_dim:
                raise WeightsError(
                    f"an encoder of {width}-dim states; the transformer (config {config.name}) takes {config.text_dim}"
                )
        assert parts.tokenizer is not None
        with loading("tokenizer", parts.tokenizer):
            tokenizer = load_tokenizer(parts.tokenizer)
    if state is None:
        version = f"{config.name}:dummy-seed-{seed}"
    else:
        assert parts.transformer is not None
        version = f"{config.name}:sha256:{weights_digest(parts.transformer)}"
        if parts.lora is not None:
            version += f"+lora:{weights_digest(parts.lora)}"
    return LoadedWeights(
        family=get_family(guess_family(config.name, named)),
        config=config,
        transformer=transformer,
        actions=actions,
        vae=autoencoder,
        text_encoder=encoder,
        tokenizer=tokenizer,
        parts=parts,
        dummy=dummy,
        action_from_checkpoint=action_from_checkpoint,
        version=version,
    )
