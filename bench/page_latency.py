"""Key-to-photon through the real page in headless Chromium, beside ``worldserve bench``'s figure, in one run.

For each model and lead, starts a server; for each media, opens the player page in Debian's
headless Chromium (playwright drives it, as the browser tests do), starts a world, and steers it
the way a player does: a movement key pressed or released at random instants (one input every
``--interval`` seconds on average, uniform in [0.5, 1.5] of it), each a change of the held keys.
The page measures each figure itself (``window.worldserve.keyToPhotonLog``: input -> the first
frame on screen of the chunk that applied it, from the earliest input that chunk applied).
Then ``worldserve bench``'s client (``run_bench``, one session, the same media, the same input
rate, its player the page's jitter buffer) runs against the same server, and its figure is
counted the page's way: per chunk, from its earliest applied input. Two tables out: page and
bench p50 / p95 / p99, the bench's p50 against the page's (with a 95 % bootstrap interval: both sets of
figures drawn again with replacement, 2,000 times, so a run says whether the medians differ by more
than its few dozen inputs can tell), and both jitter buffers' underruns;
then each part's p50, the page's beside the bench's (the page's parts: wait_tick, step = queue
+ model, encode, transfer = up + handoff + down, decode, buffer = playout; docs/latency.md).

``--frames parts`` has the page and the bench take each chunk's frames in parts as the model makes them
(the page's default, ``options.parts``; a model whose spec says ``frame_parts``, JPEG or raw), ``whole``
takes them whole (``?parts=0``); both, in turn on the same server: side by side.

Usage: ``python bench/page_latency.py [--models procedural tinyworld] [--leads jit 1]
[--media jpeg h264] [--frames parts] [--duration 20] [--interval 0.5] [--server-arg ARGS]``;
``--smoke``: one short run (procedural, jit, jpeg). Needs Chromium (``make browser``;
``WORLDSERVE_CHROMIUM`` names another) and playwright (the ``dev`` extra). The server, the browser and
the bench share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

from servers import BenchServer, start_server
from worldserve.tools.loadtest import KeyToPhoton, run_bench

CHROMIUM = os.environ.get("WORLDSERVE_CHROMIUM", "/usr/bin/chromium")
#: The page's parts of key-to-photon (player.js, photonShown) and the bench's that make each up.
PARTS = {
    "wait_tick": ("wait_tick",),
    "step": ("queue", "model"),
    "encode": ("encode",),
    "transfer": ("up", "handoff", "down"),
    "decode": ("decode",),
    "buffer": ("playout",),
}
_KEYS = ("KeyW", "KeyA", "KeyS", "KeyD")


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _p50(values: list[float]) -> str:
    return f"{_ms(values, 0.5):.0f}" if values else "-"


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{_ms(values, 0.5):.0f} / {_ms(values, 0.95):.0f} / {_ms(values, 0.99):.0f} ({len(values)})"


def ratio_interval(bench: list[float], page: list[float], seed: int, rounds: int = 2000) -> tuple[float, float]:
    """The 95 % bootstrap interval of median(bench) / median(page) - 1: each set drawn again with replacement."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(bench, k=len(bench))) / statistics.median(rng.choices(page, k=len(page))) - 1
        for _ in range(rounds)
    )
    return ratios[int(0.025 * (rounds - 1))], ratios[int(0.975 * (rounds - 1))]


def page_figures(
    server: BenchServer, media: str, duration: float, interval: float, seed: int, parts: bool = True
) -> dict[str, Any]:
    """Steer one world through the page for ``duration`` s; the page's own figures (ms) and its underruns."""
    query = f"?media={media}" + ("" if parts else "&parts=0")
    return steer_page(f"http://127.0.0.1:{server.port}/{query}", duration, interval, seed)


def steer_page(url: str, duration: float, interval: float, seed: int) -> dict[str, Any]:
    """Open the player at ``url`` (its query picks the media or the transport), start a world and steer it for
    ``duration`` s; the page's own key-to-photon figures (ms), their parts and its jitter buffer's underruns."""
    from playwright.sync_api import sync_playwright

    rng = random.Random(seed)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-features=WebRtcHideLocalIpsWithMdns",  # WebRTC: host candidates as addresses
            ],
        )
        try:
            page = browser.new_page()
            page.goto(url)
            page.click("#start")
            page.wait_for_function("window.worldserve.status === 'live' && window.worldserve.displayed > 8")
            page.click("#screen")  # the keys go to the player
            held: str | None = None
            deadline = time.monotonic() + duration
            while time.monotonic() < deadline:
                time.sleep(interval * rng.uniform(0.5, 1.5))
                if held is None:
                    held = rng.choice(_KEYS)
                    page.keyboard.down(held)
                else:
                    page.keyboard.up(held)
                    held = None
            if held is not None:
                page.keyboard.up(held)
            time.sleep(2.0)  # the last inputs reach the screen
            log = page.evaluate("window.worldserve.keyToPhotonLog")
            jitter = page.evaluate("window.worldserve.jitter")
        finally:
            browser.close()
    parts = {part: [float(e[part]) for e in log if part in e] for part in PARTS}
    return {"totals": [float(entry["total"]) for entry in log], "parts": parts, "underruns": int(jitter["underruns"])}


