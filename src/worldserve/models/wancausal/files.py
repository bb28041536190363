"""Finding wan-causal's parts in a folder of downloads by the names their authors publish them under.

Owns: :func:`find_parts` (``weights=DIR``: walks the folder a few levels down and picks the
transformer checkpoint, the VAE, the text encoder, its tokenizer and a LoRA by their published
file and folder names, see :data:`PUBLISHED`), :class:`Parts` (what was picked, every candidate
seen, and the family a checkpoint's published name implies), :func:`part_kind` (what one file or
folder is, by name), :data:`PART_NAMES` and :func:`expected` (a part's name in errors and what its
loader expects there, its published names). The walk itself is every Wan model's
(:mod:`worldserve.models.wan.files`). Names only: reading the files is the loaders' job. Must not
know: torch, the model, sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worldserve.models.wan.files import expected_from, single_candidate, walk_published

__all__ = [
    "PART_NAMES",
    "PUBLISHED",
    "Parts",
    "expected",
    "find_parts",
    "part_kind",
]

#: Published names -> (part, family the name implies or None). Folders end in "/".
PUBLISHED: dict[str, tuple[str, str | None]] = {
    # Self-Forcing (guandeh17/Self-Forcing README: huggingface gdhe17/Self-Forcing checkpoints/).
    "self_forcing_dmd.pt": ("transformer", "self-forcing"),
    "self_forcing_sid.pt": ("transformer", "self-forcing"),
    "self_forcing_gan.pt": ("transformer", "self-forcing"),
    # CausVid (tianweiy/CausVid README: the autoregressive checkpoint folder's model.pt).
    "model.pt": ("transformer", "causvid"),
    # LongLive (NVlabs/LongLive: longlive_models/models/longlive_base.pt and lora.pt).
    "longlive_base.pt": ("transformer", "longlive"),
    "lora.pt": ("lora", "longlive"),
    # Krea Realtime 14B (krea-ai/realtime-video README: krea/krea-realtime-video).
    "krea-realtime-video-14b.safetensors": ("transformer", "krea"),
    # Wan2.1 T2V (Wan-AI/Wan2.1-T2V-1.3B and -14B: original layout at the top of the folder).
    "diffusion_pytorch_model.safetensors": ("transformer", "wan"),
    "diffusion_pytorch_model.safetensors.index.json": ("transformer", "wan"),
    "Wan2.1_VAE.pth": ("vae", None),
    "models_t5_umt5-xxl-enc-bf16.pth": ("text_encoder", None),
    "umt5-xxl/": ("tokenizer", None),
    # A Diffusers snapshot (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): one folder per part.
    "transformer/": ("transformer", "wan"),
    "vae/": ("vae", None),
    "text_encoder/": ("text_encoder", None),
    "tokenizer/": ("tokenizer", None),
}

#: Each part's name in an error that a file given for it does not load.
PART_NAMES = {
    "transformer": "transformer",
    "vae": "VAE",
    "text_encoder": "text encoder",
    "tokenizer": "tokenizer",
    "lora": "LoRA",
}
_WHAT = {
    "transformer": "a Wan2.1-family transformer checkpoint",
    "vae": "Wan2.1's VAE",
    "text_encoder": "Wan's UMT5 text encoder",
    "tokenizer": "the UMT5 tokenizer folder",
    "lora": "LongLive's peft LoRA (<layer>.lora_A.weight and .lora_B.weight)",
}
_DIFFUSERS_PARTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "image_encoder")
_PARTS = ("transformer", "vae", "text_encoder", "tokenizer", "lora")


def expected(part: str) -> str:
    """What wan-causal's loader expects for ``part`` (``vae``, ...), with the names it is published under."""
    return expected_from(PUBLISHED, part, _WHAT[part])


def part_kind(path: Path) -> tuple[str, str | None] | None:
    """(part, implied family) for a published file or folder name, else None."""
    name = path.name + ("/" if path.is_dir() else "")
    if name.startswith("diffusion_pytorch_model"):
        if path.parent.name in _DIFFUSERS_PARTS:
            return None  # inside a Diffusers part folder, which is matched itself
        if name in PUBLISHED or name.endswith(".safetensors"):
            return ("transformer", "wan")  # Wan2.1's original-layout transformer (or one of the 14B's shards)
    return PUBLISHED.get(name)


@dataclass(slots=True)
class Parts:
    """The parts picked from a folder (None: not found), every candidate by part, and the implied family."""

    transformer: Path | None = None
    vae: Path | None = None
    text_encoder: Path | None = None
    tokenizer: Path | None = None
    lora: Path | None = None
    family: str | None = None
    candidates: dict[str, list[Path]] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [part for part in _PARTS[:4] if getattr(self, part) is None]


def _transformer_path(path: Path) -> Path:
    """A Wan2.1 original-layout transformer is its folder (one file or shards with an index)."""
    if path.name.startswith("diffusion_pytorch_model"):
        return path.parent
    return path


def find_parts(folder: str | Path, family: str | None = None) -> Parts:
    """The parts under ``folder`` by their published names; ``family`` picks among several checkpoints.

    A distilled checkpoint (Self-Forcing, CausVid, LongLive, Krea) outranks the plain Wan2.1
    transformer next to it, unless ``family`` is ``wan``. Several candidates for one part that
    the family does not decide between are an error that lists them.
    """
    folder = Path(folder)
    found = walk_published(folder, part_kind)
    parts = Parts()
    implied: dict[Path, str | None] = {}
    for path, (part, implied_family) in found:
        if part == "transformer":
            path = _transformer_path(path)
        if path not in parts.candidates.setdefault(part, []):
            parts.candidates[part].append(path)
            implied[path] = implied_family
    transformers = parts.candidates.get("transformer", [])
    distilled = [p for p in transformers if implied[p] != "wan"]
    named = [p for p in transformers if implied[p] == family] if family is not None else []
    # The family's own published checkpoint; else a distilled one (run with that family's settings); else Wan2.1's.
    chosen = named or (distilled if family != "wan" else []) or transformers
    if len(chosen) > 1:
        listed = ", ".join(str(p.relative_to(folder)) for p in chosen)
        raise ValueError(
            f"weights={folder}: several transformer checkpoints ({listed}); pass checkpoint=PATH or family=."
        )
    if chosen:
        parts.transformer = chosen[0]
        parts.family = implied[chosen[0]]
    for part in ("vae", "text_encoder", "tokenizer", "lora"):
        if part == "lora" and parts.family != "longlive":
            continue
        chosen_part = single_candidate(folder, parts.candidates, part)
        if chosen_part is not None:
            setattr(parts, part, chosen_part)
    return parts
