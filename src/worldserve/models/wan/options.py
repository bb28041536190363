"""Model options as ``--model-option`` gives them (strings), shared by the models built on these parts.

Owns: :func:`option_path`, :func:`option_bool`, :func:`option_int` (a string or a value -> the
option's type, the error naming the model and the option), :func:`resolve_dtype` (``auto``:
bfloat16 on CUDA, else float32; a reduced precision this CPU has no fast kernels for is served
in float32, with a note: :mod:`worldserve.models.precision`) and :func:`cast_module` (parameters
to the serving precision, the parts diffusers keeps in float32 kept so). Used by ``wan-causal`` and ``matrix-game-2``.
Must not know: sessions, the runtime.
"""

from __future__ import annotations

from pathlib import Path

import torch

from worldserve.models.precision import served_precision

__all__ = ["DTYPES", "FLOAT32_PARTS", "cast_module", "option_bool", "option_int", "option_path", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Parameters kept in float32 at lower precision (what diffusers keeps in float32 for the Wan transformer).
FLOAT32_PARTS = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def option_path(value: str | Path | None) -> str | None:
    return None if value is None else str(value)


def option_bool(value: int | str | bool | None, model: str, name: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{model} option {name} must be 1 or 0; got {value!r}.")


def option_int(value: int | str | None, model: str, name: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{model} option {name} must be an integer; got {value!r}.") from None


def resolve_dtype(dtype: str, device: torch.device, model: str) -> tuple[str, torch.dtype, str | None]:
    """(name, dtype, note) of the ``dtype`` option: ``auto`` is bfloat16 on CUDA, float32 elsewhere;
    bfloat16 or float16 on a CPU without native kernels for it is float32, and the note says why."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"{model} option dtype must be auto or one of {sorted(DTYPES)}; got {dtype!r}.")
    served, note = served_precision(dtype, device, model)
    return served, DTYPES[served], note


def cast_module(module: torch.nn.Module, dtype: torch.dtype, float32_parts: tuple[str, ...] = ()) -> None:
    """Cast parameters to ``dtype``, keeping those under any of ``float32_parts`` in float32."""
    for name, parameter in module.named_parameters():
        keep = dtype != torch.float32 and any(part in name.split(".") for part in float32_parts)
        parameter.data = parameter.data.to(torch.float32 if keep else dtype)
