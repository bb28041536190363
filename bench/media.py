"""Media benchmark: what raw, JPEG and H.264 frames cost a session and its viewers, side by side.

1. **Per frame size** (48x48, the procedural world's and tinyworld's; 832x480, wan-causal's,
   the procedural world rendered at that size): one scripted session's frames (standing,
   moving with keys, a camera pan, a prompt switch) are encoded by each media with the code a
   worker runs (``worldserve.media.FrameEncoder``, one per session) and decoded as a client
   does: PSNR against the raw frames, bytes per second per viewer, worker encode ms per
   chunk, client decode ms per chunk (CPU time of the thread that does it: on a shared
   machine, wall time adds whatever else runs), and the transfer of a chunk over a 20
   Mbit/s link. JPEG
   is also measured at the lowest quality whose PSNR is at least H.264's (equal or better
   PSNR, found by bisection), and the cost of an IDR frame on demand (a late joiner) is the
   size of a keyframe chunk against the stream's other chunks.
2. **End to end**, through a real ``worldserve serve`` (one worker process, procedural at each
   size): per media, the latency a chunk's frames add as the client sees it -- the server's
   tick beyond the model's step (the worker's encoding, the bytes' trip back to the server,
   the commit) plus receiving (wall time, over localhost) and decoding (CPU time) the chunk
   at the client -- and the difference to raw.
3. **Members in several media** (per frame size): an H.264 world whose members also asked for
   JPEG, then JPEG and raw, through the code a worker runs (a ``ModelRunner`` with the
   session's ``extra_encodings``, each chunk encoded once per media): the bytes per chunk that
   cross from the worker to the server, by media, and the runner's encode time per chunk
   (``StepReport.encode_s``, wall time, one encode thread; the median, the lower of two runs).
4. **Viewers**: ``worldserve bench --viewers`` with ``--media h264``, and the same with JPEG.

Usage: ``python bench/media.py [--seconds 8] [--sizes 48x48 832x480] [--viewers 4]
[--clients 2] [--smoke]`` (``--smoke``: a few chunks, 48x48 only, for the test suite).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import websockets

from tinyworld import print_table
from worldserve.h264 import H264Decoder, default_bitrate_kbps
from worldserve.media import EncodedFrames, FrameEncoder, FrameEncoding, decode_frames
from worldserve.models.procedural import ProceduralModel
from worldserve.models.world import camera_control, keys_control
from worldserve.protocol import ControlInput, TickRequest
from worldserve.tools.loadtest import format_viewers_table, run_viewers_bench

LINK_MBITS = 20.0


def psnr(a: npt.NDArray[np.uint8], b: npt.NDArray[np.uint8]) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def script(chunk: int) -> tuple[str | None, tuple[ControlInput, ...]]:
    """The session's prompt and held controls at ``chunk``: still, moving, panning, a new style."""
    phase = chunk % 24
    if phase < 2:
        return "islands", (keys_control(), camera_control(0, 0))
    if phase < 10:
        return "islands", (keys_control("D"), camera_control(0, 0))
    if phase < 14:
        return "islands", (keys_control(), camera_control(1.5, -1.0))
    if phase < 20:
        return "a snowy tundra", (keys_control("W", "A"), camera_control(0, 0))
    return "a snowy tundra", (keys_control(), camera_control(0, 0))


def session_frames(width: int, height: int, chunks: int) -> list[npt.NDArray[np.uint8]]:
    """The scripted session's chunks, from the procedural model at ``width`` x ``height``."""
    model = ProceduralModel(width=width, height=height)
    from worldserve.models.base import SessionOptions

    state = model.new_state("bench", SessionOptions(seed=5, prompt="islands"))
    out = []
    for index in range(chunks):
        prompt, controls = script(index)
        tick = TickRequest("bench", f"bench-{index}", index, prompt=prompt, controls=controls)
        (envelope,) = model.step([(state, tick)])
        out.append(np.asarray(envelope["payload"]))
    return out


@dataclass
class Measured:
    label: str
    psnr: float
    bytes_per_chunk: float
    encode_ms: float
    decode_ms: float
    chunk_bytes: list[int]
    keyframes: list[bool]


def measure(
    label: str, encoding: FrameEncoding, chunks: list[npt.NDArray[np.uint8]], fps: float, repeats: int = 2
) -> Measured:
    """:func:`measure_once` ``repeats`` times (fresh encoders): the bytes are the same each time; the
    lowest median times are kept (the machine is shared: the others' load only ever adds)."""
    runs = [measure_once(label, encoding, chunks, fps) for _ in range(repeats)]
    best = runs[0]
    best.encode_ms = min(run.encode_ms for run in runs)
    best.decode_ms = min(run.decode_ms for run in runs)
    return best


