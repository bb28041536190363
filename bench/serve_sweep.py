"""A model through a real server: cold start, then ``worldserve bench`` at each client count.

``python bench/serve_sweep.py --model wan-causal --model-option config=tiny --clients 1 2 4 8``
starts ``worldserve serve`` on a free port, times its cold start (process start to healthy, and
to the first chunk one client receives), then for each client count runs the load tester's
closed loop (``run_bench``: that many sessions at once, a key event every 0.25 s) against it and
prints one Markdown row per count as soon as it is measured (a run cut short keeps its rows):
frames/s per client, real time or not, late chunks (after their playout instant), server compute
per chunk (p50 / p99), the mean batch, and any error. Used by ``bench/gpu.sh``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import free_port, stop_process
from worldserve.client import WorldClient
from worldserve.tools.loadtest import ClientReport, run_bench


def _start(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "worldserve", "serve", "--port", str(port), "--log-level", "warning"]
    command += ["--model", args.model, "--workers", "1"]
    for option in args.model_option:
        command += ["--model-option", option]
    for extra in args.server_arg:
        command += extra.split()
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


async def _first_chunk(url: str) -> tuple[float, float]:
    """When one client's first chunk arrived, and the model's frame rate."""
    async with WorldClient(url) as client:
        info = await client.start(prompt="snowy peaks", seed=1)
        await client.next_chunk(timeout=600)
        arrived = time.perf_counter()
        await client.close()
    return arrived, float(info.model["fps"])


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _row(clients: int, reports: list[ClientReport], model_fps: float) -> str:
    fps = [r.frames / r.seconds for r in reports if r.seconds > 0]
    compute = [value for r in reports for value in r.compute]
    batches = [value for r in reports for value in r.batch_sizes]
    late = [r.late_ratio for r in reports if r.chunks > 1]
    errors = sorted({code for r in reports for code in r.errors})
    late_ratio = statistics.mean(late) if late else float("nan")
    holds = bool(fps) and min(fps) >= 0.97 * model_fps and late_ratio <= 0.01
    return (
        f"| {clients} | "
        + (f"{statistics.mean(fps):.1f} / {min(fps):.1f}" if fps else "-")
        + f" | {'yes' if holds else 'no'} | {100 * late_ratio:.1f} % | "
        + f"{1000 * _percentile(compute, 0.5):.0f} / {1000 * _percentile(compute, 0.99):.0f} ms | "
        + f"{statistics.mean(batches) if batches else 0:.2f} | {', '.join(errors) or '-'} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="wan-causal")
    parser.add_argument("--model-option", action="append", default=[])
    parser.add_argument("--server-arg", action="append", default=[], help="more serve flags, e.g. '--step-budget 0.9'")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per client count")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds the last chunks may take to arrive")
    parser.add_argument("--log", type=Path, default=Path("serve_sweep.log"))
    args = parser.parse_args()
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/world"
    options = " ".join(f"{o}" for o in args.model_option)
    print(f"{args.model} through a real server ({options}); server log: {args.log}")
    print()
    started = time.perf_counter()
    process = _start(args, port, args.log)
    try:
        while True:
            if process.poll() is not None:
                print(f"server exited with {process.returncode}:\n{args.log.read_text()[-3000:]}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        healthy = time.perf_counter()
        first, model_fps = asyncio.run(_first_chunk(url))
        print("| cold start | process start -> healthy | -> first chunk of one client |")
        print("|---|---|---|")
        print(f"| {args.model} | {healthy - started:.1f} s | {first - started:.1f} s |", flush=True)
        print()
        print(
            f"| clients | frames/s per client (mean / min; the model plays {model_fps:g}) | real time | late chunks | "
            "server compute per chunk p50 / p99 | mean batch | errors |"
        )
        print("|---|---|---|---|---|---|---|", flush=True)
        for clients in args.clients:
            result = asyncio.run(run_bench(url, clients=clients, duration=args.duration, settle=args.settle))
            print(_row(clients, result.reports, model_fps), flush=True)
    finally:
        stop_process(process)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
