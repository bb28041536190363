"""Benchmark tinyworld on this machine's CPU: ``python bench/tinyworld.py``.

Prints a table: one session's generated frames/s and time to first chunk (a new session's
``new_state`` plus its first ``step``), and the aggregate frames/s of 8 sessions stepped as
one batch, against the bars of issue 4 (>= 30 frames/s, <= 300 ms, >= 1.5x).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from worldserve.models.base import SessionOptions
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", type=Path, default=None)
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = TinyWorldModel(weights=args.weights, max_batch_size=8)
    cold = first_chunk_seconds(model, "cold")
    warm = statistics.median(first_chunk_seconds(model, f"warm{i}") for i in range(5))
    one = statistics.median(frames_per_second(model, 1, args.chunks) for _ in range(args.repeats))
    eight = statistics.median(frames_per_second(model, 8, max(8, args.chunks // 4)) for _ in range(args.repeats))
    spec = model.spec
    rows = [
        ("measure", "value", "bar", ""),
        ("1 session, frames/s", f"{one:.1f}", ">= 30", "PASS" if one >= 30 else "FAIL"),
        (
            "time to first chunk (new session)",
            f"{1000 * warm:.0f} ms (first ever: {1000 * cold:.0f} ms)",
            "<= 300 ms",
            "PASS" if warm <= 0.3 else "FAIL",
        ),
        (
            "8 sessions batched, aggregate frames/s",
            f"{eight:.1f} ({eight / one:.2f}x one session)",
            ">= 1.5x",
            "PASS" if eight >= 1.5 * one else "FAIL",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print(
        f"tinyworld bench: {spec.width}x{spec.height}, {spec.frames_per_chunk} frames/chunk, "
        f"{len(model.config.steps)} denoise steps + 1 cache pass per chunk, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, state {spec.state_bytes / 1024:.0f} KiB/session"
    )
    for i, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(widths[j]) for j, c in enumerate(row)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
