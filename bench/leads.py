"""Key-to-photon and late chunks with a lead of one chunk vs just in time, preemption on vs off, side by side.

For each model and each side (a ``--lead`` value, ``1`` or ``jit``, with preemption on, or with
``:off`` after it ``--preempt off``: ``1:off`` is the old pacing; ``+parts`` after either: the clients take
each chunk's frames in parts as the model makes them, ``worldserve bench --parts``), starts a server
on a free port and drives it with ``worldserve bench``'s client (``run_bench``) at each client
count, in alternation, then prints one table: key-to-photon p50 / p95 / p99 (an event's send to
the first frame of the chunk that applied it playing at the model's rate; docs/latency.md),
its ``wait_tick``, ``model`` and ``playout`` parts (p50), the late chunks a player at the
model's rate saw, the chunks preemption replaced and the event ledger (lost / applied twice in
what the players showed), the mean batch, and the admission refusals.

Usage: ``python bench/leads.py [--models procedural tinyworld] [--leads 1:off 1 jit] [--clients 1 4]
[--duration 15] [--media jpeg] [--rounds 1]``; frames whole and in parts side by side:
``python bench/leads.py --models wan-causal --leads jit jit+parts
--server-arg '--model-option config=tiny'``. The server and its clients share this
machine's cores: the load average at each run's start is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics

from servers import start_server
from worldserve.tools.loadtest import BenchResult, run_bench


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000:.0f}"


def row(model: str, lead: str, clients: int, result: BenchResult, load: float) -> str:
    samples = result.k2p
    parts = [sample.parts(result.offset) for sample in samples]
    total = [sample.total for sample in samples]
    reports = [r for r in result.reports if r.chunks > 1]
    late = [r.late_ratio * 100 for r in reports]
    batch = [size for r in result.reports for size in r.batch_sizes]
    refused = sum(r.errors.get("admission_refused", 0) for r in result.reports)
    preempted = sum(r.superseded_chunks for r in result.reports)
    chunks = sum(r.chunks for r in result.reports)
    ledger = f"{sum(r.lost for r in result.reports)} / {sum(r.applied_twice for r in result.reports)}"
    late_said = f"{statistics.mean(late):.2f} / {max(late):.2f}" if late else "-"
    underruns = sum(r.underruns for r in result.reports)
    return (
        f"| {model} | {lead} | {clients} ({len(reports)} played) | {_ms(total, 0.5)} / {_ms(total, 0.95)} / "
        f"{_ms(total, 0.99)} | {_ms([p['wait_tick'] for p in parts], 0.5)} | {_ms([p['model'] for p in parts], 0.5)} | "
        f"{_ms([p['playout'] for p in parts], 0.5)} | {underruns} | {late_said} | {preempted} of {chunks} | {ledger} | "
        f"{statistics.mean(batch) if batch else math.nan:.2f} | {refused} | {len(samples)} | {load:.1f} |"
    )


def _serve_args(model: str, side: str, extra: list[str]) -> list[str]:
    lead, _, preempt = side.removesuffix("+parts").partition(":")
    if preempt not in ("", "off"):
        raise SystemExit(f"a side is a --lead value, with ':off' after it for --preempt off; got {side!r}")
    return ["--model", model, "--lead", lead, "--preempt", preempt or "auto", *extra]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["procedural", "tinyworld"])
    parser.add_argument(
        "--leads",
        nargs="+",
        default=["1:off", "1", "jit"],
        help="sides to compare: a --lead value, with ':off' after it for --preempt off, '+parts' after that for "
        "clients that take frames in parts",
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of each run")
    parser.add_argument("--media", default="jpeg", choices=["raw", "jpeg", "h264"])
    parser.add_argument("--rounds", type=int, default=1, help="runs of each (model, lead, clients), alternated")
    parser.add_argument(
        "--slack-frames",
        type=float,
        default=1.0,
        help="the clients' players show their first chunk this many frames after it arrives (a jitter buffer)",
    )
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARGS", help="more serve arguments")
    args = parser.parse_args()
    extra = [word for text in args.server_arg for word in text.split()]
    print(
        f"leads bench: models {', '.join(args.models)}, leads {', '.join(args.leads)}, media {args.media}, "
        f"{args.duration:g} s per run, players starting {args.slack_frames:g} frame(s) after the first chunk, "
        f"{os.cpu_count()} CPUs ({platform.machine()}); server and clients on this host"
    )
    print()
    print(
        "| model | lead | clients | key-to-photon p50 / p95 / p99 ms | wait_tick p50 | model p50 | playout p50 "
        "| underruns | late % (mean / worst) | preempted | lost / twice | mean batch | refused | events | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for model in args.models:
        servers = {
            lead: start_server(
                _serve_args(model, lead, extra), f"leads-{model}-{lead.replace(':', '-').replace('+', '-')}"
            )
            for lead in args.leads
        }
        try:
            for _ in range(args.rounds):
                for clients in args.clients:
                    for lead in args.leads:  # the leads alternate: the same minute's machine for both
                        load = os.getloadavg()[0]
                        result = asyncio.run(
                            run_bench(
                                servers[lead].url,
                                clients=clients,
                                duration=args.duration,
                                media=args.media,
                                settle=3.0,
                                playout_slack_frames=args.slack_frames,
                                parts=lead.endswith("+parts"),
                            )
                        )
                        print(row(model, lead, clients, result, load), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print()
    print(
        "key-to-photon: an event's send to the first frame of the chunk that applied it playing (a player at the "
        "model's rate: chunk 0 --slack-frames after it is decoded, each next one a period later, or when decoded "
        "if later, through the adaptive jitter buffer); underruns: times a player's jitter buffer ran dry (a "
        "stall a viewer sees), all sessions; late %: chunks that came after a fixed playout instant (chunk 0 "
        "--slack-frames after it arrived, then a period each); preempted: chunks made again with newer input (their "
        "replacements shown instead) of the chunks shown; lost / twice: accepted events neither applied in a chunk "
        "shown nor reported dropped / applied in two; refused: sessions admission turned away (no headroom); "
        "events: applied events measured; load: the 1-minute load average as the run began."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
