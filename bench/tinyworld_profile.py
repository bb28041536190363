"""Where one tinyworld model step spends its time: ``python bench/tinyworld_profile.py``.

Profiles ``TinyWorldModel.step`` (``torch.profiler``, CPU) at each of ``--batches`` after a
warm-up that fills the sessions' caches, and prints one table: milliseconds per step and
share of the step for the cache pass (``encode_keyframes``, once per chunk), the denoising
steps split by operator kind (convolutions, attention, linear layers, normalisation, the
rest of the operators, and Python with operator dispatch: the phase's time outside its
top-level operators), and the rest of the step (noise, controls, uint8 frames, envelopes).
Each row is the median over steps profiled one by one (a burst of another process's load
then spoils single steps, not the table); the wall-clock median of unprofiled steps is
shown for comparison, and so is the arithmetic the step does in convolutions and linear
layers (the profiler's FLOP counts) against what one large float32 matrix product reaches
on this machine (a practical ceiling). To stand in for an AVX2-only CPU, run it with
``--precision float32`` under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tinyworld import print_table
from worldserve.models.base import SessionOptions
from worldserve.models.tinyworld import adapter as adapter_module
from worldserve.models.tinyworld.accel import ACCELS
from worldserve.models.tinyworld.adapter import TinyWorldModel
from worldserve.protocol import ControlInput, TickRequest

KEYS = ControlInput("keys", "worldserve.keys.v1", {"held": ["D"]})
KINDS = ("convolutions", "attention", "linear layers", "LayerNorm / GroupNorm", "other operators")
STEP, DENOISE, CACHE = "bench::step", "bench::denoise", "bench::cache pass"


def kind(name: str) -> str:
    if "conv" in name:
        return "convolutions"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm"):
        return "linear layers"
    if "layer_norm" in name or "group_norm" in name:
        return "LayerNorm / GroupNorm"
    return "other operators"


def labelled(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return function(*args, **kwargs)

    return run


def tick(session: str, index: int) -> TickRequest:
    return TickRequest(session, f"{session}-{index}", index, (), None, (KEYS,))


def profile_batch(model: TinyWorldModel, sessions: int, steps: int) -> dict[str, float]:
    """Milliseconds per step by row of the table (plus "wall" and "profiled")."""
    names = [f"s{i}" for i in range(sessions)]
    states = [model.new_state(name, SessionOptions(prompt="desert dunes", seed=i)) for i, name in enumerate(names)]
    index = 0

    def step() -> None:
        nonlocal index
        model.step([(state, tick(name, index)) for state, name in zip(states, names, strict=True)])
        index += 1

    for _ in range(model.config.cache_slots + 2):  # the caches full, the window sliding
        step()
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        walls.append(time.perf_counter() - started)
    rows = [profiled_row(step) for _ in range(steps)]  # each step profiled apart: medians resist spikes
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:  # FLOPs: one more step
        step()
    for state in states:
        model.release(state)
    row = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    row["wall"] = 1000 * statistics.median(walls)
    flops: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.flops:
            flops[kind(event.name)] += event.flops
    for name in ("convolutions", "linear layers"):
        row[f"gflop {name}"] = flops[name] / 1e9
    return row


def profiled_row(step: Callable[[], None]) -> dict[str, float]:
    """Milliseconds of one profiled step by row of the table."""
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(STEP):
        step()
    phases: dict[str, float] = collections.defaultdict(float)
    ops: dict[tuple[str, str], float] = collections.defaultdict(float)
    for event in prof.events():
        if event.name.startswith("bench::"):
            phases[event.name] += event.cpu_time_total / 1000
            continue
        parent, phase, top = event.cpu_parent, None, True
        while parent is not None:  # a top-level operator has only bench:: labels above it
            if parent.name.startswith("bench::"):
                phase = phase or parent.name
            else:
                top = False
            parent = parent.cpu_parent
        if top and phase is not None:
            ops[(phase, kind(event.name))] += event.cpu_time_total / 1000
    row: dict[str, float] = {"profiled": phases[STEP]}
    for phase, label in ((DENOISE, "denoising"), (CACHE, "cache pass")):
        covered = 0.0
        for name in KINDS:
            value = ops.get((phase, name), 0.0)
            row[f"{label}: {name}"] = value
            covered += value
        row[f"{label}: Python and dispatch"] = phases.get(phase, 0.0) - covered
        row[f"{label} (all)"] = phases.get(phase, 0.0)
    row["rest of the step (noise, controls, uint8 frames, envelopes)"] = (
        phases[STEP] - phases.get(DENOISE, 0.0) - phases.get(CACHE, 0.0)
    )
    return row


def gemm_gflops(size: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of a large float32 matrix product on this machine (best of ``repeats``)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", choices=["auto", "bfloat16", "float32"], default="float32")
    parser.add_argument("--accel", choices=["auto", *ACCELS], default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per batch size (and as many timed)")
    args = parser.parse_args()
    model = TinyWorldModel(precision=args.precision, accel=args.accel, max_batch_size=max(args.batches))
    if model._fast is None:
        adapter_module.sample_chunk = labelled(adapter_module.sample_chunk, DENOISE)  # type: ignore[attr-defined]
        adapter_module.encode_keyframes = labelled(adapter_module.encode_keyframes, CACHE)  # type: ignore[attr-defined]
    else:
        fast = model._fast
        fast.sample_chunk = labelled(fast.sample_chunk, DENOISE)  # type: ignore[method-assign]
        fast.encode_keyframes = labelled(fast.encode_keyframes, CACHE)  # type: ignore[method-assign]
    results = {sessions: profile_batch(model, sessions, args.steps) for sessions in args.batches}
    print(
        f"tinyworld step profile: {model.precision}, accel={model.accel}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; ms per step (share of the profiled step), medians of {args.steps} profiled steps"
    )
    first = results[args.batches[0]]
    order = ["wall", "profiled"] + [
        key for key in first if key not in ("wall", "profiled") and not key.endswith("(all)") and "gflop" not in key
    ]
    order.insert(2, "denoising (all)")
    order.insert(3 + len(KINDS) + 1, "cache pass (all)")
    header = ["", *(f"batch {sessions}" for sessions in args.batches)]
    rows = [header]
    for key in order:
        label = {"wall": "step, wall clock (median, unprofiled)", "profiled": "step, profiled (median)"}.get(key, key)
        cells = []
        for sessions in args.batches:
            value = results[sessions][key]
            share = "" if key == "wall" else f" ({100 * value / results[sessions]['profiled']:.0f}%)"
            cells.append(f"{value:.1f} ms{share}")
        rows.append([label, *cells])
    ceiling = gemm_gflops()
    for name in ("convolutions", "linear layers"):
        cells = []
        for sessions in args.batches:
            result = results[sessions]
            gflop = result[f"gflop {name}"]
            seconds = (result[f"denoising: {name}"] + result[f"cache pass: {name}"]) / 1000
            cells.append(f"{gflop:.2f} GFLOP, {gflop / seconds:.0f} GFLOP/s")
        rows.append([f"{name}: arithmetic, rate", *cells])
    rows.append(["float32 matrix product 2048x2048 (ceiling)", *[f"{ceiling:.0f} GFLOP/s"] * len(args.batches)])
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
