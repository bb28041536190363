"""``worldserve inspect PATH...``: what a file or a folder of downloads is, and how to serve it.

Owns: :func:`inspect_path` (one file or folder -> an :class:`Inspection`: each part found by its
published name and what its keys and shapes say: layout, dtype, parameter count; the parts
missing; which model serves it (``wan-causal``; ``matrix-game-2`` for Matrix-Game 2.0's files:
their published names, action modules in the transformer's keys, or a Matrix-Game Diffusers
folder; then the variant its shapes say: keyboard width and mouse; ``abot-world`` for ABot-World's
folder: ``Wan2.2_VAE.pth`` or ``taew2_2.pth`` beside it, or the control adapter in the transformer's
keys); the family, guessed from the
published names, the training wrappers and the size;
the configuration the shapes name; the ``worldserve serve`` command line that serves it (on the
GPU only where this machine has CUDA; none without a transformer checkpoint); the
memory per session at each window and how many sessions fit on a GPU of a given size) and
:func:`format_inspection`. Reads shapes only (safetensors headers, memory-mapped torch files):
a 28 GB checkpoint is not loaded. A part's file that cannot be read is a ``WeightsError`` naming
the part, the file and what was expected, as the model's loader says it. Must not know: the runtime, the server.
"""

from __future__ import annotations

import math
import shlex
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Inspection", "PartInfo", "format_inspection", "inspect_path"]

#: What is kept back from the GPU for activations and the allocator when sessions are counted.
ACTIVATION_RESERVE = 0.10
_GIB = 2**30


@dataclass(slots=True)
class PartInfo:
    """One part as found: its path, the layout its keys are in, tensors, parameters and dtype."""

    part: str
    path: Path
    layout: str = ""
    tensors: int = 0
    parameters: int = 0
    dtype: str = ""
    note: str = ""


@dataclass(slots=True)
class Inspection:
    path: Path
    #: The model that serves these files: ``wan-causal``, ``matrix-game-2`` or ``abot-world``.
    model: str = "wan-causal"
    parts: dict[str, PartInfo] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    family: str = ""
    family_reason: str = ""
    config: str = ""
    sizes: dict[str, int] = field(default_factory=dict)
    #: The ``worldserve serve`` line ("" when no model can be served from these files).
    command: str = ""
    notes: list[str] = field(default_factory=list)
    #: (window, KV bytes, state bytes, sessions on the GPU)
    memory: list[tuple[int, int, int, int]] = field(default_factory=list)
    gpu_gib: float = 0.0
    weights_bytes: int = 0


def _dtype(shapes: dict[str, tuple[tuple[int, ...], str]]) -> str:
    counts = Counter(dtype for _, dtype in shapes.values())
    return counts.most_common(1)[0][0] if counts else "?"


def _params(shapes: dict[str, tuple[tuple[int, ...], str]]) -> int:
    return sum(math.prod(shape) for shape, _ in shapes.values())


def _strip(name: str) -> str:
    for prefix in ("model.", "module.", "diffusion_model."):
        name = name.removeprefix(prefix)
    return name


def _read_part(
    result: Inspection, part: str, where: Path, name: str, what: str
) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[str]] | None:
    """Record ``part`` found at ``where`` in ``result``; its shapes and training wrappers (None: a tokenizer
    folder, which has none). A file that cannot be read raises as the model's loader would, naming it."""
    from worldserve.models.wan.statedict import part_errors, read_shapes

    info = result.parts[part] = PartInfo(part=part, path=where)
    if part == "tokenizer":
        info.layout = "tokenizer folder"
        return None
    with part_errors(name, where, what):
        shapes, found = read_shapes(where)
    info.tensors, info.parameters, info.dtype = len(shapes), _params(shapes), _dtype(shapes)
    return shapes, found


