"""Capacity benchmark: the most sessions one server holds at real time, by side (chunk clock, lead, preemption).

For each side (``worldserve serve --chunk-clock on`` and ``off``, the same model and
options otherwise), starts a server on a free port, runs ``worldserve bench
--find-capacity`` against it (clients start at uniform random offsets, the client count
steps up by doubling then bisects) and stops it; then prints each side's steps and the
two figures side by side: sessions held at <= 1 % late chunks, the mean batch at that
count, event->applied p99 against one period plus one step. A chunk is late (``--late-by
player``, the default) when it finds its client's jitter buffer run dry: each client plays
as the page does, from a buffer that starts at ``--slack-frames`` (1) and grows a frame
after each underrun, so the figure is what a viewer sees stall. ``--late-by arrival``
counts the chunks that arrive after a fixed playout instant instead (the first chunk's
arrival plus the slack, then k periods, re-anchored after a stall: the figure before the
page had a jitter buffer).

The clients run on the same machine as the server: on a small box they take CPU from it.

Usage: ``python bench/capacity.py [--model tinyworld] [--model-option precision=float32]
[--duration 20] [--stagger 5] [--start 2] [--max-clients 32] [--sides on off jit nopreempt]
[--media raw] [--slack-frames 1] [--late-by player|arrival] [--server-arg '--step-budget 0.95']``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys

from servers import start_server
from worldserve.tools.loadtest import CapacityStep, find_capacity, format_capacity_table

#: What each side runs: the chunk clock on or off (a lead of one chunk), or on with --lead jit
#: (the server's default), or a chunk ahead without preemption.
_SIDES = {
    "on": "chunk clock on, --lead 1",
    "off": "chunk clock off, --lead 1",
    "jit": "chunk clock on, --lead jit",
    "nopreempt": "chunk clock on, --lead 1, --preempt off",
}


def _server_args(args: argparse.Namespace, side: str) -> list[str]:
    command = ["--model", args.model, "--workers", str(args.workers)]
    if side == "jit":
        command += ["--chunk-clock", "on", "--lead", "jit"]
    elif side == "nopreempt":
        command += ["--chunk-clock", "on", "--lead", "1", "--preempt", "off"]
    else:
        command += ["--chunk-clock", side, "--lead", "1"]
    for option in args.model_option:
        command += ["--model-option", option]
    if args.threads_per_worker is not None:
        command += ["--threads-per-worker", str(args.threads_per_worker)]
    for extra in args.server_arg:
        command += extra.split()
    return command


def _summary(capacity: int, steps: list[CapacityStep]) -> tuple[str, str, str]:
    at = next((step for step in steps if step.clients == capacity), None)
    if at is None:
        return "-", "-", "-"
    reports = at.result.reports
    batch = [value for r in reports for value in r.batch_sizes]
    applied = sorted(value for r in reports for value in r.applied)
    compute = [value for r in reports for value in r.compute]
    period = max(r.chunk_period for r in reports)
    p99 = applied[min(len(applied) - 1, round(0.99 * (len(applied) - 1)))] if applied else float("nan")
    bound = period + (statistics.median(compute) if compute else 0.0)
    return (
        f"{statistics.mean(batch):.2f}" if batch else "-",
        f"{p99 * 1000:.0f} vs {bound * 1000:.0f} ({'met' if p99 <= bound else 'missed'})",
        f"{statistics.median(compute) * 1000:.0f}" if compute else "-",
    )


async def _side(args: argparse.Namespace, side: str) -> tuple[int, list[CapacityStep]]:
    server = start_server(_server_args(args, side), f"capacity-{side}", timeout=120.0)
    try:
        return await find_capacity(
            server.url,
            start=args.start,
            max_clients=args.max_clients,
            duration=args.duration,
            stagger=args.stagger,
            seed=args.seed,
            media=args.media,
            playout_slack_frames=args.slack_frames,
            late_by=args.late_by,
        )
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tinyworld")
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads-per-worker", type=int, default=None, help="passed to the server (default: its own)")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="more `worldserve serve` arguments for both sides, e.g. --server-arg '--step-budget 0.95'",
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per session at each step")
    parser.add_argument("--stagger", type=float, default=5.0, help="start offsets: uniform in [0, STAGGER] s")
    parser.add_argument("--start", type=int, default=2, help="first client count")
    parser.add_argument("--max-clients", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--media", choices=("raw", "jpeg", "h264"), default="raw", help="how the frames travel")
    parser.add_argument(
        "--slack-frames",
        type=float,
        default=1.0,
        help="each client's jitter buffer starts at this many frames, as the page's does (1); 0: on arrival",
    )
    parser.add_argument(
        "--late-by",
        choices=("player", "arrival"),
        default="player",
        help="a chunk is late when it finds the jitter buffer run dry (player) or arrives after a fixed "
        "playout instant (arrival: the figure before the page had a jitter buffer)",
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=list(_SIDES),
        default=["on", "off"],
        help="on / off: the chunk clock (lead 1 chunk, preemption on); jit: the clock with --lead jit (the "
        "server's default); nopreempt: the clock, lead 1 chunk, --preempt off",
    )
    args = parser.parse_args()

    options = " ".join(args.model_option) or "defaults"
    import torch

    from worldserve.runtime.config import default_threads_per_worker

    count = args.threads_per_worker or default_threads_per_worker(args.workers)[0]
    threads = f" of {count} thread(s){'' if args.threads_per_worker else ' (the server default)'}"
    threads += "".join(f", {extra}" for extra in args.server_arg)
    print(
        f"capacity bench: model {args.model} ({options}), {args.workers} worker(s){threads}, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}, torch's CPU kernels: "
        f"{torch.backends.cpu.get_cpu_capability()}), {args.duration:g} s per session, "
        f"start offsets uniform in [0, {args.stagger:g}] s, media {args.media}, players starting "
        f"{args.slack_frames:g} frame(s) after the first chunk, late by {args.late_by}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    results: dict[str, tuple[int, list[CapacityStep]]] = {}
    for side in args.sides:
        capacity, steps = asyncio.run(_side(args, side))
        results[side] = (capacity, steps)
        print(f"\n{_SIDES[side]}:")
        print(format_capacity_table(capacity, steps))
    print(
        "\n| side | sessions held at <= 1 % late | mean batch there "
        "| event->applied p99 vs bound (ms) | chunk step p50 ms |"
    )
    print("|---|---|---|---|---|")
    for side, (capacity, steps) in results.items():
        batch, p99, step = _summary(capacity, steps)
        print(f"| {side} | {capacity} | {batch} | {p99} | {step} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
