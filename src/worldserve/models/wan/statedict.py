"""Reading weight files as their authors publish them, and the error that names what does not fit.

Owns: :class:`WeightsError` (a ``ValueError`` naming the part, the file, what is wrong with it
(the user's own key, the expected and found shapes) and what the loader expected) and
:func:`part_errors` (the one place a part's name and what it expects are put on every error
raised while that part is read and loaded), :func:`read_tensors` (one file or folder
-> a flat ``{name: tensor}``: a torch file, unwrapping training wrappers such as
``generator_ema`` / ``generator`` / ``model`` / ``state_dict`` and stripping the ``model.`` /
``module.`` prefixes and FSDP/checkpointing wrapper names; a safetensors file; a folder of
safetensors shards with or without a ``*.index.json``, as Diffusers and transformers save
them), :func:`read_json`, :func:`check_shapes` (every expected key present with its
shape, nothing extra; the message uses the user's names) and :func:`weights_digest` (the
sha256 prefix a loaded model's version names). Must not know: which part a file is (the
caller says, through :func:`part_errors`), the model, sessions.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "TensorInfo",
    "WeightsError",
    "check_shapes",
    "one_line",
    "part_errors",
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
    """A weight file that does not fit the model: what is wrong (``detail``) with which file (``path``).

    Raised inside :func:`part_errors` it also carries the part (``part``: "VAE", "text
    encoder", ...), the file or folder the part was given as (``source``) and what the loader
    expected there (``expected``); the message is then ``<part> <source>: [<file inside it>:]
    <detail>; expected <expected>.``
    """

    def __init__(
        self,
        detail: str,
        *,
        path: str | Path | None = None,
        part: str | None = None,
        source: str | Path | None = None,
        expected: str | None = None,
    ) -> None:
        self.detail = detail
        self.path = Path(path) if path is not None else None
        self.part = part
        self.source = Path(source) if source is not None else self.path
        self.expected = expected
        super().__init__(self._message())

    def __reduce__(self) -> tuple[object, ...]:  # kept whole across a worker's pipe
        return (_rebuild, (self.detail, self.path, self.part, self.source, self.expected))

    def _message(self) -> str:
        detail = _clause(self.detail)
        if self.part is None:
            text = f"{self.path}: {detail}" if self.path is not None else detail
            return text + ("" if text.endswith("...") else ".")
        text = f"{self.part} {self.source}: "
        if self.path is not None and self.source is not None and self.path != self.source:
            inside = self.path.is_relative_to(self.source)
            text += f"{self.path.relative_to(self.source) if inside else self.path}: "
        text += detail
        return text + (
            f"; expected {_clause(self.expected)}." if self.expected else "" if text.endswith("...") else "."
        )

    def named(self, part: str, source: str | Path, expected: str) -> WeightsError:
        """This error as part ``part`` given as ``source``, which was expected to be ``expected``."""
        return WeightsError(self.detail, path=self.path or source, part=part, source=source, expected=expected)


def _clause(text: str) -> str:
    """``text`` without its closing full stop (an ellipsis is kept)."""
    return text[:-1] if text.endswith(".") and not text.endswith("...") else text


def _rebuild(
    detail: str, path: Path | None, part: str | None, source: Path | None, expected: str | None
) -> WeightsError:
    return WeightsError(detail, path=path, part=part, source=source, expected=expected)


def one_line(error: BaseException) -> str:
    """``TypeName: message`` on one line: torch's and transformers' multi-line advice cut to what went wrong."""
    text = str(error)
    unpickler = text.split("WeightsUnpickler error:", 1)
    if len(unpickler) == 2:  # torch's weights_only advice, then what the unpickler refused
        text = unpickler[1].split("Check the documentation", 1)[0]
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) > 200:
        text = text[:200].rstrip() + " ..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextmanager
def part_errors(part: str, source: str | Path, expected: str) -> Iterator[None]:
    """Every error reading or loading part ``part`` from ``source`` names the part, the file and what was expected.

    A :class:`WeightsError` raised inside gets the part; an ``OSError`` (a file that cannot be
    read) becomes one. An error that already names a part is left as it is.
    """
    try:
        yield
    except WeightsError as error:
        if error.part is not None:
            raise
        raise error.named(part, source, expected) from None
    except OSError as error:
        where = error.filename if isinstance(error.filename, str) else None
        raise WeightsError(
            f"cannot read it ({error.strerror or one_line(error)})",
            path=where,
            part=part,
            source=source,
            expected=expected,
        ) from None


def shape_text(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise WeightsError(f"cannot read JSON ({one_line(error)})", path=path) from None
    if not isinstance(data, dict):
        raise WeightsError("not a JSON object", path=path)
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
            raise WeightsError("no weight_map", path=index)
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        files = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pth")) + sorted(folder.glob("*.pt"))
    if not files:
        raise WeightsError("a folder without weight files (*.safetensors, *.bin, *.pth, *.pt)", path=folder)
    return files


def _torch_load(path: Path) -> object:
    """A torch file's contents; a file that is none (empty, cut off, another format) is a :class:`WeightsError`."""
    try:
        with warnings.catch_warnings():  # the error below says what is wrong; torch's pickle warnings do not
            warnings.simplefilter("ignore", UserWarning)
            try:  # memory-mapped: a 28 GB checkpoint is not read twice
                return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
            return torch.load(str(path), map_location="cpu", weights_only=True)  # the legacy (pre-zip) format
    except Exception as error:
        raise WeightsError(_not_torch(path, error), path=path) from None


def _not_torch(path: Path, error: Exception) -> str:
    """What a file torch.load refused is: empty, a zip-format torch file cut off, a safetensors file, or not torch's."""
    with path.open("rb") as handle:
        head = handle.read(16)
    size = path.stat().st_size
    if size == 0:
        return "not a torch file: it is empty (0 bytes)"
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return f"a torch file cut off or damaged: the zip archive torch.save writes has no end ({size} bytes)"
        return f"a damaged torch file ({one_line(error)})"
    if len(head) > 8 and head[8:9] == b"{":
        return "not a torch file but a safetensors one, by its header: a safetensors file must end in .safetensors"
    return f"not a torch file (torch.save's zip archive or its legacy pickle): {one_line(error)}"


def _safetensors(path: Path, error: Exception) -> WeightsError:
    text = str(error)
    if "not fully covered" in text or "incomplete" in text:
        return WeightsError(
            f"a safetensors file cut off: its header describes more than the file holds ({text})", path=path
        )
    return WeightsError(f"not a safetensors file ({one_line(error)})", path=path)


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
            raise WeightsError(f"no state dict in it (top-level keys: {sorted(map(str, raw))[:10]})", path=path)
    if not isinstance(raw, Mapping):
        raise WeightsError(f"not a mapping of tensors but a {type(raw).__name__}", path=path)
    return raw, wrappers


def read_tensors(path: str | Path, *, ema: bool = True, unwrap: bool = True) -> dict[str, Tensor]:
    """Every tensor of a weight file or folder, under its (unwrapped, unprefixed) name.

    A torch file holding both ``generator_ema`` and ``generator`` gives the EMA weights when
    ``ema`` (Self-Forcing's ``--use_ema``), else the plain ones (LongLive's ``use_ema: false``).
    ``unwrap=False`` keeps the names exactly as stored (a text encoder's ``model.`` is no wrapper).
    """
    path = Path(path)
    if not path.exists():
        raise WeightsError("no such file or folder", path=path)
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
            raise _safetensors(path, error) from None
    else:
        raw = _torch_load(path)
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
        raise WeightsError("no such file or folder", path=path)
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
            raise _safetensors(path, error) from None
    raw: object = _torch_load(path)  # memory-mapped: pages are read only as touched
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
    lines = [f"{part} has {len(found)} keys; the model expects {len(expected)}"]
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
    raise WeightsError("; ".join(lines), path=where)
