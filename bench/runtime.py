"""Runtime benchmark: sessions ticking as fast as they can through the engine, batched vs unbatched.

For 1, 4, 8 and 16 concurrent sessions on one worker process, against a model whose
``step`` costs a fixed compute (``fixed_cost_model.py``), with batching on and off
(``max_batch_size=1``): aggregate chunks/s, p50/p99 tick latency (around
``Session.next_chunk``), the mean batch, a direct in-process ``model.step`` of the same
batch for comparison, and the runtime's own overhead per tick:

- ``engine ovh`` = round trip to the worker minus the worker's ``model.step`` time (IPC,
  pickling, wake-ups, checks): the latency a tick pays beyond a direct call of its batch;
- ``/tick amort.`` = that, divided by the batch: the engine's cost per tick of throughput;
- ``e2e ovh`` = ``next_chunk`` latency minus queueing minus compute (adds the session layer).

Usage: ``python bench/runtime.py [--step-ms 30] [--seconds 2] [--sessions 1 4 8 16]``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one BLAS thread per worker: a fixed, comparable cost

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from fixed_cost_model import FixedCostModel  # noqa: E402
from worldserve import Session, TickRequest  # noqa: E402
from worldserve.models import SessionOptions  # noqa: E402
from worldserve.runtime import Chunk, Runtime  # noqa: E402

MODEL = "fixed_cost_model:FixedCostModel"


@dataclass
class Row:
    sessions: int
    batched: bool
    chunks_per_s: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    direct_ms: float
    engine_overhead_ms: float
    e2e_overhead_ms: float


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def calibrate(step_ms: float, matrix: int) -> int:
    """Matrix products per step so that one step costs about ``step_ms``."""
    model = FixedCostModel(matrix=matrix, repeats=10)
    state = model.new_state("c", SessionOptions())
    model.step([(state, TickRequest("c", "r", 0))])
    began = time.perf_counter()
    for _ in range(5):
        model.step([(state, TickRequest("c", "r", 0))])
    per_product = (time.perf_counter() - began) / 50
    return max(1, round(step_ms / 1000 / per_product))


def direct_step_ms(options: dict[str, int], batch: int, repeat: int = 15) -> float:
    """Median ``model.step`` of a batch, called directly in this process."""
    model = FixedCostModel(**options)
    states = [model.new_state(str(i), SessionOptions(seed=i)) for i in range(batch)]
    samples = []
    for index in range(repeat):
        ticks = [(state, TickRequest(str(i), f"r{index}", index)) for i, state in enumerate(states)]
        began = time.perf_counter()
        model.step(ticks)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1000


async def tick_loop(
    sessions: list[Session[Chunk]],
    seconds: float,
    warm_s: float,
    deliver: Callable[[Chunk], Awaitable[object]] | None = None,
) -> tuple[list[float], list[Chunk], float]:
    """Tick every session back to back: ``warm_s`` unrecorded, then ``seconds`` recorded.

    ``deliver``: awaited with each chunk before the session's next tick (as a server's
    ``WorldHost`` encodes a chunk before it asks for the next); its time counts in the latency.
    Returns each recorded tick's latency, its chunk, and the recorded span's length.
    """
    latencies: list[float] = []
    chunks: list[Chunk] = []
    stop = asyncio.Event()

    async def loop(session: Session[Chunk], record: bool) -> None:
        while not stop.is_set():
            began = time.perf_counter()
            chunk = await session.next_chunk()
            if deliver is not None:
                await deliver(chunk)
            if record:
                latencies.append(time.perf_counter() - began)
                chunks.append(chunk)

    warm = [asyncio.ensure_future(loop(session, False)) for session in sessions]
    await asyncio.sleep(warm_s)
    stop.set()
    await asyncio.gather(*warm)
    stop.clear()
    began = time.perf_counter()
    runs = [asyncio.ensure_future(loop(session, True)) for session in sessions]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*runs)
    return latencies, chunks, time.perf_counter() - began


async def measure(sessions: int, batched: bool, options: dict[str, int], seconds: float) -> Row:
    model_options = dict(options, max_batch_size=64 if batched else 1)
    async with Runtime(MODEL, model_options=model_options, workers=1, batch_wait_s=0.002) as rt:
        live = [await rt.create_session(seed=i) for i in range(sessions)]
        latencies, chunks, elapsed = await tick_loop(live, seconds, warm_s=min(0.5, seconds / 4))
    mean_batch = statistics.fmean(chunk.batch_size for chunk in chunks)
    e2e = [lat - c.queued_s - c.compute_s for lat, c in zip(latencies, chunks, strict=True)]
    return Row(
        sessions=sessions,
        batched=batched,
        chunks_per_s=len(chunks) / elapsed,
        p50_ms=quantile(latencies, 0.5) * 1000,
        p99_ms=quantile(latencies, 0.99) * 1000,
        mean_batch=mean_batch,
        direct_ms=direct_step_ms(options, max(1, round(mean_batch))),
        engine_overhead_ms=statistics.median(c.overhead_s for c in chunks) * 1000,
        e2e_overhead_ms=statistics.median(e2e) * 1000,
    )


def table(rows: list[Row]) -> str:
    head = (
        f"{'sessions':>8} {'mode':>9} {'chunks/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} "
        f"{'direct ms':>9} {'engine ovh ms':>13} {'/tick amort.':>12} {'e2e ovh ms':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.sessions:>8} {'batched' if r.batched else 'unbatched':>9} {r.chunks_per_s:>9.1f} "
            f"{r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.mean_batch:>6.1f} {r.direct_ms:>9.2f} "
            f"{r.engine_overhead_ms:>13.3f} {r.engine_overhead_ms / r.mean_batch:>12.3f} {r.e2e_overhead_ms:>10.3f}"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    repeats = calibrate(args.step_ms, args.matrix)
    options = {"matrix": args.matrix, "repeats": repeats}
    print(
        f"model step ~{args.step_ms:g} ms ({repeats} products of {args.matrix}x{args.matrix} float32, "
        f"1 BLAS thread); one worker process; {args.seconds:g} s per row; frames 4x48x48x3 uint8"
    )
    rows = []
    for sessions in args.sessions:
        for batched in (True, False):
            rows.append(await measure(sessions, batched, options, args.seconds))
    print(table(rows))
    by = {(r.sessions, r.batched): r for r in rows}
    verdicts = []
    largest = max(args.sessions)
    if (largest, True) in by:
        ovh = by[largest, True].engine_overhead_ms
        amortized = ovh / by[largest, True].mean_batch
        verdicts.append(
            f"engine overhead at {largest} sessions: {ovh:.3f} ms of latency per tick, {amortized:.3f} ms "
            "amortized over its batch (target <= 1 ms)"
        )
    if (8, True) in by:
        speedup = by[8, True].chunks_per_s / by[8, False].chunks_per_s
        verdicts.append(f"batching at 8 sessions: {speedup:.1f}x the unbatched chunks/s (target >= 3x)")
    print("\n".join(verdicts))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=30.0, help="cost of one model step")
    parser.add_argument("--matrix", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured time per row")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16])
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