def measure_once(label: str, encoding: FrameEncoding, chunks: list[npt.NDArray[np.uint8]], fps: float) -> Measured:
    """Encode every chunk as a worker does, decode as a client does; time both, compare with the raw frames."""
    height, width = chunks[0].shape[1:3]
    encoder = FrameEncoder(encoding, width, height, fps)
    decoder = H264Decoder()
    encode_s, decode_s, sizes, keys, decoded = [], [], [], [], []
    for frames in chunks:
        began = time.thread_time()  # CPU time: on a shared machine wall time adds the others' load
        made: EncodedFrames = encoder.encode(frames)
        encode_s.append(time.thread_time() - began)
        began = time.thread_time()
        back = decoder.decode(made.payloads[0], made.init) if encoding.media == "h264" else decode_frames(made)
        decode_s.append(time.thread_time() - began)
        sizes.append(made.nbytes)
        keys.append(made.keyframe)
        decoded.append(back)
    encoder.close()
    quality = psnr(np.concatenate(decoded), np.concatenate(chunks))
    steady = slice(1, None) if len(chunks) > 1 else slice(None)  # without the first chunk's codec warm-up
    return Measured(
        label,
        quality,
        statistics.mean(sizes),
        statistics.median(encode_s[steady]) * 1000,
        statistics.median(decode_s[steady]) * 1000,
        sizes,
        keys,
    )


