"""What a viewer costs the front-end: WebRTC (WHEP) beside WebSocket (one encode per chunk and media, shared by
every viewer). A WHEP viewer that offers H.264 is sent the world's H.264 stream, encoded once for all of them
and only packetised per peer; one that offers VP8 alone gets raw frames that aiortc encodes for it.

One command (``python bench/webrtc_viewers.py``): a real server (the procedural model at
``--size``), one host playing a world, then for each transport N viewers of that world for
``--duration`` seconds: WebSocket viewers, WHEP viewers offering VP8 alone (one encode each), WHEP
viewers offering H.264 (the shared stream). The server process's CPU time (user + system, from /proc) over the window,
less the window with no viewer, divided by N, is one viewer's cost; frames each viewer received
per second say they were served. The viewers run in this process (WebRTC: aiortc peers decoding;
WebSocket: ``WorldClient`` in the world's media), so on a small machine they compete with the
server for the CPU: compare the two transports side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from worldserve.client import WorldClient

HZ = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ  # utime + stime


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _whep_viewer(
    http: str, session_id: str, token: str, counts: list[int], stop: asyncio.Event, codec: str
) -> None:
    import aiortc

    pc = aiortc.RTCPeerConnection()
    transceiver = pc.addTransceiver("video", direction="recvonly")
    codecs = aiortc.RTCRtpReceiver.getCapabilities("video").codecs
    transceiver.setCodecPreferences([c for c in codecs if c.mimeType.lower() in (f"video/{codec}", "video/rtx")])
    got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    pc.on("track", lambda track: got.done() or got.set_result(track))
    await pc.setLocalDescription(await pc.createOffer())
    request = urllib.request.Request(
        f"{http}/v1/whep/{session_id}",
        data=pc.localDescription.sdp.encode(),
        method="POST",
        headers={"Content-Type": "application/sdp", "Authorization": f"Bearer {token}"},
    )
    with await asyncio.to_thread(urllib.request.urlopen, request, timeout=30) as response:
        answer, location = response.read().decode(), response.headers["Location"]
    await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=answer, type="answer"))
    track = await asyncio.wait_for(got, 30)
    index = len(counts)
    counts.append(0)
    try:
        while not stop.is_set():
            await asyncio.wait_for(track.recv(), 10)
            counts[index] += 1
    finally:
        leave = urllib.request.Request(f"{http}{location}", method="DELETE")
        await asyncio.to_thread(urllib.request.urlopen, leave, timeout=10)
        await pc.close()


async def _ws_viewer(ws: str, session_id: str, token: str, counts: list[int], stop: asyncio.Event) -> None:
    async with WorldClient(ws) as viewer:
        await viewer.join(session_id, token)
        index = len(counts)
        counts.append(0)
        while not stop.is_set():
            counts[index] += len((await viewer.next_chunk(timeout=10)).frames)


async def _window(pid: int, seconds: float) -> float:
    began, cpu = time.monotonic(), _cpu_s(pid)
    await asyncio.sleep(seconds)
    return (_cpu_s(pid) - cpu) / (time.monotonic() - began)


async def _run(args: argparse.Namespace) -> None:
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="worldserve-bench-", suffix=".log", delete=False)  # noqa: SIM115
    command = [sys.executable, "-m", "worldserve", "serve", "--model", "procedural", "--port", str(port)]
    command += [
        "--model-option",
        f"height={args.size}",
        "--model-option",
        f"width={args.size}",
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220 -- set-up
    http, ws = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/world"
    try:
        for _ in range(600):
            try:
                (await asyncio.to_thread(urllib.request.urlopen, http + "/healthz", timeout=1)).close()
                break
            except OSError:
                await asyncio.sleep(0.1)
        async with WorldClient(ws) as host:
            info = await host.start(seed=1, share_viewers=True, media=args.media)
            assert info.viewer_token is not None
            playing = asyncio.Event()

            async def play() -> None:
                while True:
                    await host.next_chunk(timeout=10)
                    playing.set()

            player = asyncio.create_task(play())
            await playing.wait()
            await asyncio.sleep(1.0)
            idle = await _window(server.pid, args.duration)
            rows = [("none", 0, idle, float("nan"), float("nan"))]
            for transport in ("websocket", "webrtc vp8 (per peer)", "webrtc h264 (shared)"):
                stop = asyncio.Event()
                counts: list[int] = []
                token = info.viewer_token
                viewers = [
                    asyncio.create_task(
                        _ws_viewer(ws, info.session_id, token, counts, stop)
                        if transport == "websocket"
                        else _whep_viewer(http, info.session_id, token, counts, stop, transport.split()[1])
                    )
                    for _ in range(args.viewers)
                ]
                while len(counts) < args.viewers:  # noqa: ASYNC110 -- all of them receiving
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)
                before = list(counts)
                began = time.monotonic()
                cpu = await _window(server.pid, args.duration)
                fps = sum(now - then for now, then in zip(counts, before, strict=True)) / args.viewers
                fps /= time.monotonic() - began
                stop.set()
                await asyncio.gather(*viewers, return_exceptions=True)
                rows.append((transport, args.viewers, cpu, (cpu - idle) / args.viewers, fps))
                await asyncio.sleep(1.0)
            player.cancel()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(
        f"viewers bench: procedural {args.size}x{args.size} at 16 fps, the world in {args.media}, "
        f"{args.viewers} viewers, {args.duration:g} s windows; {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; viewers in this process"
    )
    print("| viewers | count | server CPU (cores) | per viewer (cores) | frames/s each |")
    print("|---|---|---|---|---|")
    for transport, count, cpu, each, fps in rows:
        print(f"| {transport} | {count} | {cpu:.3f} | {each:.4f} | {fps:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewers", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--size", type=int, default=192, help="the procedural world's frame side (pixels)")
    parser.add_argument("--media", default="jpeg", choices=("jpeg", "raw", "h264"), help="the world's (host's) media")
    asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
