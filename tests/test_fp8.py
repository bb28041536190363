"""FP8 GEMMs (``quant=fp8``): the reference's per-token scheme, where it applies, and how far it moves the model.

The reference (``amap-cvlab/ABot-World``, ``quantizer/``) is re-typed here from its PyTorch fallback:
scale ``max(absmax, 1e-10) / 448`` per row, values ``clamp(x / scale)`` to ``float8_e4m3fn``; weights per
output row, inputs per token; the product of the dequantized values plus the bias. The CPU runs FP8
GEMMs (slowly), so the whole path is checked here; the GPU test runs where CUDA is.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models import SessionOptions, load_model  # noqa: E402
from worldserve.models.abot.config import CONFIGS  # noqa: E402
from worldserve.models.wan.build import build_transformer, seeded_init  # noqa: E402
from worldserve.models.wan.fp8 import FP8Linear, check_fp8, quantize_blocks  # noqa: E402
from worldserve.protocol import ControlInput, TickRequest  # noqa: E402

#: The tiny config at widths FP8 GEMMs take on a GPU (multiples of 16).
WAN16 = dataclasses.replace(CONFIGS["tiny"].wan, head_dim=16, ffn_dim=64)


def _reference_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_per_token_group_quant_torch`` with one group per row, re-typed."""
    values = x.float()
    absmax = torch.maximum(values.abs().amax(dim=-1, keepdim=True), torch.tensor(1e-10))
    scale = absmax / 448.0
    return (values / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def test_an_fp8_linear_is_the_reference_per_token_product() -> None:
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    torch.nn.init.normal_(linear.weight, std=0.2, generator=generator)
    torch.nn.init.normal_(linear.bias, std=0.1, generator=generator)
    x = torch.randn(2, 7, 48, generator=generator) * torch.linspace(0.01, 30.0, 7)[None, :, None]  # rows of all scales
    got = FP8Linear(linear)(x)
    assert got.shape == (2, 7, 80)
    assert got.dtype == torch.float32  # float32 in, float32 out (computed through bfloat16, as the reference)
    qw, sw = _reference_quant(linear.weight.detach())
    qx, sx = _reference_quant(x.reshape(-1, 48).bfloat16())
    wanted = (qx.float() * sx) @ (qw.float() * sw).t() + linear.bias.detach().bfloat16().float()
    torch.testing.assert_close(got.reshape(-1, 80), wanted, rtol=1e-2, atol=1e-2)  # a bfloat16 result
    exact = linear(x).detach()
    error = ((got - exact).norm() / exact.norm()).item()
    assert 0.0 < error < 0.05, error  # quantized, and close


def test_only_the_blocks_linear_layers_are_quantized() -> None:
    with seeded_init(torch.device("cpu"), 0):
        transformer = build_transformer(CONFIGS["tiny"].wan)
    linears = [name for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    in_blocks = [name for name in linears if name.startswith("blocks.")]
    assert quantize_blocks(transformer) == len(in_blocks) > 0
    kinds = {name: type(m) for name, m in transformer.named_modules()}
    assert all(kinds[name] is FP8Linear for name in in_blocks)
    assert all(kinds[name] is torch.nn.Linear for name in linears if name not in in_blocks)  # embedders, head


def test_the_transformer_with_fp8_gemms_stays_within_two_percent_of_float32() -> None:
    """What the docs report: the prediction's relative error (tiny, random weights: about 1 %; bfloat16 0.6 %)."""
    with seeded_init(torch.device("cpu"), 0):
        transformer = build_transformer(WAN16)
    quantized = copy.deepcopy(transformer)
    quantize_blocks(quantized)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, WAN16.latent_channels, 3, WAN16.latent_height, WAN16.latent_width, generator=generator)
    text = torch.randn(1, WAN16.text_len, WAN16.text_dim, generator=generator)
    t = torch.tensor([500])
    with torch.no_grad():
        exact = transformer(x, t, text, return_dict=False)[0]
        got = quantized(x, t, text, return_dict=False)[0]
    error = ((got - exact).norm() / exact.norm()).item()
    assert 0.0 < error < 0.02, error


def _chunks(quant: str | None, device: str, dtype: str) -> np.ndarray:
    config = dataclasses.replace(CONFIGS["tiny"], wan=WAN16)
    model = load_model("abot-world", threads=1, config=config, device=device, dtype=dtype, quant=quant)
    if quant == "fp8":
        assert model.spec.precision.endswith("fp8 GEMMs")
        assert "GEMMs in FP8" in model.spec.description
    state = model.new_state("a", SessionOptions(seed=2))
    keys = ControlInput("keys", "worldserve.keys.v1", {"held": ["W"]})
    out = []
    for index in range(3):
        tick = TickRequest(session_id="a", request_id=f"r{index}", chunk_index=index, controls=(keys,))
        out.append(np.asarray(model.step([(state, tick)])[0]["payload"]))
    return np.concatenate(out).astype(np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / max(np.mean((a - b) ** 2), 1e-12)))


def test_abot_world_serves_with_fp8_gemms_close_to_float32() -> None:
    exact, fp8 = _chunks(None, "cpu", "float32"), _chunks("fp8", "cpu", "float32")
    assert fp8.shape == exact.shape
    assert not np.array_equal(fp8, exact)
    assert _psnr(fp8, exact) > 40.0  # measured 55 dB (bfloat16: 51 dB)
    with pytest.raises(ValueError, match="quant must be 'fp8' or 'none'"):
        load_model("abot-world", threads=1, quant="int4")


def test_fp8_is_refused_on_a_gpu_without_fp8_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer .*NVIDIA A100 is 8\.0"):
        check_fp8(torch.device("cuda"), "abot-world")
    check_fp8(torch.device("cpu"), "abot-world")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs where a GPU is lent)")
def test_on_the_gpu_fp8_is_close_to_bfloat16() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 GEMMs")
    bf16, fp8 = _chunks(None, "cuda", "bfloat16"), _chunks("fp8", "cuda", "bfloat16")
    assert _psnr(fp8, bf16) > 40.0
