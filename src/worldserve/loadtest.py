"""``worldserve bench``: N concurrent clients against a running server, one table out.

Owns: a scripted client (start, steer with held-key and prompt events at a steady
rate, consume and acknowledge chunks), the books that prove no event was lost (each
accepted event is applied in exactly one chunk or reported in ``input.dropped``),
and the summary table: time to first chunk, frames/s, event->applied latency
percentiles against the bound of one chunk period plus one chunk's compute.

Must not know: the server's internals (it is a plain client over the socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from worldserve.client import WorldClient, WorldError, keys

__all__ = ["BenchResult", "ClientReport", "format_table", "run_bench"]

_HELD_CHOICES = ((), ("W",), ("A",), ("S",), ("D",), ("W", "D"), ("S", "A"))
_PROMPTS = ("islands", "desert dunes", "deep forest", "snowy tundra")


@dataclass
class ClientReport:
    """What one client saw."""

    ttfc: float | None = None
    frames: int = 0
    chunks: int = 0
    seconds: float = 0.0
    sent: int = 0
    accepted: int = 0
    duplicates: int = 0
    applied_once: int = 0
    applied_twice: int = 0
    dropped: int = 0
    superseded: int = 0  # of dropped: replaced in the queue by a newer held-key event (reported, not lost)
    lost: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # event sent -> its chunk received (client), seconds
    applied: list[float] = field(default_factory=list)  # event accepted -> its chunk committed (server), seconds
    boundary_wait: list[float] = field(default_factory=list)  # the same minus that chunk's own tick time
    compute: list[float] = field(default_factory=list)  # server compute per chunk, seconds
    queued: list[float] = field(default_factory=list)  # of that: waiting for a batch to start, seconds
    model: list[float] = field(default_factory=list)  # of that: inside the model's step, seconds
    batch_sizes: list[int] = field(default_factory=list)  # sessions in the step that made each chunk
    chunk_period: float = 0.0


@dataclass
class BenchResult:
    clients: int
    duration: float
    reports: list[ClientReport]


async def _run_client(
    url: str, token: str | None, duration: float, event_interval: float, seed: int, settle: float
) -> ClientReport:
    report = ClientReport()
    rng = random.Random(seed)
    sent_at: dict[int, float] = {}
    applied: Counter[int] = Counter()
    accepted: set[int] = set()
    try:
        async with WorldClient(url, token=token) as client:
            started = time.monotonic()
            info = await client.start(prompt=rng.choice(_PROMPTS), seed=seed, media="raw")
            report.chunk_period = info.model["frames_per_chunk"] / info.model["fps"]

            progress = asyncio.Event()

            async def consume() -> None:
                async for chunk in client.chunks():
                    progress.set()
                    if report.ttfc is None:
                        report.ttfc = chunk.received_at - started
                    report.chunks += 1
                    report.frames += int(chunk.frames.shape[0])
                    tick = chunk.timings.get("tick_ms", 0.0) / 1000.0
                    report.compute.append(tick)
                    report.queued.append(chunk.timings.get("queued_ms", 0.0) / 1000.0)
                    report.model.append(chunk.timings.get("model_ms", 0.0) / 1000.0)
                    report.batch_sizes.append(chunk.batch_size)
                    for ms in chunk.applied_latency_ms:
                        report.applied.append(ms / 1000.0)
                        report.boundary_wait.append(ms / 1000.0 - tick)
                    for event_id in chunk.applied_event_ids:
                        applied[event_id] += 1
                        if event_id in sent_at:
                            report.latencies.append(chunk.received_at - sent_at[event_id])

            consumer = asyncio.create_task(consume())
            event_id = 0
            deadline = started + duration
            while time.monotonic() < deadline:
                await asyncio.sleep(event_interval * rng.uniform(0.5, 1.5))
                event_id += 1
                prompt = rng.choice(_PROMPTS) if rng.random() < 0.1 else None
                sent_at[event_id] = time.monotonic()
                report.sent += 1
                try:
                    acceptance = await client.send_event(
                        event_id=event_id, prompt=prompt, controls=[keys(*rng.choice(_HELD_CHOICES))]
                    )
                except WorldError as error:
                    report.errors[error.code] += 1
                    continue
                if acceptance.status == "accepted":
                    accepted.add(event_id)
                else:
                    report.duplicates += 1
            # Let every accepted event reach a chunk, then close (which reports any drops).
            settle_until = time.monotonic() + settle
            while (
                not accepted <= set(applied) | {event for notice in client.dropped for event in notice.event_ids}
                and (remaining := settle_until - time.monotonic()) > 0
            ):
                progress.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(progress.wait(), remaining)
            report.seconds = time.monotonic() - started
            await client.close()
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            dropped = {event for notice in client.dropped for event in notice.event_ids}
            superseded = {
                event for notice in client.dropped if notice.reason == "superseded" for event in notice.event_ids
            }
    except (WorldError, OSError) as error:
        report.errors[getattr(error, "code", type(error).__name__)] += 1
        return report
    report.accepted = len(accepted)
    report.applied_once = sum(1 for event in accepted if applied[event] == 1)
    report.applied_twice = sum(1 for event in accepted if applied[event] > 1)
    report.dropped = len((accepted - set(applied)) & dropped)
    report.superseded = len((accepted - set(applied)) & superseded)
    report.lost = len(accepted - set(applied) - dropped)
    return report


async def run_bench(
    url: str,
    *,
    clients: int = 32,
    duration: float = 60.0,
    event_interval: float = 0.25,
    token: str | None = None,
    settle: float = 5.0,
) -> BenchResult:
    """Run ``clients`` concurrent sessions for ``duration`` seconds each."""
    reports = await asyncio.gather(
        *(_run_client(url, token, duration, event_interval, seed, settle) for seed in range(clients))
    )
    return BenchResult(clients=clients, duration=duration, reports=list(reports))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def format_table(result: BenchResult) -> str:
    """The bench summary as a fixed-width table."""
    reports = result.reports
    ttfc = [r.ttfc for r in reports if r.ttfc is not None]
    fps = [r.frames / r.seconds for r in reports if r.seconds > 0]
    latencies = [value for r in reports for value in r.latencies]
    server_side = [value for r in reports for value in r.applied]
    waits = [value for r in reports for value in r.boundary_wait]
    compute = [value for r in reports for value in r.compute]
    queued = [value for r in reports for value in r.queued]
    model = [value for r in reports for value in r.model]
    batch_sizes = [value for r in reports for value in r.batch_sizes]
    period = max((r.chunk_period for r in reports), default=0.0)
    bound = period + (statistics.median(compute) if compute else 0.0)
    p99 = _percentile(server_side, 0.99)
    wait_p99 = _percentile(waits, 0.99)
    errors: Counter[str] = Counter()
    for report in reports:
        errors.update(report.errors)
    rows = [
        ("clients", f"{result.clients}"),
        ("duration per client (s)", f"{result.duration:.0f}"),
        ("chunks received", f"{sum(r.chunks for r in reports)}"),
        ("frames/s per client (mean / min)", f"{statistics.mean(fps):.1f} / {min(fps):.1f}" if fps else "-"),
        (
            "time to first chunk ms (p50 / p99)",
            f"{_percentile(ttfc, 0.5) * 1000:.0f} / {_percentile(ttfc, 0.99) * 1000:.0f}" if ttfc else "-",
        ),
        ("chunk compute ms (p50)", f"{statistics.median(compute) * 1000:.1f}" if compute else "-"),
        (
            "  of it: queued for a batch / in the model (p50 ms); batch size (mean)",
            f"{_percentile(queued, 0.5) * 1000:.1f} / {_percentile(model, 0.5) * 1000:.1f}; "
            f"{statistics.mean(batch_sizes):.1f}"
            if batch_sizes
            else "-",
        ),
        (
            "event accepted->applied ms, server (p50 / p99 / max)",
            f"{_percentile(server_side, 0.5) * 1000:.0f} / {p99 * 1000:.0f} / {max(server_side, default=0) * 1000:.0f}",
        ),
        (
            "bound, overall: p99 vs chunk period + compute p50 (ms)",
            f"{p99 * 1000:.1f} vs {bound * 1000:.1f} ({'met' if p99 <= bound else 'MISSED'})"
            if server_side
            else "- (no events applied)",
        ),
        (
            "bound, per event: p99 of (applied - its chunk's compute) vs period (ms)",
            f"{wait_p99 * 1000:.1f} vs {period * 1000:.1f} ({'met' if wait_p99 <= period else 'MISSED'})"
            if waits
            else "- (no events applied)",
        ),
        (
            "event sent->chunk received ms, client (p50 / p99)",
            f"{_percentile(latencies, 0.5) * 1000:.0f} / {_percentile(latencies, 0.99) * 1000:.0f}",
        ),
        (
            "events sent / accepted / duplicate",
            f"{sum(r.sent for r in reports)} / {sum(r.accepted for r in reports)}"
            f" / {sum(r.duplicates for r in reports)}",
        ),
        (
            "applied exactly once / dropped (reported; of them superseded)",
            f"{sum(r.applied_once for r in reports)} / {sum(r.dropped for r in reports)}"
            f" ({sum(r.superseded for r in reports)})",
        ),
        ("lost / applied twice", f"{sum(r.lost for r in reports)} / {sum(r.applied_twice for r in reports)}"),
        ("errors", ", ".join(f"{code}={count}" for code, count in sorted(errors.items())) or "0"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 24}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
