"""Regression tests for what an outside tester broke (issue 9), each failing before its fix.

Over real sockets against real ``worldserve serve`` processes, and through a real runtime:
a bad string or a decompression bomb no longer costs a session; a failed session reports
the events it can no longer apply with its failure, and nothing overtakes that report; a
replacement worker that dies while starting is started again; a stalled worker gets no
new sessions; the protocol's documented corner cases hold.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from runtime_models import Gate, keys
from server_harness import RunningServer, start_server
from worldserve import SessionEvent
from worldserve.errors import AdmissionRefusedError, DeadlineExceededError
from worldserve.runtime import Runtime


@pytest.fixture(scope="module")
def faulty_server() -> Iterator[RunningServer]:
    """A server on FaultyModel (tests/runtime_models.py): prompts with 'slow'/'poison' misbehave."""
    model = ("--model", "runtime_models:FaultyModel", "--model-option", "slow_s=0.4")
    running = start_server(*model, "--event-rate", "1000", test_models=True)
    yield running
    running.stop()


async def _messages(ws: ClientConnection, until: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """Every text message up to and including the first of type ``until`` (binary frames skipped)."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while True:
            raw = await ws.recv()
            if isinstance(raw, bytes):
                continue
            seen.append(json.loads(raw))
            if seen[-1]["type"] == until:
                return seen


async def _start(ws: ClientConnection, **fields: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "session.start", "options": {"media": "raw"}, **fields}))
    return (await _messages(ws, "session.started"))[-1]


