"""Key-to-photon over WebRTC and over WebSockets across a slow, lossy link, side by side.

For each link (``clean``: ``--delay-ms`` each way; ``lossy``: the same and ``--loss`` of the packets each way; built
by ``bench/link.py``: two network namespaces joined by TUN devices, since this kernel has no netem) it starts a
server in the server's namespace, then drives it from the client's with ``worldserve bench``'s client
(``run_bench``, one session steered for ``--duration`` seconds) once per transport, in turn:

- ``ws/jpeg``, ``ws/h264``: the session over a WebSocket (TCP), its player the page's adaptive jitter buffer;
- ``webrtc``: over ``/v1/webrtc`` (the protocol on an SCTP data channel, the frames VP8 on an RTP video track, UDP),
  each chunk's first frame shown as it is decoded (a WebRTC player's own jitter buffer is not modelled).

The table: key-to-photon p50 / p95 / p99 (an event's send to the first frame of the chunk that applied it shown;
docs/latency.md), the age of each chunk's first frame as it is shown (from when the server encoded it), the
jitter buffer's underruns, the frames shown per second, and the packets the link dropped. One clock: both
namespaces read this machine's CLOCK_MONOTONIC. Needs root (``bench/link.py``).

Usage: ``python bench/webrtc_latency.py [--model procedural] [--model-option frames_per_chunk=2] [--duration 20]
[--delay-ms 20] [--loss 0.01] [--transports ws/jpeg ws/h264 webrtc] [--links clean lossy] [--page] [--parts]
[--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from link import Link, available
from worldserve.tools.loadtest import BenchResult, format_k2p_table, run_bench

PORT = 8790


def _ms(values: list[float], q: float) -> str:
    return f"{_q(values, q) * 1000:.0f}" if values else "-"


def _wait_healthy(link: Link, deadline: float) -> None:
    url = f"http://{link.server_ip}:{PORT}/healthz"
    with link.inside("client"):
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server at {url} did not come up")
            time.sleep(0.2)


def _at(link: Link) -> list[str]:
    return ["--host", link.server_ip, "--port", str(PORT)]


def run_side(link: Link, transport: str, duration: float) -> tuple[BenchResult, int]:
    kind, _, media = transport.partition("/")
    dropped = link.dropped
    with link.inside("client"):  # the bench's sockets (and its threads') are the client namespace's
        result = asyncio.run(
            run_bench(
                f"ws://{link.server_ip}:{PORT}/v1/world",
                clients=1,
                duration=duration,
                settle=3.0,
                media=media or "raw",
                playout_slack_frames=1.0,
                transport="webrtc" if kind == "webrtc" else "ws",
                same_clock=True,
            )
        )
    return result, link.dropped - dropped


def row(name: str, transport: str, result: BenchResult, dropped: int) -> str:
    total = [sample.total for sample in result.k2p]
    ages = result.ages
    reports = result.reports
    shown_fps = [r.frames / r.seconds for r in reports if r.seconds > 0]
    errors = sum(sum(r.errors.values()) for r in reports)
    ledger = f"{sum(r.lost for r in reports)} / {sum(r.applied_twice for r in reports)}"
    fps = statistics.mean(shown_fps) if shown_fps else float("nan")
    underruns = sum(r.underruns for r in reports) if transport != "webrtc" else "-"
    return (
        f"| {name} | {transport} | {_ms(total, 0.5)} / {_ms(total, 0.95)} / {_ms(total, 0.99)} | "
        f"{_ms(ages, 0.5)} / {_ms(ages, 0.99)} / {_ms(ages, 1.0)} | {underruns} | "
        f"{fps:.1f} | {len(total)} | {ledger} | {errors} | {dropped} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="procedural")
    parser.add_argument(
        "--model-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to the server (e.g. frames_per_chunk=2: chunks half as long)",
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of steering per run")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way (20: a 40 ms round trip)")
    parser.add_argument("--loss", type=float, default=0.01, help="the lossy link's packet loss, each way")
    parser.add_argument("--transports", nargs="+", default=["ws/jpeg", "ws/h264", "webrtc"])
    parser.add_argument("--links", nargs="+", default=["clean", "lossy"], choices=("clean", "lossy"))
    parser.add_argument("--parts", action="store_true", help="also print each run's key-to-photon parts")
    parser.add_argument(
        "--page",
        action="store_true",
        help="also steer the real page in headless Chromium (in the client's namespace) over each transport: "
        "its own key-to-photon figures (a browser's WebRTC receiver, not aiortc's)",
    )
    parser.add_argument("--interval", type=float, default=0.5, help="--page: mean seconds between its inputs")
    parser.add_argument("--smoke", action="store_true", help="a short run of each (for the test suite)")
    args = parser.parse_args()
    if (why := available()) is not None:
        raise SystemExit(f"bench/webrtc_latency.py: cannot make the link here: {why}")
    duration = 3.0 if args.smoke else args.duration
    options = "".join(f" {option}" for option in args.model_option)
    print(f"# {args.model}{options}, {duration:g} s per run, {args.delay_ms:g} ms each way; cpu count {os.cpu_count()}")
    lines = [
        "| link | transport | key-to-photon p50 / p95 / p99 ms | chunk age shown p50 / p99 / max ms | underruns | "
        "frames/s shown | events | lost / twice | errors | packets dropped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    p95: dict[tuple[str, str], float] = {}
    page_p95: dict[tuple[str, str], float] = {}
    page_lines = [
        "| link | transport (the page) | key-to-photon p50 / p95 / p99 ms | figures | underruns | packets dropped |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.links:
        loss = args.loss if name == "lossy" else 0.0
        with Link(delay=args.delay_ms / 1000.0, loss=loss, seed=1) as link:
            log = Path(os.environ.get("TMPDIR", "/tmp")) / f"webrtc_latency_{name}.log"
            with log.open("wb") as out:
                server = link.popen(
                    "server",
                    [
                        *(sys.executable, "-m", "worldserve", "serve", "--model", args.model, *_at(link)),
                        *(arg for option in args.model_option for arg in ("--model-option", option)),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
                try:
                    _wait_healthy(link, time.monotonic() + 60)
                    for transport in args.transports:
                        result, dropped = run_side(link, transport, duration)
                        line = row(f"{name} ({loss * 100:g} % loss)", transport, result, dropped)
                        lines.append(line)
                        print(line, flush=True)
                        if args.parts:
                            print(format_k2p_table(result), flush=True)
                        if result.k2p:
                            p95[(name, transport)] = _q([sample.total for sample in result.k2p], 0.95)
                    for transport in args.transports if args.page else ():
                        line, total = page_row(link, f"{name} ({loss * 100:g} % loss)", transport, duration, args)
                        page_lines.append(line)
                        print(line, flush=True)
                        if total:
                            page_p95[(name, transport)] = _q(total, 0.95)
                finally:
                    server.terminate()
                    server.wait(timeout=30)
    print()
    print("\n".join(lines))
    _compare(args, p95, "")
    if args.page:
        print()
        print("\n".join(page_lines))
        _compare(args, page_p95, " (the page)")


def _compare(args: argparse.Namespace, p95: dict[tuple[str, str], float], what: str) -> None:
    for name in args.links:
        rtc = p95.get((name, "webrtc"))
        for transport in args.transports:
            other = p95.get((name, transport))
            if transport != "webrtc" and rtc is not None and other:
                print(f"{name}: webrtc key-to-photon p95 vs {transport}{what}: {(rtc / other - 1) * 100:+.0f} %")


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def page_row(
    link: Link, name: str, transport: str, duration: float, args: argparse.Namespace
) -> tuple[str, list[float]]:
    """The page in headless Chromium, started in the client's namespace, steering a world over ``transport``."""
    from page_latency import steer_page

    kind, _, media = transport.partition("/")
    query = "transport=webrtc" if kind == "webrtc" else f"media={media}"
    dropped = link.dropped
    with link.inside("client"):  # playwright's driver and Chromium are started from here: the client's
        figures = steer_page(f"http://{link.server_ip}:{PORT}/?{query}", duration, args.interval, seed=1)
    total = figures["totals"]
    cells = " / ".join(f"{_q(total, q):.0f}" for q in (0.5, 0.95, 0.99)) if total else "-"
    underruns = figures["underruns"] if kind != "webrtc" else "-"
    if args.parts and total:  # the page's own parts (over WebRTC, transfer is the network both ways and the
        # browser's receiver, jitter buffer included, up to requestVideoFrameCallback: its decode and buffer are 0)
        print("page key-to-photon ms       p50       p95       p99", flush=True)
        for part, values in (("total", total), *figures["parts"].items()):
            if values:
                print(f"  {part:<24}" + "".join(f"{_q(values, q):10.1f}" for q in (0.5, 0.95, 0.99)), flush=True)
    return f"| {name} | {transport} | {cells} | {len(total)} | {underruns} | {link.dropped - dropped} |", total


if __name__ == "__main__":
    main()
