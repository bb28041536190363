"""Which device and arithmetic a model can serve in here, and what to tell its user when it cannot.

Owns: :func:`usable_device` (a ``device`` option -> the device, refused in one line when this
machine has no such device: ``cuda`` without CUDA, ``cuda:3`` with two GPUs),
:func:`native_low_precision` (whether the device has fast kernels for bfloat16 / float16: a GPU
does; a CPU only with AVX512-BF16 / AMX for bfloat16, AVX512-FP16 / AMX-FP16 for float16) and
:func:`served_precision` (the precision asked -> the one served, with the reason when they
differ). On a CPU without those kernels (an AVX2-only machine) PyTorch emulates the reduced
precision: measured there, a bfloat16 linear layer ran 9x and a 3D convolution 60x slower than
in float32 (the Wan VAE decode of the tiny config: 1.5 s instead of 0.2 s), so a model asked for
the GPU's precision there serves in float32 and says so, instead of being 10-100x slower.
Must not know: which model asks, sessions, the runtime.
"""

from __future__ import annotations

import torch

__all__ = ["LOW_PRECISIONS", "native_low_precision", "served_precision", "usable_device"]

#: The reduced precisions a CPU may lack kernels for.
LOW_PRECISIONS = ("bfloat16", "float16")


def usable_device(device: str, model: str) -> torch.device:
    """``device`` as a torch device; ``ValueError`` (one line, what to do) for a CUDA device this
    machine does not have (PyTorch's own answer, when the model first touches it, is an
    ``AssertionError: Torch not compiled with CUDA enabled`` or an invalid-ordinal error)."""
    try:
        chosen = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"{model}: device={device!r} is no device PyTorch knows ({error})") from None
    if chosen.type != "cuda":
        return chosen
    if not torch.cuda.is_available():
        raise ValueError(
            f"{model}: device={device} needs a CUDA GPU, and this machine's PyTorch sees none "
            "(torch.cuda.is_available() is False: no GPU or driver, or a CPU-only PyTorch build); "
            "serve on a machine with CUDA, or without device=cuda (the CPU)"
        )
    count = torch.cuda.device_count()
    if chosen.index is not None and chosen.index >= count:
        raise ValueError(f"{model}: device={device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return chosen


def native_low_precision(device: torch.device, precision: str) -> bool:
    """True when ``device`` computes ``precision`` natively (float32 always; a GPU always)."""
    if precision not in LOW_PRECISIONS or device.type != "cpu":
        return True
    if precision == "bfloat16":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def served_precision(asked: str, device: torch.device, model: str) -> tuple[str, str | None]:
    """(the precision served, a note for the user or None) for ``asked`` on ``device``.

    A reduced precision the device has no fast kernels for is served in float32; the note says
    what was asked, why it is not served, and how the machine was told apart.
    """
    if native_low_precision(device, asked):
        return asked, None
    capability = torch.backends.cpu.get_cpu_capability()
    note = (
        f"{model}: {asked} asked, serving float32: this CPU ({capability}) has no native {asked} kernels, "
        f"where {asked} runs 10-100x slower than float32 (docs/models.md, 'Precision')"
    )
    return "float32", note
