"""FP8 GEMMs for the Wan transformers' blocks (``quant=fp8``): ABot-World's ``use_fp8_gemm`` scheme.

Owns: :class:`FP8Linear` (a ``nn.Linear`` whose weight is kept in ``float8_e4m3fn`` with one scale per
output channel; each input row is quantized on the fly with its own scale, and one scaled GEMM,
``torch._scaled_mm``, computes the product in FP8 with the bias added) and :func:`quantize_blocks`
(every ``nn.Linear`` under the transformer's ``blocks``, as the reference's ``apply_fp8_quantization``
picks them: include pattern ``blocks``, nothing excluded), and :func:`check_fp8` (where FP8 GEMMs run).

The scheme is the reference's ``quant_type: fp8-per-token`` (``configs/default_config.yaml``;
``quantizer/quant/ptq.py`` and the PyTorch fallbacks of its kernels): scales ``absmax / 448`` (the
format's largest value), at least ``1e-10``, per row of the weight and per token of the input; the
product in the input's dtype (float32 inputs are taken to bfloat16 first, as the reference does, and
the result back to float32). The embeddings, the head and the modulation stay in the serving dtype.
Must not know: sessions, caches, which family it serves.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["FP8_MAX", "FP8Linear", "check_fp8", "quantize_blocks"]

FP8 = torch.float8_e4m3fn
#: The largest finite ``float8_e4m3fn`` value.
FP8_MAX = float(torch.finfo(FP8).max)
_EPS = 1e-10


def _rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize each row of ``x`` ``[M, K]``: the FP8 values and each row's scale ``[M, 1]`` (float32)."""
    values = x.float()
    scale = values.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / FP8_MAX
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class FP8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` in FP8 (per output channel) and ``x`` quantized per token."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight, scale = _rows(linear.weight.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] float8_e4m3fn
        self.weight_scale = nn.Parameter(scale.t().contiguous(), requires_grad=False)  # [1, out] float32
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        rows = x.reshape(-1, self.in_features)
        if dtype == torch.float32:
            rows = rows.to(torch.bfloat16)  # the reference's rule: float32 inputs go through bfloat16
        quantized, scale = _rows(rows)
        out = torch._scaled_mm(
            quantized,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=None if self.bias is None else self.bias.to(rows.dtype),
            out_dtype=rows.dtype,
        )
        result: Tensor = out.reshape(*x.shape[:-1], self.out_features).to(dtype)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8-per-token"


def check_fp8(device: torch.device, model: str) -> None:
    """Raise ``ValueError`` where FP8 GEMMs do not run: a CUDA GPU before compute capability 8.9 (Ada,
    Hopper and later have FP8 tensor cores; the CPU runs them too, slowly: for checks, not serving)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"{model} quant=fp8 needs FP8 GEMMs: a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"{name} is {capability[0]}.{capability[1]}. Leave quant unset to serve in {model}'s dtype."
            )
    elif device.type != "cpu":
        raise ValueError(f"{model} quant=fp8 runs on CUDA (compute capability 8.9+) or the CPU; not on {device}.")


def quantize_blocks(transformer: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``transformer.blocks`` by an :class:`FP8Linear`; returns how many."""
    blocks = getattr(transformer, "blocks", None)
    if not isinstance(blocks, nn.Module):
        raise TypeError(f"{type(transformer).__name__} has no blocks to quantize.")
    targets = [(name, module) for name, module in blocks.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = blocks.get_submodule(parent_name) if parent_name else blocks
        setattr(parent, child, FP8Linear(module))
    return len(targets)
