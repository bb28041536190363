"""``worldserve record``: play a scripted event list against a server; save video + sidecar.

Owns: the script format (JSON: ``{"prompt", "seed", "chunks", "events": [{"after_chunk":
k, "prompt"?, "controls"?}]}``: each event is sent once chunk ``k`` -- the ``k+1``-th chunk
-- has arrived; ``-1``: right after the start, before any chunk) and checking it whole before
anything connects, writing
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

__all__ = ["Recording", "load_script", "record", "refused_events", "write_video"]


@dataclass(frozen=True)
class Recording:
    frames: npt.NDArray[np.uint8]
    sidecar: dict[str, Any]


def load_script(path: str | Path) -> dict[str, Any]:
    """Read and check a script; raise ``ValueError`` (or ``OSError``) saying what is wrong, in one sentence."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ValueError(f"cannot read script {path}: {reason}.") from None
    try:
        script = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"script {path} is not JSON: {error}.") from None
    if not isinstance(script, dict):
        raise ValueError(f"script {path} must be a JSON object; it is a {type(script).__name__}.")
    unknown = sorted(set(script) - {"prompt", "seed", "chunks", "events"})
    if unknown:
        raise ValueError(f"script {path}: unknown key(s) {unknown}; a script has prompt, seed, chunks and events.")
    prompt = script.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"script {path}: 'prompt' must be a string.")
    seed = script.get("seed", 0)
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"script {path}: 'seed' must be an integer from 0 to 2**32 - 1; got {seed!r}.")
    chunks = script.get("chunks", 16)
    if not _is_int(chunks) or chunks < 1:
        raise ValueError(f"script {path}: 'chunks' must be a positive integer; got {chunks!r}.")
    events = script.get("events", [])
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        raise ValueError(f"script {path}: 'events' must be a list of objects.")
    for index, event in enumerate(events):
        unknown = sorted(set(event) - {"after_chunk", "prompt", "controls"})
        if unknown:
            raise ValueError(f"script {path}: events[{index}] has unknown key(s) {unknown}.")
        after = event.get("after_chunk", -1)
        if not _is_int(after) or after < -1:
            raise ValueError(f"script {path}: events[{index}].after_chunk must be an integer >= -1.")
        if "prompt" in event and not isinstance(event["prompt"], str):
            raise ValueError(f"script {path}: events[{index}].prompt must be a string.")
        controls = event.get("controls", [])
        if not isinstance(controls, list) or not all(isinstance(control, dict) for control in controls):
            raise ValueError(f"script {path}: events[{index}].controls must be a list of objects.")
        if "prompt" not in event and not controls:
            raise ValueError(f"script {path}: events[{index}] must carry a prompt and/or controls.")
    return script


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def refused_events(sidecar: dict[str, Any]) -> list[dict[str, Any]]:
    """The sidecar's events the server refused (an ``error`` reply), in the order sent."""
    return [entry for entry in sidecar["events"] if entry.get("status") == "error"]


async def record(url: str, script: dict[str, Any], *, token: str | None = None) -> Recording:
    """Run ``script`` against the server at ``url``; return its frames and sidecar."""
    chunks_wanted: int = script.get("chunks", 16)
    pending = sorted(enumerate(script.get("events", [])), key=lambda item: item[1].get("after_chunk", -1))
    events: list[dict[str, Any]] = []
    chunk_log: list[dict[str, Any]] = []  # the chunks a player shows, in order
    superseded: list[dict[str, Any]] = []  # those a preemption replaced (not shown, not recorded)
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
            if chunk.supersedes is not None and chunk_log and chunk_log[-1]["seq"] == chunk.supersedes:
                old = chunk_log.pop()  # made again with newer input: what is shown is its replacement
                del frames[len(frames) - old["frames"] :]
                superseded.append(old)
            frames.extend(chunk.frames)
            chunk_log.append(
                {
                    "seq": chunk.seq,
                    "chunk_index": chunk.chunk_index,
                    "epoch": chunk.epoch,
                    "request_id": chunk.request_id,
                    "applied_event_ids": list(chunk.applied_event_ids),
                    "timings": chunk.timings,
                    "frames": int(chunk.frames.shape[0]),
                    "supersedes": chunk.supersedes,
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
        "superseded": superseded,
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
