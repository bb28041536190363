"""Benchmark tinyworld on this machine's CPU: ``python bench/tinyworld.py``.

Prints a table: one session's generated frames/s and time to first chunk (a new session's
``new_state`` plus its first ``step``), and the aggregate frames/s of 8 sessions stepped as
one batch (measured in alternation with one session; the ratio is the median per repeat),
against the bars of issue 4 (>= 30 frames/s, <= 300 ms, >= 1.5x).
``--device cuda --sessions 8 32 128`` measures the same on a GPU, where batching is not
bounded by cores already busy at batch 1.

``--compare-accel none eager compile`` adds a second table: the milliseconds of one model
step (one chunk for every session of the batch) per serving path (``accel``: ``none`` is the
reference path) at each of ``--batches``, the paths measured in alternation, repeat after
repeat, and each path's speed-up over the first, as the median of the per-repeat ratios.
To stand in for an AVX2-only CPU on a newer one, run it with ``--precision float32`` under
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from worldserve.models.base import SessionOptions
from worldserve.models.tinyworld.accel import ACCELS
from worldserve.models.tinyworld.adapter import TinyWorldModel
from worldserve.protocol import ControlInput, TickRequest

KEYS = ControlInput("keys", "worldserve.keys.v1", {"held": ["D"]})


def tick(session: str, index: int) -> TickRequest:
    return TickRequest(session, f"{session}-{index}", index, (), None, (KEYS,))


def first_chunk_seconds(model: TinyWorldModel, name: str) -> float:
    started = time.perf_counter()
    state = model.new_state(name, SessionOptions(prompt="snowy tundra", seed=7))
    model.step([(state, tick(name, 0))])
    elapsed = time.perf_counter() - started
    model.release(state)
    return elapsed


def frames_per_second(model: TinyWorldModel, sessions: int, chunks: int) -> float:
    names = [f"s{i}" for i in range(sessions)]
    states = [model.new_state(name, SessionOptions(prompt="desert dunes", seed=i)) for i, name in enumerate(names)]
    model.step([(state, tick(name, 0)) for state, name in zip(states, names, strict=True)])
    started = time.perf_counter()
    for index in range(1, chunks + 1):
        model.step([(state, tick(name, index)) for state, name in zip(states, names, strict=True)])
    elapsed = time.perf_counter() - started
    for state in states:
        model.release(state)
    return sessions * chunks * model.spec.frames_per_chunk / elapsed


def step_milliseconds(model: TinyWorldModel, sessions: int, chunks: int) -> float:
    """Median milliseconds of one step of ``sessions`` sessions over ``chunks`` steps (after one unmeasured)."""
    names = [f"s{i}" for i in range(sessions)]
    states = [model.new_state(name, SessionOptions(prompt="desert dunes", seed=i)) for i, name in enumerate(names)]
    times = []
    for index in range(chunks + 1):
        started = time.perf_counter()
        model.step([(state, tick(name, index)) for state, name in zip(states, names, strict=True)])
        times.append(time.perf_counter() - started)
    for state in states:
        model.release(state)
    return 1000 * statistics.median(times[1:])


def compare_accels(args: argparse.Namespace) -> None:
    """The serving paths side by side: ms per step at each batch size, and speed-up over the first path."""
    models = {}
    for accel in args.compare_accel:
        started = time.perf_counter()
        models[accel] = TinyWorldModel(
            weights=args.weights,
            max_batch_size=max(args.batches),
            device=args.device,
            precision=args.precision,
            accel=accel,
        )
        print(f"accel={accel}: constructed in {time.perf_counter() - started:.1f} s", flush=True)
    times: dict[tuple[str, int], list[float]] = {(a, n): [] for a in models for n in args.batches}
    ratios: dict[tuple[str, int], list[float]] = {(a, n): [] for a in models for n in args.batches}
    first = args.compare_accel[0]
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1} of {args.repeats}", flush=True)
        for sessions in args.batches:
            chunks = max(3, args.chunks // (4 * sessions))
            current = {accel: step_milliseconds(model, sessions, chunks) for accel, model in models.items()}
            for accel, value in current.items():
                times[(accel, sessions)].append(value)
                ratios[(accel, sessions)].append(current[first] / value)
        # The table so far after every repeat: a long run on a busy machine still leaves numbers.
        print_accel_table(models, args.batches, times, ratios, repeat + 1)


def print_accel_table(
    models: dict[str, TinyWorldModel],
    batches: list[int],
    times: dict[tuple[str, int], list[float]],
    ratios: dict[tuple[str, int], list[float]],
    repeats: int,
) -> None:
    first = next(iter(models))
    precision = next(iter(models.values())).precision
    print(
        f"\nserving paths, {precision}, {torch.get_num_threads()} threads, ms per step "
        f"(one chunk for each session of the batch; median of {repeats} alternating repeats)"
    )
    header = ["sessions", *(f"accel={a}" for a in models), *(f"{a} vs {first}" for a in list(models)[1:])]
    rows = [header]
    for sessions in batches:
        row = [str(sessions)]
        row += [f"{statistics.median(times[(a, sessions)]):.1f} ms" for a in models]
        row += [f"{statistics.median(ratios[(a, sessions)]):.2f}x" for a in list(models)[1:]]
        rows.append(row)
    print_table(rows)
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", type=Path, default=None)
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats; medians are reported")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, ...")
    parser.add_argument("--precision", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument(
        "--sessions", type=int, nargs="+", default=[8], help="batch sizes to compare with one session (bar: 8)"
    )
    parser.add_argument(
        "--accel", choices=["auto", *ACCELS], default="auto", help="serving path of the bars table (default: auto)"
    )
    parser.add_argument(
        "--compare-accel",
        choices=ACCELS,
        nargs="+",
        default=None,
        help="only compare these serving paths, first as the baseline (e.g. none eager compile)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8], help="batch sizes of --compare-accel")
    args = parser.parse_args()
    if args.compare_accel:
        compare_accels(args)
        return 0
    model = TinyWorldModel(
        weights=args.weights,
        max_batch_size=max([8, *args.sessions]),
        device=args.device,
        precision=args.precision,
        accel=args.accel,
    )
    cold = first_chunk_seconds(model, "cold")
    warm = statistics.median(first_chunk_seconds(model, f"warm{i}") for i in range(5))
    # One session and each batch size are measured in alternation, repeat after repeat, so
    # that a noisy machine slows both sides of each comparison alike; ratios are per repeat.
    singles: list[float] = []
    batched: dict[int, list[float]] = {n: [] for n in args.sessions}
    ratios: dict[int, list[float]] = {n: [] for n in args.sessions}
    for _ in range(args.repeats):
        single = frames_per_second(model, 1, args.chunks)
        singles.append(single)
        for sessions in args.sessions:
            value = frames_per_second(model, sessions, max(8, args.chunks * 2 // sessions))
            batched[sessions].append(value)
            ratios[sessions].append(value / single)
    one = statistics.median(singles)
    rows = [
        ("measure", "value", "bar", ""),
        ("1 session, frames/s", f"{one:.1f}", ">= 30", "PASS" if one >= 30 else "FAIL"),
        (
            "time to first chunk (new session)",
            f"{1000 * warm:.0f} ms (first ever: {1000 * cold:.0f} ms)",
            "<= 300 ms",
            "PASS" if warm <= 0.3 else "FAIL",
        ),
    ]
    for sessions in args.sessions:
        ratio = statistics.median(ratios[sessions])
        bar, verdict = (">= 1.5x", "PASS" if ratio >= 1.5 else "FAIL") if sessions == 8 else ("", "")
        value = f"{statistics.median(batched[sessions]):.1f} ({ratio:.2f}x one session)"
        rows.append((f"{sessions} sessions batched, aggregate frames/s", value, bar, verdict))
    spec = model.spec
    if model.device.type == "cuda":
        device = torch.cuda.get_device_name(model.device)
    else:
        device = f"{torch.get_num_threads()} threads"
    print(
        f"tinyworld bench: {spec.width}x{spec.height}, {spec.frames_per_chunk} frames/chunk, "
        f"{len(model.config.steps)} denoise steps + 1 cache pass per chunk, torch {torch.__version__}, "
        f"{model.device.type} ({device}), {model.precision}, accel={model.accel}, "
        f"state {spec.state_bytes / 1024:.0f} KiB/session"
    )
    print_table(rows)
    return 0


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` (the first is the header) as a Markdown table with aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    raise SystemExit(main())