def bench_figures(
    server: BenchServer, media: str, duration: float, interval: float, seed: int, parts: bool = True
) -> dict[str, Any]:
    """``worldserve bench``'s one session against the same server, counted as the page counts (ms)."""
    result = asyncio.run(
        run_bench(
            server.url,
            clients=1,
            duration=duration,
            event_interval=interval,
            media=media,
            settle=3.0,
            seed=seed,
            playout_slack_frames=1.0,
            parts=parts and media != "h264",
        )
    )
    by_chunk: dict[float, list[KeyToPhoton]] = defaultdict(list)
    for sample in result.k2p:
        by_chunk[sample.shown].append(sample)  # the events one chunk applied share its first frame's instant
    earliest = [max(samples, key=lambda s: s.total) for samples in by_chunk.values()]
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    for sample in earliest:
        split = sample.parts(result.offset)
        for part, names in PARTS.items():  # the bench's finer parts, summed into the page's
            parts[part].append(sum(split[name] for name in names) * 1000)
    return {
        "totals": [s.total * 1000 for s in earliest],
        "parts": parts,
        "underruns": sum(r.underruns for r in result.reports),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["procedural", "tinyworld"])
    parser.add_argument("--leads", nargs="+", default=["jit", "1"], help="--lead values to serve with")
    parser.add_argument("--media", nargs="+", default=["jpeg", "h264"], choices=["raw", "jpeg", "h264"])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of steering per run")
    parser.add_argument("--interval", type=float, default=0.5, help="mean seconds between two inputs")
    parser.add_argument(
        "--frames",
        nargs="+",
        default=["parts"],
        choices=["parts", "whole"],
        help="frames in parts as the model makes them (the page's default) and/or whole, in turn",
    )
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARGS", help="more serve arguments")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="one short run: procedural, jit, jpeg, 3 s")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.leads, args.media, args.duration = ["procedural"], ["jit"], ["jpeg"], 3.0
    if not os.path.exists(CHROMIUM):
        print(f"Chromium not found at {CHROMIUM}: `make browser` installs Debian's.", file=sys.stderr)
        return 2
    print(
        f"page latency bench: models {', '.join(args.models)}, leads {', '.join(args.leads)}, media "
        f"{', '.join(args.media)}, {args.duration:g} s per run, an input every {args.interval:g} s on average, "
        f"{os.cpu_count()} CPUs ({platform.machine()}); server, Chromium and the bench on this host"
    )
    print()
    print(
        "| model | lead | media | frames | page key-to-photon p50 / p95 / p99 ms (n) | bench p50 / p95 / p99 ms (n) "
        "| bench p50 vs page (95 % interval) | underruns page / bench | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    split: list[str] = []
    for model in args.models:
        for lead in args.leads:
            extra = [word for text in args.server_arg for word in text.split()]
            server = start_server(["--model", model, "--lead", lead, *extra], f"page-{model}-{lead}", timeout=300.0)
            try:
                for media, frames in ((m, f) for m in args.media for f in args.frames):
                    load = os.getloadavg()[0]
                    parts = frames == "parts"
                    page = page_figures(server, media, args.duration, args.interval, args.seed, parts)
                    bench = bench_figures(server, media, args.duration, args.interval, args.seed, parts)
                    versus = "-"
                    if page["totals"] and bench["totals"]:
                        ratio = statistics.median(bench["totals"]) / statistics.median(page["totals"]) - 1
                        low, high = ratio_interval(bench["totals"], page["totals"], args.seed)
                        versus = f"{ratio * 100:+.0f} % ({low * 100:+.0f} to {high * 100:+.0f})"
                    print(
                        f"| {model} | {lead} | {media} | {frames} | {_spread(page['totals'])} "
                        f"| {_spread(bench['totals'])} "
                        f"| {versus} | {page['underruns']} / {bench['underruns']} | {load:.1f} |",
                        flush=True,
                    )
                    cells = [f"{_p50(page['parts'][part])} / {_p50(bench['parts'][part])}" for part in PARTS]
                    split.append(f"| {model} | {lead} | {media} | {frames} | " + " | ".join(cells) + " |")
            finally:
                server.stop()
    print()
    print("| model | lead | media | frames | " + " | ".join(f"{part} p50 page / bench" for part in PARTS) + " |")
    print("|---|---|---|---|" + "---|" * len(PARTS))
    print("\n".join(split))
    print()
    print(
        "page: the player's own figure (window.worldserve.keyToPhotonLog): an input's send to the first frame on "
        "screen of the chunk that applied it, from the earliest input that chunk applied; bench: worldserve "
        "bench's client (its jitter buffer plays as the page's does), counted the same way; underruns: times "
        "each one's jitter buffer ran dry while live; load: the 1-minute load average as the run began."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
