"""``worldserve record``: play a scripted event list against a server; save video + sidecar.

Owns: the script format (JSON: ``{"prompt", "seed", "chunks", "events": [{"after_chunk":
k, "prompt"?, "controls"?}]}``: each event is sent once chunk ``k`` has arrived), writing
the frames as GIF (Pillow) or MP4 (imageio-ffmpeg, whose wheel carries ffmpeg), and a
JSON sidecar of every chunk and of where each event went (the chunk that applied it,
or the drop notice).

Must not know: the server's internals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image

from worldserve.client import WorldClient, WorldError

__all__ = ["Recording", "load_script", "record", "write_video"]


@dataclass(frozen=True)
class Recording:
    frames: npt.NDArray[np.uint8]
    sidecar: dict[str, Any]


def load_script(path: str | Path) -> dict[str, Any]:
    """Read and check a script; raise ``ValueError`` saying what is wrong."""
    script = json.loads(Path(path).read_text())
    if not isinstance(script, dict):
        raise ValueError("script must be a JSON object.")
    chunks = script.get("chunks", 16)
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError("script 'chunks' must be a positive integer.")
    events = script.get("events", [])
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        raise ValueError("script 'events' must be a list of objects.")
    for index, event in enumerate(events):
        after = event.get("after_chunk", -1)
        if not isinstance(after, int) or after < -1:
            raise ValueError(f"events[{index}].after_chunk must be an integer >= -1.")
        if "prompt" not in event and not event.get("controls"):
            raise ValueError(f"events[{index}] must carry a prompt and/or controls.")
    return script


async def record(url: str, script: dict[str, Any], *, token: str | None = None) -> Recording:
    """Run ``script`` against the server at ``url``; return its frames and sidecar."""
    chunks_wanted: int = script.get("chunks", 16)
    pending = sorted(enumerate(script.get("events", [])), key=lambda item: item[1].get("after_chunk", -1))
    events: list[dict[str, Any]] = []
    chunk_log: list[dict[str, Any]] = []
    frames: list[npt.NDArray[np.uint8]] = []
    next_event_id = 1

    async def send_due(client: WorldClient, received: int) -> None:
        nonlocal next_event_id
        while pending and pending[0][1].get("after_chunk", -1) < received:
            index, event = pending.pop(0)
            entry: dict[str, Any] = {"script_index": index, "event_id": next_event_id, "sent_after_chunks": received}
            try:
                acceptance = await client.send_event(
                    event_id=next_event_id, prompt=event.get("prompt"), controls=event.get("controls", [])
                )
                entry["status"] = acceptance.status
            except WorldError as error:
                entry["status"] = "error"
                entry["error"] = {"code": error.code, "message": error.message}
            events.append(entry)
            next_event_id += 1

    async with WorldClient(url, token=token) as client:
        info = await client.start(prompt=script.get("prompt"), seed=int(script.get("seed", 0)), media="raw")
        await send_due(client, 0)
        while len(chunk_log) < chunks_wanted:
            chunk = await client.next_chunk(timeout=30.0)
            frames.extend(chunk.frames)
            chunk_log.append(
                {
                    "chunk_index": chunk.chunk_index,
                    "epoch": chunk.epoch,
                    "request_id": chunk.request_id,
                    "applied_event_ids": list(chunk.applied_event_ids),
                    "timings": chunk.timings,
                }
            )
            await send_due(client, len(chunk_log))
        await client.close()
        dropped = [{"event_ids": list(d.event_ids), "reason": d.reason, "detail": d.detail} for d in client.dropped]
    applied_in = {event_id: entry["chunk_index"] for entry in chunk_log for event_id in entry["applied_event_ids"]}
    for entry in events:
        entry["applied_in_chunk"] = applied_in.get(entry["event_id"])
    sidecar = {
        "url": url,
        "session_id": info.session_id,
        "model": info.model,
        "script": script,
        "chunks": chunk_log,
        "events": events,
        "dropped": dropped,
    }
    return Recording(frames=np.stack(frames), sidecar=sidecar)


def write_video(frames: npt.NDArray[np.uint8], path: str | Path, fps: float, scale: int = 4) -> None:
    """Write ``frames`` as GIF or MP4 (by suffix), scaled up ``scale`` times without blurring."""
    target = Path(path)
    big = frames.repeat(scale, axis=1).repeat(scale, axis=2) if scale > 1 else frames
    suffix = target.suffix.lower()
    if suffix == ".gif":
        images = [Image.fromarray(frame) for frame in big]
        images[0].save(target, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    elif suffix == ".mp4":
        import imageio_ffmpeg

        height, width = big.shape[1:3]
        writer = imageio_ffmpeg.write_frames(
            str(target), (width, height), fps=fps, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=1
        )
        writer.send(None)
        for frame in big:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
    else:
        raise ValueError(f"unknown video format {suffix!r}; use .gif or .mp4.")
