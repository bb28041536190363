"""Which weights ``matrix-game-2`` runs with, from which files: the options a user gives, resolved and loaded.

Owns: :class:`MatrixWeightOptions` (``weights=DIR``, the per-part overrides ``checkpoint=``,
``vae=``, ``image_encoder=``, ``load=dummy``, ``vae=random``, ``image_encoder=random``,
``variant=``, ``config=``), :class:`LoadedMatrix` and :func:`load_matrix`: build the modules of
the size and variant the checkpoint's shapes name (or the ones asked for) and load every part
strictly. The rules: a trained checkpoint without its VAE or its image encoder is an error unless
``vae=random`` / ``image_encoder=random`` is given (random weights, ``load=dummy``, take both
stand-ins by default and say so); a ``vae=`` or ``image_encoder=`` file given with random
transformer weights is loaded all the same; a variant asked for must be the one the checkpoint's shapes
say. Must not know: sessions, the sampler, caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from worldserve.models.matrixgame.config import CONFIGS, MatrixGameConfig, Variant, get_variant, matrix_config
from worldserve.models.matrixgame.image import build_image_encoder
from worldserve.models.matrixgame.transformer import MatrixGameTransformer, build_transformer
from worldserve.models.wan.build import build_vae, seeded_init

__all__ = ["LoadedMatrix", "MatrixWeightOptions", "load_matrix"]


@dataclass(frozen=True, slots=True)
class MatrixWeightOptions:
    """The weight options as the user gave them (paths as strings; None: not given)."""

    config: str | None = None
    variant: str | None = None
    weights: str | None = None
    checkpoint: str | None = None
    vae: str | None = None
    image_encoder: str | None = None
    load: str | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.variant is not None:
            get_variant(self.variant)  # an unknown variant is refused before anything loads
        if self.config is not None and self.config not in CONFIGS:
            raise ValueError(f"matrix-game-2 option config must be one of {list(CONFIGS)}; got {self.config!r}.")
        if self.load not in (None, "dummy", "checkpoint"):
            raise ValueError(f"matrix-game-2 option load must be 'dummy' or 'checkpoint'; got {self.load!r}.")
        if self.load == "dummy" and (self.checkpoint is not None or self.weights is not None):
            raise ValueError("matrix-game-2 takes load=dummy or checkpoint=PATH / weights=DIR, not both.")


@dataclass(slots=True)
class LoadedMatrix:
    """The modules, built and loaded, and what they were loaded from (for the description)."""

    config: MatrixGameConfig
    variant: Variant
    transformer: MatrixGameTransformer
    vae: nn.Module
    image_encoder: nn.Module
    dummy: bool
    version: str
    #: part -> the file or folder it was loaded from (absent: random weights)
    sources: dict[str, Path] = field(default_factory=dict)
    #: part -> the layout its file was in
    layouts: dict[str, str] = field(default_factory=dict)


def load_matrix(options: MatrixWeightOptions, device: torch.device, seed: int) -> LoadedMatrix:
    """Resolve, build and load; random initialisation is seeded by ``seed``."""
    if options.weights is not None or options.checkpoint is not None or options.load == "checkpoint":
        from worldserve.models.matrixgame.checkpoint import load_published

        return load_published(options, device, seed)
    size = options.config or "tiny"
    if size != "tiny" and options.load != "dummy":
        raise ValueError(
            f"matrix-game-2 config {size!r} needs weights=DIR or checkpoint=PATH (Skywork/Matrix-Game-2.0's files or "
            "a FastVideo Matrix-Game-2.0-*-Diffusers folder), or load=dummy for random weights; nothing downloads."
        )
    variant = get_variant(options.variant or "universal")
    config = matrix_config(size, variant, window=options.window)
    transformer, vae, encoder = build_random(config, device, seed)
    loaded = LoadedMatrix(
        config=config,
        variant=variant,
        transformer=transformer,
        vae=vae,
        image_encoder=encoder,
        dummy=True,
        version=f"{size}:{variant.name}:dummy-seed-{seed}",
    )
    given = {p: Path(v) for p in ("vae", "image_encoder") if (v := getattr(options, p)) not in (None, "random")}
    if given:  # the files asked for, loaded as with a checkpoint (and their errors said)
        from worldserve.models.matrixgame.checkpoint import load_parts

        load_parts(loaded, given)
    return loaded


def build_random(
    config: MatrixGameConfig, device: torch.device, seed: int
) -> tuple[MatrixGameTransformer, nn.Module, nn.Module]:
    """The transformer, VAE and image encoder with random weights (seeded; the caller's RNG untouched)."""
    with seeded_init(device, seed):
        transformer = build_transformer(config)
        vae = build_vae(config.wan)
        encoder = build_image_encoder(config.clip)
    return transformer, vae, encoder