async def _until(condition: Callable[[], bool], timeout: float, every: float = 0.05) -> None:
    """Wait for ``condition`` (a generous ``timeout``: only a broken runtime reaches it)."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 -- polling another process's progress
            await asyncio.sleep(every)


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


# -- defect 4: one bad string killed a connection ---------------------------------------------------


async def test_an_unpaired_surrogate_is_refused_and_the_session_goes_on(faulty_server: RunningServer) -> None:
    async with websockets.connect(faulty_server.ws) as ws:
        await _start(ws, seed=1)
        # Valid JSON (a \ud800 escape), but not Unicode text: no reply could echo that id.
        await ws.send('{"type": "ping", "id": "\\ud800"}')
        error = (await _messages(ws, "error"))[-1]
        assert error["code"] == "invalid_message"
        assert "id" not in error
        assert "surrogate" in error["message"]
        await ws.send('{"type": "input.event", "id": "e1", "event_id": 1, "prompt": "a \\udfff b"}')
        error = (await _messages(ws, "error"))[-1]
        assert (error["code"], error["id"]) == ("invalid_message", "e1")
        # The connection and its session are still there.
        await ws.send(json.dumps({"type": "ping", "id": "p"}))
        assert (await _messages(ws, "pong"))[-1]["id"] == "p"
        await ws.send(json.dumps({"type": "input.event", "event_id": 2, "prompt": "forest"}))
        assert (await _messages(ws, "input.accepted"))[-1]["event_id"] == 2
        chunk = (await _messages(ws, "chunk"))[-1]
        await ws.send(json.dumps({"type": "chunk.ack", "seq": chunk["seq"]}))


# -- defect 5: a decompression bomb was an internal_error --------------------------------------------


async def test_a_decompression_bomb_is_an_invalid_image(faulty_server: RunningServer) -> None:
    async with websockets.connect(faulty_server.ws) as ws:
        for width, height in ((60000, 60000), (100, 100)):
            image = base64.b64encode(_png_header(width, height)).decode()
            await ws.send(json.dumps({"type": "session.start", "id": "s", "image": image}))
            error = (await _messages(ws, "error"))[-1]
            assert (error["code"], error["id"]) == ("invalid_image", "s")
            assert "48x48" in error["message"]
        assert (await _start(ws, seed=2))["session_id"]


# -- defect 6: drops reached the client late, and a reply could overtake the failure ---------------


async def test_a_failed_session_reports_its_pending_events_with_the_failure(faulty_server: RunningServer) -> None:
    async with websockets.connect(faulty_server.ws) as ws:
        await _start(ws, seed=3)
        # The tick applying event 1 sleeps, then raises; events sent meanwhile stay pending.
        await ws.send(json.dumps({"type": "input.event", "event_id": 1, "prompt": "slow poison"}))
        accepted = {1}
        event_id = 1
        replies: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while not any(message["type"] == "session.failed" for message in replies):
                event_id += 1
                await ws.send(
                    json.dumps({"type": "input.event", "event_id": event_id, "controls": [keys("W").to_dict()]})
                )
                while True:  # this event's own reply, with whatever came before it
                    raw = await ws.recv()
                    if isinstance(raw, bytes):
                        continue
                    message = json.loads(raw)
                    replies.append(message)
                    if message["type"] == "chunk":
                        await ws.send(json.dumps({"type": "chunk.ack", "seq": message["seq"]}))
                    if message.get("event_id") == event_id and message["type"] in {"input.accepted", "error"}:
                        break
                if replies[-1]["type"] == "input.accepted":
                    accepted.add(event_id)
                await asyncio.sleep(0.01)
        kinds = [message["type"] for message in replies]
        failed_at = kinds.index("session.failed")
        assert replies[failed_at]["code"] == "model_error"
        # No reply that refers to the failure came before it.
        assert all(message.get("code") != "invalid_state" for message in replies[:failed_at])
        # Right behind it: every accepted, never applied event, reported dropped once.
        dropped = replies[failed_at + 1]
        assert dropped["type"] == "input.dropped"
        assert dropped["reason"] == "failed"
        applied = {i for message in replies if message["type"] == "chunk" for i in message["applied_event_ids"]}
        # Held keys coalesce: a newer key event supersedes queued ones, reported at once (not again here).
        superseded = {
            i
            for message in replies[:failed_at]
            if message["type"] == "input.dropped" and message["reason"] == "superseded"
            for i in message["event_ids"]
        }
        assert 1 in dropped["event_ids"]
        assert set(dropped["event_ids"]) == accepted - applied - superseded
        # The reset discards them without reporting them a second time.
        await ws.send(json.dumps({"type": "session.reset", "id": "r"}))
        after = await _messages(ws, "session.reset")
        assert [message for message in after if message["type"] == "input.dropped"] == []
        assert (await _messages(ws, "chunk"))[-1]["chunk_index"] == 0


# -- defect 2: a replacement killed while it starts was never retried --------------------------------


async def test_a_replacement_killed_while_starting_is_started_again() -> None:
    options = {"load_s": 2.0}
    async with Runtime("runtime_models:SlowStartModel", workers=1, model_options=options) as rt:
        executor = rt.engine.executor
        first = executor.pid(0)
        assert first is not None
        executor.kill(0)
        await _until(lambda: executor.pid(0) not in (None, first), 30, every=0.005)  # spawned, still loading
        os.kill(executor.pid(0) or 0, 9)
        # Down or restarting: admission refuses at once, with a hint.
        assert rt.engine.stats().workers_alive == 0
        with pytest.raises(AdmissionRefusedError, match="down, restarting") as refused:
            await rt.create_session(seed=1)
        assert refused.value.retry_after_s is not None
        await _until(lambda: rt.engine.stats().worker_restarts >= 1, 60)
        stats = rt.engine.stats()
        assert stats.worker_restart_failures >= 1
        assert stats.workers_alive == 1
        session = await rt.create_session(seed=1)
        assert (await session.next_chunk()).metadata.chunk_index == 0


# -- defect 3: a stalled worker took new sessions ---------------------------------------------------


async def test_a_stalled_worker_gets_no_new_sessions(tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    async with Runtime(
        "runtime_models:FaultyModel",
        workers=2,
        executor="inprocess",
        model_options={"gate": str(gate.path)},
        tick_deadline_s=0.2,
    ) as rt:
        late = await rt.create_session(seed=1)
        other = await rt.create_session(seed=2)
        stalled = rt.engine.worker_of(late.session_id)
        assert stalled is not None
        assert rt.engine.worker_of(other.session_id) == 1 - stalled
        await late.accept_event(SessionEvent(1, prompt="gate"))
        with pytest.raises(DeadlineExceededError):
            await late.next_chunk()
        # The late session's state is released: its worker now looks least loaded, but its step is held.
        assert rt.engine.worker_of(late.session_id) is None
        fresh = await rt.create_session(seed=3)
        assert rt.engine.worker_of(fresh.session_id) == 1 - stalled
        await late.reset()
        assert rt.engine.worker_of(late.session_id) == 1 - stalled
        assert not gate.left  # all of this while the step was still held
        gate.open()
        for session in (late, fresh, other):
            assert (await session.next_chunk()).metadata.chunk_index == 0


# -- the protocol's documented corner cases ----------------------------------------------------------


async def test_protocol_corner_cases(faulty_server: RunningServer) -> None:
    async with websockets.connect(faulty_server.ws) as ws:
        # chunk.ack before a start is ignored: no reply at all.
        await ws.send(json.dumps({"type": "chunk.ack", "seq": 5}))
        await ws.send(json.dumps({"type": "ping", "id": "p1"}))
        assert [message["type"] for message in await _messages(ws, "pong")] == ["pong"]

        first = await _start(ws, seed=4)
        await ws.send(json.dumps({"type": "input.event", "event_id": 7, "prompt": "desert"}))
        seqs = []
        while True:
            chunk = (await _messages(ws, "chunk"))[-1]
            seqs.append(chunk["seq"])
            await ws.send(json.dumps({"type": "chunk.ack", "seq": chunk["seq"]}))
            if 7 in chunk["applied_event_ids"]:
                break
        # Re-sending an id just applied is a harmless duplicate, though it is at the floor.
        await ws.send(json.dumps({"type": "input.event", "event_id": 7, "prompt": "desert"}))
        assert (await _messages(ws, "input.accepted"))[-1]["status"] == "duplicate"

        # One session at a time; after session.closed a new start is a new session, seq goes on.
        await ws.send(json.dumps({"type": "session.start"}))
        assert (await _messages(ws, "error"))[-1]["code"] == "session_exists"
        await ws.send(json.dumps({"type": "session.close", "id": "c"}))
        closed = await _messages(ws, "session.closed")
        seqs += [message["seq"] for message in closed if message["type"] == "chunk"]
        second = await _start(ws, seed=4)
        assert second["session_id"] != first["session_id"]
        chunk = (await _messages(ws, "chunk"))[-1]
        assert (chunk["epoch"], chunk["chunk_index"]) == (0, 0)
        assert chunk["seq"] == max(seqs) + 1


def _refusal(error: websockets.InvalidStatus) -> tuple[int, str]:
    body = json.loads(bytes(error.response.body or b""))
    return error.response.status_code, body["error"]["code"]


async def test_handshakes_refused_for_the_token_the_origin_and_the_path_each_say_which() -> None:
    """A refused token (401), origin (403) and path (404) are told apart, by their status and JSON
    error, and so by the Python client (and `bench`, `record`): one line each, saying what to fix.
    The HTTP endpoints answer a missing or wrong token with 401 too."""
    from worldserve.client import WorldClient, WorldClientError

    running = start_server("--model", "procedural", "--token", "tok", "--idle-timeout", "1")
    try:
        host_url = f"ws://127.0.0.1:{running.port}/v1/world"
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(host_url)  # no token
        assert _refusal(refused.value) == (401, "unauthorized")
        auth = {"Authorization": "Bearer tok"}
        # The own-origin rule compares the Origin with the Host header exactly: localhost is not 127.0.0.1.
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(
                host_url, additional_headers=auth, origin=websockets.Origin(f"http://localhost:{running.port}")
            )
        assert _refusal(refused.value) == (403, "origin_refused")
        wrong_path = f"ws://127.0.0.1:{running.port}/v1/wrold"
        for path in ("/v1/wrold", "/"):  # Starlette's own answer to both: a bare 403
            with pytest.raises(websockets.InvalidStatus) as refused:
                await websockets.connect(f"ws://127.0.0.1:{running.port}{path}", additional_headers=auth)
            assert _refusal(refused.value) == (404, "not_found")
        said = {}
        for name, url, token in [
            ("none", host_url, None),
            ("wrong", host_url, "nope"),
            ("path", wrong_path, "tok"),
        ]:
            with pytest.raises(WorldClientError) as failed:
                async with WorldClient(url, token=token):
                    pass
            said[name] = str(failed.value)
        assert said == {
            "none": f"cannot connect to {host_url}: the server needs a token (HTTP 401): "
            "give the one it was started with (--token)",
            "wrong": f"cannot connect to {host_url}: the server refused this token (HTTP 401): "
            "give the token the server was started with (--token)",
            "path": f"cannot connect to {wrong_path}: no WebSocket endpoint at /v1/wrold: this server's are "
            "/v1/world and /v1/realtime/video (HTTP 404): check the URL (worldserve's is /v1/world)",
        }
        realtime = f"ws://127.0.0.1:{running.port}/v1/realtime/video"
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(realtime)  # the same rules on the other socket
        assert _refusal(refused.value) == (401, "unauthorized")
        async with websockets.connect(
            host_url, additional_headers=auth, origin=websockets.Origin(f"http://127.0.0.1:{running.port}")
        ) as ws:
            # An idle connection gets session.closed, then a close frame 1000 "idle timeout".
            await ws.send(json.dumps({"type": "session.start"}))
            assert (await _messages(ws, "session.closed"))[-1]["reason"] == "idle_timeout"
            with pytest.raises(websockets.ConnectionClosedOK) as closed:
                await _messages(ws, "never")
            assert closed.value.rcvd is not None
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle timeout")
        import urllib.error
        import urllib.request

        for path in ("/v1/models", "/metrics"):
            with pytest.raises(urllib.error.HTTPError) as denied:
                await asyncio.to_thread(urllib.request.urlopen, running.http + path, timeout=10)
            assert denied.value.code == 401
        # What a browser cannot read from a refused handshake (only 1006), POST /v1/origin tells it, no
        # token needed: the same own-origin rule, for the Origin the POST carries.
        for origin, allowed in ((f"http://localhost:{running.port}", False), (running.http, True)):
            probe = urllib.request.Request(running.http + "/v1/origin", method="POST", headers={"Origin": origin})
            with await asyncio.to_thread(urllib.request.urlopen, probe, timeout=10) as reply:
                assert json.loads(reply.read()) == {"origin": origin, "allowed": allowed}
    finally:
        running.stop()
