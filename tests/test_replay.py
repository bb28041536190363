"""Exact record and replay (issue 13.3): a journaled live session regenerates frame for frame.

A real server keeps journals (``--record-dir``); a client plays a session over a real
socket (events, a reset, a close) and keeps every frame it got; ``worldserve replay``'s
library function regenerates them through the normal runtime. tinyworld is replayed the
same way through ``Runtime`` in float32 (where its frames depend only on their inputs).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets

from runtime_models import keys
from server_harness import start_server
from worldserve import SessionEvent
from worldserve.models.world import camera_control
from worldserve.runtime import Runtime
from worldserve.runtime.journal import read_journal
from worldserve.tools.cli import main
from worldserve.tools.replay import replay


async def _play(url: str) -> tuple[str, list[dict[str, Any]], np.ndarray, int]:
    """Play a scripted session over a raw socket; return its id, the headers and frames of the chunks a
    player shows (one that a later chunk superseded, a preemption, is left out) and how many were superseded."""
    received = 0
    superseded = 0
    shown: list[tuple[dict[str, Any], list[np.ndarray]]] = []
    script = {
        2: {"controls": [keys("D").to_dict()]},
        4: {"prompt": "snowy tundra", "controls": [keys("W", "A").to_dict()]},
        6: {"reset": True},
        8: {"controls": [camera_control(1.5, -1.0).to_dict()]},
    }
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(
            json.dumps({"type": "session.start", "prompt": "islands", "seed": 11, "options": {"media": "raw"}})
        )
        session_id = ""
        event_id = 0
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if message["type"] == "session.started":
                session_id = message["session_id"]
            elif message["type"] == "chunk":
                received += 1
                if message.get("supersedes") is not None:
                    kept = [entry for entry in shown if entry[0]["seq"] != message["supersedes"]]
                    assert len(kept) == len(shown) - 1, "supersedes names a chunk that was sent"
                    assert shown[-1][0]["seq"] == message["supersedes"], "only the last chunk sent is superseded"
                    assert shown[-1][0]["chunk_index"] == message["chunk_index"]
                    shown, superseded = kept, superseded + 1
                frames: list[np.ndarray] = []
                for _ in range(message["frames"]["count"]):
                    raw = await asyncio.wait_for(ws.recv(), 30)
                    assert isinstance(raw, bytes)
                    frames.append(np.frombuffer(raw, np.uint8).reshape(48, 48, 3))
                shown.append((message, frames))
                await ws.send(json.dumps({"type": "chunk.ack", "seq": message["seq"]}))
                step = script.get(received)
                if step is not None and step.get("reset"):
                    await ws.send(json.dumps({"type": "session.reset"}))
                elif step is not None:
                    event_id += 1
                    await ws.send(json.dumps({"type": "input.event", "event_id": event_id, **step}))
                if received == 12:
                    await ws.send(json.dumps({"type": "session.close"}))
            elif message["type"] == "session.closed":
                headers = [header for header, _ in shown]
                return session_id, headers, np.stack([frame for _, frames in shown for frame in frames]), superseded
            elif message["type"] == "error":
                raise AssertionError(message)


async def test_a_recorded_live_session_replays_frame_for_frame(tmp_path: Path) -> None:
    journals = tmp_path / "journals"
    running = start_server("--model", "procedural", "--record-dir", str(journals))
    try:
        session_id, headers, frames, superseded = await _play(running.ws)
    finally:
        running.stop()
    path = journals / f"{session_id}.jsonl"
    journal = read_journal(path)
    start, chunks = journal.start, journal.chunks
    assert journal.complete  # a close line, nothing cut off
    assert journal.retracted == superseded  # a preemption's undone chunk is in the journal as undone
    assert (start.model, start.options.seed, start.options.prompt) == ("procedural", 11, "islands")
    assert [chunk.chunk_index for chunk in chunks] == [header["chunk_index"] for header in headers]
    # The journal keeps the session's own event ids (a connection's wire ids are mapped to them).
    assert [len(chunk.applied_event_ids) for chunk in chunks] == [len(h["applied_event_ids"]) for h in headers]
    assert 0 in [chunk.chunk_index for chunk in chunks[1:]]  # the reset is in the journal
    assert path.stat().st_size < 8_000  # no frames: small
    replayed = await replay(path, executor="inprocess")
    assert replayed.same_model
    assert replayed.frames.shape == frames.shape
    assert np.array_equal(replayed.frames, frames)


async def test_tinyworld_replays_exactly_in_float32(tmp_path: Path) -> None:
    options = {"precision": "float32"}
    async with Runtime("tinyworld", workers=1, model_options=options, record_dir=str(tmp_path)) as runtime:
        session = await runtime.create_session(prompt="desert dunes", seed=5)
        live = []
        for index in range(6):
            if index == 1:
                await session.accept_event(SessionEvent(1, controls=(keys("D"),)))
            if index == 3:
                await session.accept_event(SessionEvent(2, prompt="deep forest", controls=(keys("S"),)))
            live.append((await session.next_chunk()).frames)
        await runtime.close_session(session.session_id)
    replayed = await replay(tmp_path / f"{session.session_id}.jsonl")
    assert replayed.precision == "float32"
    assert np.array_equal(replayed.frames, np.concatenate(live))


def test_the_replay_command_writes_a_video(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    journal = tmp_path / "s.jsonl"
    lines = [
        {"type": "start", "session_id": "s", "model": "procedural", "model_version": "world-1", "precision": "exact",
         "model_options": {}, "options": {"prompt": None, "seed": 2, "image": None}, "frames_per_chunk": 4,
         "fps": 16.0},
        {"type": "chunk", "chunk_index": 0, "applied_event_ids": [], "prompt": None, "controls": []},
        {"type": "chunk", "chunk_index": 1, "applied_event_ids": [3], "prompt": "desert",
         "controls": [keys("D").to_dict()]},
    ]  # fmt: skip
    journal.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "replay.gif"
    assert main(["replay", str(journal), "--out", str(out), "--frames", str(tmp_path / "f.npy"), "--executor",
                 "inprocess"]) == 0  # fmt: skip
    assert out.stat().st_size > 0
    assert np.load(tmp_path / "f.npy").shape == (8, 48, 48, 3)
    assert "replayed 2 chunks (8 frames)" in capsys.readouterr().out


def test_a_broken_journal_names_its_line(tmp_path: Path) -> None:
    journal = tmp_path / "bad.jsonl"
    journal.write_text('{"type": "chunk"}\n')
    with pytest.raises(ValueError, match="starts with a 'start' line"):
        read_journal(journal)
    journal.write_text(
        json.dumps({"type": "start", "session_id": "s", "model": "procedural", "options": {}, "frames_per_chunk": 4,
                    "fps": 16}) + "\nnot json\n"
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        read_journal(journal)
