"""Reading weight files as their authors publish them, and the error that names what does not fit.

Owns: :class:`WeightsError` (a ``ValueError`` whose message names the file, the part, the
user's own key and the expected and found shapes), :func:`read_tensors` (one file or folder
-> a flat ``{name: tensor}``: a torch file, unwrapping training wrappers such as
``generator_ema`` / ``generator`` / ``model`` / ``state_dict`` and stripping the ``model.`` /
``module.`` prefixes and FSDP/checkpointing wrapper names; a safetensors file; a folder of
safetensors shards with or without a ``*.index.json``, as Diffusers and transformers save
them), :func:`read_json`, :func:`check_shapes` (every expected key present with its
shape, nothing extra; the message uses the user's names) and :func:`weights_digest` (the
sha256 prefix a loaded model's version names). Must not know: which part a file is, the
model, sessions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "TensorInfo",
    "WeightsError",
    "check_shapes",
    "read_json",
    "read_shapes",
    "read_tensors",
    "shape_text",
    "weights_digest",
]

_WRAPPERS = ("generator_ema", "generator", "generator_lora", "model", "state_dict", "module")
_PREFIXES = ("module.", "model.", "diffusion_model.")
#: Module names FSDP and activation checkpointing insert anywhere in a key.
_INNER_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_SHOWN = 6


class WeightsError(ValueError):
    """A weight file that does not fit the model; the message names the file, the part and the keys."""


def shape_text(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise WeightsError(f"{path}: cannot read JSON ({error}).") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object.")
    return data


def weights_digest(path: Path) -> str:
    """sha256 (12 hex digits) of a weight file, or of every file under a folder in name order."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def _tensor_files(folder: Path) -> list[Path]:
    """The weight files of a Diffusers/transformers folder: the index's shards, else every safetensors file."""
    for index in sorted(folder.glob("*.safetensors.index.json")):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: no weight_map.")
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        files = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pth")) + sorted(folder.glob("*.pt"))
    if not files:
        raise WeightsError(f"{folder}: no weight files (*.safetensors, *.bin, *.pth) in this folder.")
    return files


def _torch_load(path: Path) -> object:
    try:  # memory-mapped: a 28 GB checkpoint is not read twice
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
    return torch.load(str(path), map_location="cpu", weights_only=True)  # the legacy (pre-zip) format


def _unwrap(raw: object, path: Path, *, ema: bool) -> tuple[Mapping[str, Any], list[str]]:
    """The state dict inside a training checkpoint's wrappers, and the wrapper keys seen on the way."""
    preferred = ("generator_ema", "generator") if ema else ("generator", "generator_ema")
    wrappers: list[str] = []
    while isinstance(raw, Mapping) and not any(isinstance(v, Tensor) for v in raw.values()):
        wrappers += [str(k) for k in raw if str(k) in _WRAPPERS]
        for wrapper in (*preferred, *_WRAPPERS):
            if wrapper in raw:
                raw = raw[wrapper]
                break
        else:
            raise WeightsError(f"{path}: no state dict found (top-level keys: {sorted(map(str, raw))[:10]}).")
    if not isinstance(raw, Mapping):
        raise WeightsError(f"{path}: expected a mapping of tensors; got {type(raw).__name__}.")
    return raw, wrappers


def read_tensors(path: str | Path, *, ema: bool = True, unwrap: bool = True) -> dict[str, Tensor]:
    """Every tensor of a weight file or folder, under its (unwrapped, unprefixed) name.

    A torch file holding both ``generator_ema`` and ``generator`` gives the EMA weights when
    ``ema`` (Self-Forcing's ``--use_ema``), else the plain ones (LongLive's ``use_ema: false``).
    ``unwrap=False`` keeps the names exactly as stored (a text encoder's ``model.`` is no wrapper).
    """
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or folder.")
    if path.is_dir():
        out: dict[str, Tensor] = {}
        for file in _tensor_files(path):
            out.update(read_tensors(file, ema=ema, unwrap=unwrap))
        return out
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            raw: object = load_file(str(path))
        except SafetensorError as error:
            raise WeightsError(f"{path}: not a readable safetensors file ({error}).") from None
    else:
        try:
            raw = _torch_load(path)
        except Exception as error:
            raise WeightsError(
                f"{path}: not a readable torch file ({type(error).__name__}: {error}); "
                "a safetensors file must end in .safetensors."
            ) from None
    raw, _ = _unwrap(raw, path, ema=ema)
    out = {}
    for key, value in raw.items():
        if not isinstance(value, Tensor):
            continue
        name = str(key)
        if unwrap:
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


_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn"}
#: (shape, dtype name) of one stored tensor
TensorInfo = tuple[tuple[int, ...], str]


def read_shapes(path: str | Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor's shape and dtype, without reading the data where the format allows, and the
    wrapper keys found on the way (``generator_ema``, ``generator``, ...), names as stored."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or folder.")
    if path.is_dir():
        shapes: dict[str, TensorInfo] = {}
        wrappers: list[str] = []
        for file in _tensor_files(path):
            more, found = read_shapes(file)
            shapes.update(more)
            wrappers += [w for w in found if w not in wrappers]
        return shapes, wrappers
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:  # the header only
                return {
                    k: (tuple(handle.get_slice(k).get_shape()), _DTYPE_NAMES.get(handle.get_slice(k).get_dtype(), "?"))
                    for k in handle.keys()  # noqa: SIM118 (safe_open has no __iter__)
                }, []
        except SafetensorError as error:
            raise WeightsError(f"{path}: not a readable safetensors file ({error}).") from None
    try:
        raw: object = _torch_load(path)  # memory-mapped: pages are read only as touched
    except Exception as error:
        raise WeightsError(f"{path}: not a readable torch file ({type(error).__name__}: {error}).") from None
    raw, wrappers = _unwrap(raw, path, ema=True)
    out = {
        str(k): (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in raw.items() if isinstance(v, Tensor)
    }
    return out, wrappers


def check_shapes(
    found: Mapping[str, Tensor],
    expected: Mapping[str, tuple[int, ...]],
    *,
    where: str,
    part: str,
    user_name: Callable[[str], str] = lambda name: name,
) -> None:
    """Raise :class:`WeightsError` unless ``found`` has exactly ``expected``'s keys and shapes.

    Keys are the model's names; ``user_name`` turns one into the name the user's file uses,
    so the message speaks the user's layout.
    """
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    wrong = [key for key in expected if key in found and tuple(found[key].shape) != tuple(expected[key])]
    if not (missing or unexpected or wrong):
        return
    lines = [f"{where}: {part} has {len(found)} keys; the model expects {len(expected)}"]
    if missing:
        shown = ", ".join(f"{user_name(k)} {shape_text(expected[k])}" for k in missing[:_SHOWN])
        lines.append(f"missing ({len(missing)}): {shown}" + (" ..." if len(missing) > _SHOWN else ""))
    if unexpected:
        shown = ", ".join(f"{user_name(k)} {shape_text(found[k].shape)}" for k in unexpected[:_SHOWN])
        lines.append(f"not in the model ({len(unexpected)}): {shown}" + (" ..." if len(unexpected) > _SHOWN else ""))
    if wrong:
        shown = ", ".join(
            f"{user_name(k)}: expected {shape_text(expected[k])}, found {shape_text(found[k].shape)}"
            for k in wrong[:_SHOWN]
        )
        lines.append(f"wrong shape ({len(wrong)}): {shown}" + (" ..." if len(wrong) > _SHOWN else ""))
    raise WeightsError("; ".join(lines) + ".")