def inspect_path(path: str | Path, *, gpu_gib: float = 80.0, windows: tuple[int, ...] = (3, 6, 9, 15)) -> Inspection:
    """Inspect one weight file or folder (see the module docstring)."""
    from worldserve.models.wan.checkpoint import is_diffusers_layout
    from worldserve.models.wan.config import CONFIGS
    from worldserve.models.wan.vaeweights import vae_layout_of
    from worldserve.models.wancausal.checkpoint import WAN_HEAD_DIM
    from worldserve.models.wancausal.families import FAMILIES, family_config, guess_family
    from worldserve.models.wancausal.files import PART_NAMES, Parts, expected, find_parts, part_kind

    path = Path(path).expanduser().resolve()
    if _is_abot(path):
        return _inspect_abot(path, gpu_gib=gpu_gib, windows=windows)
    if _is_matrix_game(path):
        return _inspect_matrix(path, gpu_gib=gpu_gib, windows=windows)
    result = Inspection(path=path, gpu_gib=gpu_gib)
    if path.is_dir():
        try:
            parts = find_parts(path)
        except ValueError as error:  # several candidates: still say what is there
            result.notes.append(str(error))
            parts = Parts()
    else:
        parts = Parts()
        kind = part_kind(path)
        part, implied = kind if kind is not None else ("transformer", None)
        setattr(parts, part, path)
        parts.family = implied
    wrappers: list[str] = []
    transformer_shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for part in ("transformer", "lora", "vae", "text_encoder", "tokenizer"):
        where = getattr(parts, part)
        if where is None:
            continue
        read = _read_part(result, part, where, PART_NAMES[part], expected(part))
        if read is None:
            continue
        shapes, found = read
        info = result.parts[part]
        if part == "transformer":
            wrappers = found
            transformer_shapes = {_strip(k): v for k, v in shapes.items()}
            info.layout = "Diffusers" if is_diffusers_layout(transformer_shapes) else "original Wan2.1 names"
            if found:
                info.note = "training checkpoint with " + ", ".join(found)
        elif part == "vae":
            info.layout = "Diffusers" if vae_layout_of(shapes) == "diffusers" else "original (Wan2.1_VAE.pth)"
        elif part == "text_encoder":
            info.layout = "transformers UMT5" if where.is_dir() else "Wan's T5 (models_t5_umt5-xxl-enc-bf16.pth)"
        elif part == "lora":
            info.layout = "peft LoRA"
    result.missing = [p for p in ("transformer", "vae", "text_encoder", "tokenizer") if p not in result.parts]
    # The configuration: the width names the size (Wan2.1's heads are 128 wide).
    config = None
    if transformer_shapes:
        patch = transformer_shapes.get("patch_embedding.weight")
        if patch is not None:
            dim = patch[0][0]
            config = next((c for c in CONFIGS.values() if c.dim == dim), None)
            layers = {int(k.split(".")[1]) for k in transformer_shapes if k.startswith("blocks.")}
            heads = config.num_heads if config is not None else max(1, dim // WAN_HEAD_DIM)
            result.sizes = {"dim": dim, "layers": len(layers), "heads": heads}
        if config is None:
            result.notes.append("the transformer's shapes name no known config (tiny, 1.3b, 14b)")
    result.config = config.name if config is not None else "?"
    # The family: a published name says it; else the training wrappers and the size.
    if parts.family is not None:
        family = parts.family
        name = parts.transformer.name + ("/" if parts.transformer.is_dir() else "") if parts.transformer else ""
        result.family_reason = f"the published name {name}"
    elif "generator_ema" in wrappers:
        family, result.family_reason = (
            "self-forcing",
            "a training checkpoint with EMA weights (Self-Forcing saves them)",
        )
    elif "generator" in wrappers:
        family, result.family_reason = "causvid", "a training checkpoint with generator weights only (as CausVid's)"
    elif "lora" in result.parts:
        family, result.family_reason = "longlive", "a LoRA next to the base weights (LongLive)"
    else:
        family = guess_family(result.config, None)
        result.family_reason = f"the size ({result.config}): no published name or training wrapper says more"
    result.family = family
    # The command line: none without a transformer (serve would refuse the folder).
    if "transformer" not in result.parts:
        result.family, result.family_reason = "?", "no transformer checkpoint"
        result.notes.append(
            "no transformer checkpoint (e.g. self_forcing_dmd.pt, causvid's model.pt, longlive_base.pt, "
            "krea-realtime-video-14b.safetensors, or a Diffusers snapshot's transformer/): no model to serve here"
        )
        return result
    options = [f"weights={path}"] if path.is_dir() else [f"checkpoint={path}"]
    if parts.family is None or family != parts.family:
        options.append(f"family={family}")
    if "text_encoder" not in result.parts or "tokenizer" not in result.parts:
        options.append("text=hashed")
        result.notes.append(
            "no text encoder (models_t5_umt5-xxl-enc-bf16.pth + google/umt5-xxl/, or text_encoder/ + tokenizer/): "
            "the command runs the hashed-word stand-in; add text_encoder=PATH tokenizer=DIR to use the real one"
        )
    if "vae" not in result.parts:
        options.append("vae=random")
        result.notes.append("no VAE (Wan2.1_VAE.pth or vae/): the command decodes with random weights; add vae=PATH")
    _serve_command(result, options)
    # Memory per session at each window, and how many sessions fit.
    if config is not None:
        from worldserve.models.wan.vae import decoder_cache_bytes

        base = family_config(config, FAMILIES[family])
        decoder = decoder_cache_bytes(base, 2)
        weights = 2 * sum(info.parameters for info in result.parts.values())
        if "vae" not in result.parts:  # a random VAE is on the GPU all the same
            import torch

            from worldserve.models.wan.build import build_vae

            with torch.device("meta"):
                weights += 2 * sum(p.numel() for p in build_vae(base).parameters())
        _memory(result, weights, decoder, {*windows, base.window_frames}, lambda w: base.with_window(w).kv_bytes(2))
    return result


def _is_abot(path: Path) -> bool:
    """ABot-World's files: Wan2.2's VAE or TAEHV beside a transformer, or the control adapter in its keys."""
    from worldserve.models.wan.files import TAEHV22_FILE
    from worldserve.models.wan.statedict import WeightsError, read_shapes

    if path.is_dir():
        names = {p.name for p in path.rglob("*")}
        if "Wan2.2_VAE.pth" in names or TAEHV22_FILE in names:
            return True
        candidates = list(path.rglob("diffusion_pytorch_model.safetensors"))
    else:
        candidates = [path] if path.suffix == ".safetensors" else []
    for candidate in candidates:
        try:
            shapes, _ = read_shapes(candidate)
        except WeightsError:
            continue
        if any(_strip(key).startswith("act_control_adapter.") for key in shapes):
            return True
    return False


def _inspect_abot(path: Path, *, gpu_gib: float, windows: tuple[int, ...]) -> Inspection:
    """ABot-World's folder (or its transformer file): the parts, the config its shapes say, the command, the memory."""
    from worldserve.models.abot.config import CONFIGS
    from worldserve.models.abot.weights import PART_NAMES, ABotParts, expected, find_parts
    from worldserve.models.wan.files import TAEHV22_FILE, find_taehv
    from worldserve.models.wan.vae import decoder_cache_bytes

    result = Inspection(path=path, gpu_gib=gpu_gib, model="abot-world")
    taehv = None
    if path.is_dir():
        try:
            parts = find_parts(path)
        except ValueError as error:
            result.notes.append(str(error))
            parts = ABotParts()
        taehv = find_taehv(path, TAEHV22_FILE)
    else:
        parts = ABotParts(transformer=path)
    shapes_of: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    for part in ("transformer", "vae", "text_encoder", "tokenizer"):
        where = getattr(parts, part)
        if where is None:
            continue
        read = _read_part(result, part, where, PART_NAMES[part], expected(part))
        if read is None:
            continue
        shapes_of[part] = read[0]
        result.parts[part].layout = {
            "transformer": "original Wan names with act_control_adapter",
            "vae": "Wan2.2's VAE (Wan2.2_VAE.pth)",
            "text_encoder": "Wan's T5 (models_t5_umt5-xxl-enc-bf16.pth)",
        }[part]
    result.missing = [p for p in ("transformer", "vae", "text_encoder", "tokenizer") if p not in result.parts]
    config = None
    transformer = {_strip(k): v for k, v in shapes_of.get("transformer", {}).items()}
    patch = transformer.get("patch_embedding.weight")
    if patch is not None:
        dim = patch[0][0]
        config = next((c for c in CONFIGS.values() if c.wan.dim == dim), None)
        layers = {int(k.split(".")[1]) for k in transformer if k.startswith("blocks.")}
        result.sizes = {"dim": dim, "layers": len(layers)}
        if config is None:
            result.notes.append(f"the transformer's width {dim} names no abot-world config (tiny, 5b)")
    result.config = config.wan.name.removeprefix("abot-") if config is not None else "?"
    result.family, result.family_reason = "ABot-World-0-5B-LF", "Wan2.2's VAE, TAEHV or the control adapter"
    if taehv is not None:
        result.notes.append(
            f"{taehv.name} here: --model-option decoder=taehv decodes with it (TAEHV, the reference's default "
            "decoder: configs/default_config.yaml vae_type taew2_2); without it the full VAE decodes"
        )
    if "transformer" not in result.parts:
        result.notes.append("no transformer checkpoint (diffusion_pytorch_model.safetensors): no model to serve here")
        return result
    if "vae" not in result.parts:  # the loader refuses a trained checkpoint without its VAE: no command
        result.notes.append(
            "no VAE (Wan2.2_VAE.pth): a trained checkpoint needs it (the start image's and the reference images' "
            "encoder); add it to the folder, or vae=PATH"
        )
        return result
    options = [f"weights={path}"] if path.is_dir() else [f"checkpoint={path}"]
    if config is not None and config.wan.name != "abot-5b":
        options.append(f"config={result.config}")
    if "text_encoder" not in result.parts or "tokenizer" not in result.parts:
        options.append("text=hashed")
        result.notes.append(
            "no text encoder (models_t5_umt5-xxl-enc-bf16.pth + google/umt5-xxl/): the command runs the hashed-word "
            "stand-in; add text_encoder=PATH tokenizer=DIR to use the real one"
        )
    _serve_command(result, options)
    if config is not None:
        wan = config.wan
        refs = 4 * wan.num_layers * config.ref_tokens * wan.dim * 2  # K, V, unrotated K and the slots' tokens
        decoder = decoder_cache_bytes(wan, 2)
        weights = 2 * sum(info.parameters for info in result.parts.values())
        windowed = {*windows, wan.window_frames}
        _memory(result, weights, decoder, windowed, lambda window: wan.with_window(window).kv_bytes(2) + refs)
    return result


def _is_matrix_game(path: Path) -> bool:
    """Matrix-Game 2.0's files: a published name, a Matrix-Game Diffusers folder, or action modules in the keys."""
    from worldserve.models.matrixgame.files import DIFFUSERS_FOLDERS, matrix_part_kind
    from worldserve.models.wan.statedict import WeightsError, read_shapes

    if path.is_dir():
        index = path / "model_index.json"
        if path.name in DIFFUSERS_FOLDERS or (index.exists() and "MatrixGame" in index.read_text()):
            return True
        names = {p.name for p in path.rglob("*")}
        kinds = [matrix_part_kind(p) for p in path.rglob("*.safetensors")]
        if any(kind is not None and kind[1] is not None for kind in kinds):
            return True
        return "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth" in names
    kind = matrix_part_kind(path)
    if kind is not None and kind[1] is not None:
        return True
    if path.suffix != ".safetensors":
        return False
    try:
        shapes, _ = read_shapes(path)
    except WeightsError:
        return False  # unreadable: inspected (and its error said) as wan-causal's transformer
    return any(".action_model." in key for key in shapes)


def _inspect_matrix(path: Path, *, gpu_gib: float, windows: tuple[int, ...]) -> Inspection:
    """A Matrix-Game 2.0 file or folder: its parts, the variant its shapes say, the command, the memory."""
    from worldserve.models.matrixgame.checkpoint import model_key, shape_facts, variant_of
    from worldserve.models.matrixgame.clipweights import clip_layout_of
    from worldserve.models.matrixgame.config import SIZES, matrix_config
    from worldserve.models.matrixgame.files import (
        PART_NAMES,
        MatrixParts,
        expected,
        find_matrix_parts,
        matrix_part_kind,
    )
    from worldserve.models.wan.checkpoint import diffusers_name, is_diffusers_layout
    from worldserve.models.wan.statedict import WeightsError, part_errors, read_shapes
    from worldserve.models.wan.vae import decoder_cache_bytes
    from worldserve.models.wan.vaeweights import vae_layout_of

    result = Inspection(path=path, gpu_gib=gpu_gib, model="matrix-game-2")
    if path.is_dir():
        try:
            parts = find_matrix_parts(path)
        except ValueError as error:
            result.notes.append(str(error))
            parts = MatrixParts()
    else:
        parts = MatrixParts()
        kind = matrix_part_kind(path)
        setattr(parts, kind[0] if kind is not None else "transformer", path)
    others = [p for p in parts.candidates.get("transformer", []) if p != parts.transformer]
    if others:
        listed = ", ".join(str(p.relative_to(path)) for p in others)
        result.notes.append(f"other variants here: {listed} (variant= picks one)")
    facts = None
    for part in ("transformer", "vae", "image_encoder"):
        where = getattr(parts, part)
        if where is None:
            continue
        info = PartInfo(part=part, path=where)
        result.parts[part] = info
        with part_errors(PART_NAMES[part], where, expected(part)):
            shapes, _ = read_shapes(where)
        info.tensors, info.parameters, info.dtype = len(shapes), _params(shapes), _dtype(shapes)
        if part == "transformer":
            stripped = {_strip(k): v[0] for k, v in shapes.items()}
            diffusers = is_diffusers_layout(stripped)
            info.layout = "Diffusers (FastVideo)" if diffusers else "original Matrix-Game names"
            convert = model_key if diffusers else diffusers_name
            named = {convert(k): v for k, v in stripped.items()}
            facts = shape_facts(named)
        elif part == "vae":
            info.layout = "Diffusers" if vae_layout_of(shapes) == "diffusers" else "original (Wan2.1_VAE.pth)"
        else:
            wan = clip_layout_of(shapes) == "wan"
            info.layout = "Wan's OpenCLIP (vision tower read)" if wan else "transformers CLIPVisionModel"
    result.missing = [p for p in ("transformer", "vae", "image_encoder") if p not in result.parts]
    config = None
    if facts is not None:
        try:
            variant = variant_of(facts, str(parts.transformer))
        except WeightsError as error:
            result.notes.append(str(error))
            variant = None
        size = next((name for name, (wan, _, _) in SIZES.items() if wan.dim == facts.dim), None)
        result.sizes = {"dim": facts.dim, "layers": facts.layers, "action blocks": len(facts.action_layers)}
        if variant is not None:
            result.family = variant.name
            result.family_reason = (
                f"the shapes: keyboard width {facts.keyboard_dim}, {'a' if facts.mouse else 'no'} mouse branch"
            )
            if size is not None:
                config = matrix_config(size, variant)
        if len(facts.action_layers) > 15:
            result.notes.append(
                f"action modules in {len(facts.action_layers)} blocks: the foundation (not distilled) model; "
                "Matrix-Game releases few-step settings only for the distilled ones"
            )
    result.config = config.name if config is not None else "?"
    if "transformer" not in result.parts:  # serve would refuse the folder: no command
        result.notes.append(
            "no transformer checkpoint (a Matrix-Game 2.0 variant's diffusion_pytorch_model.safetensors, "
            "or a Diffusers folder's transformer/): no model to serve here"
        )
        return result
    options = [f"weights={path}"] if path.is_dir() else [f"checkpoint={path}"]
    if "vae" not in result.parts:
        options.append("vae=random")
        result.notes.append("no VAE (Wan2.1_VAE.pth or vae/): the command decodes with random weights; add vae=PATH")
    if "image_encoder" not in result.parts:
        options.append("image_encoder=random")
        result.notes.append(
            "no image encoder (models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth or image_encoder/): the "
            "command runs on random image features; add image_encoder=PATH"
        )
    _serve_command(result, options)
    if config is not None:
        decoder = decoder_cache_bytes(config.wan, 2)
        weights = 2 * sum(info.parameters for info in result.parts.values())

        def kv_of(window: int) -> int:
            return matrix_config(config.name, config.variant, window=window).kv_bytes(2)

        _memory(result, weights, decoder, {*windows, config.wan.window_frames}, kv_of)
    return result


def _memory(result: Inspection, weights: int, decoder: int, windows: set[int], kv_of: Callable[[int], int]) -> None:
    """The memory table: per window, the KV cache (``kv_of``), the state with the decoder cache, and how many
    sessions fit on ``result.gpu_gib`` beside ``weights`` bytes and the activations' reserve."""
    result.weights_bytes = weights
    usable = result.gpu_gib * _GIB * (1.0 - ACTIVATION_RESERVE) - weights
    for window in sorted(windows):
        kv = kv_of(window)
        state = kv + decoder
        result.memory.append((window, kv, state, max(0, int(usable // state))))


def _serve_command(result: Inspection, options: list[str]) -> None:
    """The ``worldserve serve`` line for ``result.model`` with ``options``: on the GPU where this
    machine has CUDA, else on the CPU, with a note that the GPU's line needs a CUDA machine."""
    import torch

    gpu = torch.cuda.is_available()
    command = ["worldserve", "serve", "--model", result.model]
    for option in [*options, *(["device=cuda"] if gpu else [])]:
        command += ["--model-option", option]
    result.command = shlex.join(command)
    if not gpu:
        result.notes.append(
            "no CUDA on this machine (torch.cuda.is_available() is False): the command serves on the CPU; "
            "on a machine with CUDA add --model-option device=cuda"
        )


def _size(count: int) -> str:
    return f"{count / _GIB:.2f} GiB" if count >= _GIB // 10 else f"{count / 2**20:.1f} MiB"


def format_inspection(result: Inspection) -> str:
    """The inspection as the text ``worldserve inspect`` prints."""
    lines = [f"{result.path}"]
    for part in ("transformer", "lora", "vae", "text_encoder", "tokenizer", "image_encoder"):
        info = result.parts.get(part)
        if info is None:
            continue
        detail = info.layout
        if info.tensors:
            detail += f", {info.tensors} tensors, {info.parameters:,} parameters, {info.dtype}"
        if info.note:
            detail += f"; {info.note}"
        lines.append(f"  {part.replace('_', ' ')}: {info.path} ({detail})")
    lines.append(f"  missing: {', '.join(p.replace('_', ' ') for p in result.missing) or 'nothing'}")
    sizes = ", ".join(f"{k} {v}" for k, v in result.sizes.items())
    lines.append(f"  config: {result.config}" + (f" ({sizes})" if sizes else ""))
    if result.model == "abot-world":
        where = f"{result.family}, from {result.family_reason}"
        lines.append(f"  model: abot-world ({where}); its settings: docs/wan-causal.md")
    elif result.model == "matrix-game-2":
        lines.append(
            f"  model: matrix-game-2, variant {result.family or '?'} (from {result.family_reason or 'nothing'})"
        )
    else:
        lines.append(f"  family: {result.family} (from {result.family_reason}); its settings: docs/models.md")
    for note in result.notes:
        lines.append(f"  note: {note}")
    if result.command:
        lines.append(f"  serve: {result.command}")
    else:
        lines.append("  serve: none (no transformer checkpoint here: no model to serve)")
    if result.memory:
        lines.append("")
        lines.append(
            f"  memory per session (bfloat16) on a {result.gpu_gib:g} GiB GPU: weights {_size(result.weights_bytes)}, "
            f"{ACTIVATION_RESERVE:.0%} kept for activations"
        )
        lines.append("")
        lines.append("  | window (latent frames) | KV cache | + VAE decoder cache | sessions that fit |")
        lines.append("  |---|---|---|---|")
        for window, kv, state, sessions in result.memory:
            lines.append(f"  | {window} | {_size(kv)} | {_size(state)} | {sessions} |")
    return "\n".join(lines)