def jpeg_matching(target_db: float, chunks: list[npt.NDArray[np.uint8]]) -> int:
    """The lowest JPEG quality whose PSNR (on a sample of the chunks) is at least ``target_db``."""
    sample = chunks[:: max(1, len(chunks) // 6)]
    truth = np.concatenate(sample)

    def quality_db(quality: int) -> float:
        return psnr(np.concatenate([decode_frames(_jpeg(c, quality)) for c in sample]), truth)

    low, high = 1, 100
    while low < high:
        middle = (low + high) // 2
        if quality_db(middle) >= target_db:
            high = middle
        else:
            low = middle + 1
    return low


def _jpeg(frames: npt.NDArray[np.uint8], quality: int) -> EncodedFrames:
    return FrameEncoder(FrameEncoding("jpeg", quality), frames.shape[2], frames.shape[1], 16.0).encode(frames)


def per_size_table(width: int, height: int, chunks_count: int, fps: float, frames_per_chunk: int) -> None:
    chunks = session_frames(width, height, chunks_count)
    chunk_s = frames_per_chunk / fps
    cap = default_bitrate_kbps(width, height, fps)
    rows = [
        measure("raw", FrameEncoding("raw"), chunks, fps),
        measure("jpeg, quality 90 (default)", FrameEncoding("jpeg", 90), chunks, fps),
    ]
    h264 = measure(f"h264, quality 65 (CRF 18), cap {cap} kbit/s (default)", FrameEncoding("h264", 65), chunks, fps)
    matched_q = jpeg_matching(h264.psnr, chunks)
    rows.append(measure(f"jpeg, quality {matched_q} (PSNR >= h264's)", FrameEncoding("jpeg", matched_q), chunks, fps))
    rows.append(h264)
    rows.append(measure("h264, quality 90 (CRF 5), cap 100 Mbit/s", FrameEncoding("h264", 90, 100_000), chunks, fps))
    raw_bytes = rows[0].bytes_per_chunk
    table = [
        [
            "media",
            "PSNR vs raw dB",
            "kB/s per viewer",
            "x raw",
            "worker encode ms/chunk",
            "client decode ms/chunk",
            f"transfer ms/chunk at {LINK_MBITS:g} Mbit/s",
            "added ms/chunk (encode + transfer + decode)",
        ]
    ]
    for row in rows:
        transfer = row.bytes_per_chunk * 8 / (LINK_MBITS * 1e6) * 1000
        table.append(
            [
                row.label,
                "exact" if math.isinf(row.psnr) else f"{row.psnr:.1f}",
                f"{row.bytes_per_chunk / chunk_s / 1000:.1f}",
                f"{row.bytes_per_chunk / raw_bytes:.3f}",
                f"{row.encode_ms:.2f}",
                f"{row.decode_ms:.2f}",
                f"{transfer:.1f}",
                f"{row.encode_ms + transfer + row.decode_ms:.1f}",
            ]
        )
    print(f"\n### {width}x{height}, {fps:g} fps, {frames_per_chunk} frames per chunk ({chunks_count} chunks)\n")
    print_table(table)
    print(
        f"\nAt equal-or-better PSNR: h264 {h264.bytes_per_chunk / chunk_s / 1000:.1f} kB/s vs JPEG quality "
        f"{matched_q} {rows[2].bytes_per_chunk / chunk_s / 1000:.1f} kB/s "
        f"({rows[2].bytes_per_chunk / h264.bytes_per_chunk:.1f}x), raw {raw_bytes / chunk_s / 1000:.1f} kB/s "
        f"({raw_bytes / h264.bytes_per_chunk:.0f}x)."
    )
    # An IDR frame on demand (a late joiner): what one keyframe chunk costs every member, once.
    encoder = FrameEncoder(FrameEncoding("h264", 65), width, height, fps)
    middle = len(chunks) // 2
    sizes = []
    for index, frames in enumerate(chunks):
        if index == middle:
            encoder.keyframe()
        sizes.append(encoder.encode(frames).nbytes)
    encoder.close()
    others = statistics.median(sizes[1:middle] + sizes[middle + 1 :]) if len(sizes) > 2 else float("nan")
    print(
        f"A keyframe chunk on demand (init segment included): {sizes[middle] / 1000:.1f} kB against "
        f"{others / 1000:.1f} kB for the stream's median chunk: {(sizes[middle] - others) / 1000:.1f} kB more, once "
        f"per join or skip."
    )


# -- a world whose members use several media ------------------------------------------------


def several_media_once(
    width: int, height: int, chunks_count: int, extra: tuple[FrameEncoding, ...]
) -> tuple[dict[str, float], float]:
    """One scripted H.264 session through a runner that also encodes ``extra``: mean bytes per
    chunk by media, and the median encode ms per chunk (without the first chunk's warm-up)."""
    from worldserve.models.base import SessionOptions
    from worldserve.runtime import ModelRunner
    from worldserve.runtime.messages import TickOutput

    runner = ModelRunner(ProceduralModel(width=width, height=height))
    runner.admit("bench", SessionOptions(seed=5, prompt="islands", encoding=FrameEncoding("h264", 65)))
    runner.set_extra_encodings("bench", extra)
    sizes: dict[str, list[int]] = {}
    encode_ms = []
    for index in range(chunks_count):
        prompt, controls = script(index)
        report = runner.step([TickRequest("bench", f"bench-{index}", index, prompt=prompt, controls=controls)])
        (result,) = report.results
        assert isinstance(result, TickOutput)
        assert isinstance(result.frames, EncodedFrames)
        for media, version in result.frames.versions().items():
            sizes.setdefault(media, []).append(version.nbytes)
        encode_ms.append(report.encode_s * 1000)
    runner.close_ar_diffusion_session("bench")
    steady = encode_ms[1:] if len(encode_ms) > 1 else encode_ms
    return {media: statistics.mean(values) for media, values in sizes.items()}, statistics.median(steady)


def several_media_table(width: int, height: int, chunks_count: int) -> None:
    jpeg, raw = FrameEncoding.for_media("jpeg"), FrameEncoding.for_media("raw")
    table = [
        [
            "media in use",
            "kB per chunk, worker -> server",
            "of it h264 / jpeg / raw kB",
            "x h264 only",
            "worker encode ms/chunk",
            "x h264 only",
        ]
    ]
    base_bytes = base_ms = 0.0
    for label, extra in (("h264 only", ()), ("h264 + jpeg", (jpeg,)), ("h264 + jpeg + raw", (jpeg, raw))):
        runs = [several_media_once(width, height, chunks_count, extra) for _ in range(2)]
        sizes = runs[0][0]  # the bytes are the same each run
        encode_ms = min(run[1] for run in runs)  # the machine is shared: the others' load only ever adds
        total = sum(sizes.values())
        if not extra:
            base_bytes, base_ms = total, encode_ms
        parts = " / ".join(f"{sizes[m] / 1000:.1f}" if m in sizes else "-" for m in ("h264", "jpeg", "raw"))
        table.append(
            [
                label,
                f"{total / 1000:.1f}",
                parts,
                f"{total / base_bytes:.1f}",
                f"{encode_ms:.2f}",
                f"{encode_ms / base_ms:.1f}" if base_ms > 0 else "-",
            ]
        )
    print(f"\n### Members in several media, {width}x{height} ({chunks_count} chunks, one runner)\n")
    print_table(table)


# -- end to end, through a real server -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(width: int, height: int) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="media-bench-", suffix=".log")[1])
    command = [sys.executable, "-m", "worldserve", "serve", "--port", str(port), "--log-level", "warning"]
    command += ["--model", "procedural", "--workers", "1"]
    command += ["--model-option", f"width={width}", "--model-option", f"height={height}"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("server did not start")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()


async def chunk_latencies(port: int, media: str, chunks: int) -> dict[str, float]:
    """A session over a raw socket: per chunk, the server's timings and the client's receive + decode."""
    overheads, encodes, client = [], [], []
    decoder = H264Decoder()
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/world", max_size=None) as ws:
        start = json.dumps({"type": "session.start", "seed": 5, "options": {"media": media}})
        await ws.send(start)
        received = 0
        while received < chunks:
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if message["type"] == "error" and message["code"] == "admission_refused":
                # The last session's close is still on its way: a slow worker has no room for two.
                await asyncio.sleep(message["retry_after_ms"] / 1000)
                await ws.send(start)
                continue
            if message["type"] == "error":
                raise RuntimeError(f"the server refused the session: {message}")
            if message["type"] != "chunk":
                continue
            header_at = time.perf_counter()
            frames = message["frames"]
            payloads = [await ws.recv() for _ in frames["sizes"]]
            receive_s = time.perf_counter() - header_at
            decode_began = time.thread_time()  # CPU time: on a shared machine wall time adds the others' load
            if media == "h264":
                cut = frames.get("init_bytes") or 0
                decoder.decode(payloads[0][cut:], payloads[0][:cut])
            elif media == "jpeg":
                encoded = EncodedFrames(
                    FrameEncoding("jpeg"), frames["width"], frames["height"], tuple(bytes(p) for p in payloads)
                )
                decode_frames(encoded)
            else:
                for payload in payloads:
                    np.frombuffer(payload, np.uint8).reshape(frames["height"], frames["width"], 3)
            client.append(receive_s + time.thread_time() - decode_began)
            await ws.send(json.dumps({"type": "chunk.ack", "seq": message["seq"]}))
            received += 1
            if received > 2:  # past the first chunks' warm-up
                timings = message["timings"]
                overheads.append(timings["tick_ms"] - timings["model_ms"])  # the step itself is the same for all
                encodes.append(timings["encode_ms"])
        await ws.send(json.dumps({"type": "session.close"}))
    return {
        "server": statistics.median(overheads),
        "encode": statistics.median(encodes),
        "client": statistics.median(client[3:]) * 1000,
    }


def end_to_end_table(sizes: list[tuple[int, int]], chunks: int) -> None:
    table = [
        [
            "size",
            "media",
            "server tick beyond the model's step ms",
            "of it, worker encode ms",
            "client receive + decode ms",
            "latency the frames add ms",
            "vs raw ms",
        ]
    ]
    for width, height in sizes:
        process, port = start_server(width, height)
        try:
            measured = {}
            for media in ("raw", "jpeg", "h264"):
                # Twice, keeping the lower medians: on a shared machine the others' load only ever adds.
                runs = [asyncio.run(chunk_latencies(port, media, chunks)) for _ in range(2)]
                measured[media] = {key: min(run[key] for run in runs) for key in runs[0]}
        finally:
            stop(process)
        base = measured["raw"]["server"] + measured["raw"]["client"]
        for media, m in measured.items():
            total = m["server"] + m["client"]
            table.append(
                [
                    f"{width}x{height}",
                    media,
                    f"{m['server']:.1f}",
                    f"{m['encode']:.2f}",
                    f"{m['client']:.1f}",
                    f"{total:.1f}",
                    "-" if media == "raw" else f"{total - base:+.1f}",
                ]
            )
    print(
        f"\n### End to end through worldserve serve (one worker process; medians over {chunks} chunks, "
        "the lower of two sessions)\n"
    )
    print_table(table)


def viewers_tables(clients: int, viewers: int, seconds: float) -> None:
    process, port = start_server(48, 48)
    try:
        for media in ("h264", "jpeg"):
            alone, shared = asyncio.run(
                run_viewers_bench(
                    f"ws://127.0.0.1:{port}/v1/world",
                    clients=clients,
                    duration=seconds,
                    event_interval=0.25,
                    viewers=viewers,
                    media=media,
                )
            )
            print(f"\n### Viewers, {media}: {clients} sessions at 48x48, {viewers} viewers each, {seconds:g} s\n")
            print(format_viewers_table(alone, shared))
    finally:
        stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="video per size (%(default)s s)")
    parser.add_argument("--sizes", nargs="+", default=["48x48", "832x480"], help="WIDTHxHEIGHT (%(default)s)")
    parser.add_argument("--clients", type=int, default=2, help="viewers bench: sessions (%(default)s)")
    parser.add_argument("--viewers", type=int, default=4, help="viewers bench: viewers per session (%(default)s)")
    parser.add_argument("--smoke", action="store_true", help="a few chunks, 48x48 only (the test suite's run)")
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.sizes, args.viewers = 1.0, ["48x48"], 1
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes]
    fps, frames_per_chunk = 16.0, 4
    chunks = max(2, round(args.seconds * fps / frames_per_chunk))
    print(
        f"media benchmark: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}"
    )
    for width, height in sizes:
        per_size_table(width, height, chunks, fps, frames_per_chunk)
    for width, height in sizes:
        several_media_table(width, height, chunks)
    end_to_end_table([(w, h) for w, h in sizes], max(6, chunks))
    viewers_tables(args.clients, args.viewers, max(1.5, args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
