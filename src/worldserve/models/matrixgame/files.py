"""Finding Matrix-Game 2.0's parts in a folder of downloads by the names they are published under.

Owns: :data:`PUBLISHED` (Skywork/Matrix-Game-2.0's files: ``base_distilled_model/base_distill.safetensors``,
``gta_distilled_model/gta_keyboard2dim.safetensors``, ``templerun_distilled_model/templerun_7dim_onlykey.safetensors``,
``Wan2.1_VAE.pth``, ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``; FastVideo's
``Matrix-Game-2.0-{Base,GTA,TempleRun}-Distilled-Diffusers`` folders: ``transformer/``, ``vae/``,
``image_encoder/``), :class:`MatrixParts` and :func:`find_matrix_parts` (the parts under a
folder, the transformer picked by ``variant`` among several), :func:`matrix_part_kind`,
:data:`PART_NAMES` and :func:`expected` (a part's name in errors and what its loader expects). Names
only: reading the files is the loaders' job. Must not know: torch, the model, sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worldserve.models.wan.files import expected_from, single_candidate, walk_published

__all__ = [
    "DIFFUSERS_FOLDERS",
    "PART_NAMES",
    "PUBLISHED",
    "MatrixParts",
    "expected",
    "find_matrix_parts",
    "matrix_part_kind",
]

#: Published names -> (part, the variant the name implies or None). Folders end in "/".
PUBLISHED: dict[str, tuple[str, str | None]] = {
    # Skywork/Matrix-Game-2.0 on the Hugging Face hub (the reference's README: huggingface-cli download).
    "base_distill.safetensors": ("transformer", "universal"),
    "gta_keyboard2dim.safetensors": ("transformer", "gta-drive"),
    "templerun_7dim_onlykey.safetensors": ("transformer", "templerun"),
    "Wan2.1_VAE.pth": ("vae", None),
    "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth": ("image_encoder", None),
    # A Diffusers folder (FastVideo/Matrix-Game-2.0-*-Diffusers): one folder per part.
    "transformer/": ("transformer", None),
    "vae/": ("vae", None),
    "image_encoder/": ("image_encoder", None),
}

#: FastVideo's Diffusers folders -> the variant their name implies (the shapes decide all the same).
DIFFUSERS_FOLDERS = {
    "Matrix-Game-2.0-Base-Distilled-Diffusers": "universal",
    "Matrix-Game-2.0-GTA-Distilled-Diffusers": "gta-drive",
    "Matrix-Game-2.0-TempleRun-Distilled-Diffusers": "templerun",
}
_PARTS = ("transformer", "vae", "image_encoder")
#: Each part's name in an error that a file given for it does not load.
PART_NAMES = {"transformer": "transformer", "vae": "VAE", "image_encoder": "image encoder"}
_WHAT = {
    "transformer": "a Matrix-Game 2.0 transformer",
    "vae": "Wan2.1's VAE",
    "image_encoder": "Wan's OpenCLIP image encoder (its vision tower)",
}


def expected(part: str) -> str:
    """What matrix-game-2's loader expects for ``part``, with the names it is published under."""
    return expected_from(PUBLISHED, part, _WHAT[part])


def matrix_part_kind(path: Path) -> tuple[str, str | None] | None:
    """(part, implied variant) for a published file or folder name, else None."""
    kind = PUBLISHED.get(path.name + ("/" if path.is_dir() else ""))
    if kind is not None and kind[0] == "transformer" and kind[1] is None:
        return ("transformer", DIFFUSERS_FOLDERS.get(path.parent.name))
    return kind


@dataclass(slots=True)
class MatrixParts:
    """The parts picked from a folder (None: not found), every candidate by part, and the implied variant."""

    transformer: Path | None = None
    vae: Path | None = None
    image_encoder: Path | None = None
    variant: str | None = None
    candidates: dict[str, list[Path]] = field(default_factory=dict)
    #: transformer candidate -> the variant its published name implies
    implied: dict[Path, str | None] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [part for part in _PARTS if getattr(self, part) is None]


def find_matrix_parts(folder: str | Path, variant: str | None = None) -> MatrixParts:
    """The parts under ``folder`` by their published names; ``variant`` picks among several transformers.

    Skywork's folder holds all three variants' checkpoints: without ``variant`` the universal one
    (``base_distill.safetensors``) is picked. Several candidates that the variant does not decide
    between are an error that lists them.
    """
    folder = Path(folder)
    found = walk_published(folder, matrix_part_kind)
    parts = MatrixParts()
    for path, (part, implied) in found:
        if path.is_dir() and not _holds_weights(path):
            continue
        parts.candidates.setdefault(part, []).append(path)
        if part == "transformer":
            parts.implied[path] = implied
    transformers = parts.candidates.get("transformer", [])
    wanted = variant or "universal"
    named = [p for p in transformers if parts.implied[p] == wanted]
    chosen = transformers if len(transformers) <= 1 else named
    if len(chosen) > 1 or (len(transformers) > 1 and not chosen):
        listed = ", ".join(str(p.relative_to(folder)) for p in transformers)
        raise ValueError(
            f"weights={folder}: several transformer checkpoints ({listed}); pass variant= or checkpoint=PATH."
        )
    if chosen:
        parts.transformer = chosen[0]
        parts.variant = parts.implied[chosen[0]]
    for part in ("vae", "image_encoder"):
        chosen_part = single_candidate(folder, parts.candidates, part)
        if chosen_part is not None:
            setattr(parts, part, chosen_part)
    return parts


def _holds_weights(folder: Path) -> bool:
    return any(p.suffix in (".safetensors", ".bin", ".pth", ".pt") for p in folder.iterdir() if p.is_file())
