"""The server over real sockets on 127.0.0.1: a ``worldserve serve`` process per module.

Each test talks to the server as a client would: through ``WorldClient`` or through
raw WebSocket frames for the malformed cases.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from runtime_models import Gate
from server_harness import RunningServer, start_server
from worldserve.client import SessionFailedError, WorldClient, WorldError, keys
from worldserve.models.world import World
from worldserve.server.config import ServerConfig

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--workers", "2", "--event-rate", "40", "--event-burst", "40")
    yield running
    running.stop()


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[WorldClient]:
    async with WorldClient(server.ws) as world:
        yield world


def http_get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def raw_socket(server: RunningServer, **kwargs: Any) -> ClientConnection:
    return await websockets.connect(server.ws, **kwargs)


async def reply(ws: ClientConnection, wanted: str, timeout: float = 30.0) -> dict[str, Any]:
    """The next text message of type ``wanted`` (chunks and their frames are skipped)."""
    async with asyncio.timeout(timeout):
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                continue
            decoded: dict[str, Any] = json.loads(message)
            if decoded["type"] == wanted:
                return decoded


async def unacked_chunks(ws: ClientConnection, lag: int) -> list[dict[str, Any]]:
    """The ``lag`` chunk headers the server sends before backpressure pauses an un-acking client."""
    return [await reply(ws, "chunk") for _ in range(lag)]


async def assert_no_chunk(ws: ClientConnection, within: float = 1.0) -> None:
    """No chunk arrives for ``within`` seconds (a pause: a slow machine cannot make this fail)."""
    with pytest.raises(TimeoutError):
        await reply(ws, "chunk", timeout=within)


async def healthz_sessions(server: RunningServer, wanted: int, timeout: float = 30.0) -> None:
    """Wait until /healthz reports ``wanted`` sessions."""
    async with asyncio.timeout(timeout):
        while json.loads(http_get(server.http + "/healthz")[1])["sessions"] != wanted:  # noqa: ASYNC110 -- polls HTTP
            await asyncio.sleep(0.05)


async def drain(client: WorldClient, chunks: int) -> None:
    for _ in range(chunks):
        await client.next_chunk(timeout=30)


async def test_session_streams_chunks_and_applies_events_in_order(client: WorldClient) -> None:
    info = await client.start(prompt="islands", seed=7)
    assert info.model["name"] == "procedural"
    first = await client.next_chunk(timeout=30)
    assert first.chunk_index == 0
    assert first.frames.shape == (4, 48, 48, 3)
    acceptance = await client.send_event(controls=[keys("D")])
    assert acceptance.status == "accepted"
    assert (await client.send_event(event_id=acceptance.event_id, controls=[keys("D")])).status == "duplicate"
    applied_in = None
    previous = first
    for _ in range(6):
        chunk = await client.next_chunk(timeout=30)
        if chunk.supersedes is not None:  # a preemption: the last chunk made again, with the event
            assert (chunk.supersedes, chunk.chunk_index) == (previous.seq, previous.chunk_index)
        else:
            assert chunk.chunk_index == previous.chunk_index + 1
        if acceptance.event_id in chunk.applied_event_ids:
            applied_in = chunk
            break
        previous = chunk
    assert applied_in is not None
    # The chunk that applied "hold D" is the first whose view moves right, by 2 px a frame.
    world = World(7)
    assert np.array_equal(previous.frames[-1], world.render(0, 0, 48, 48, "islands"))
    assert np.array_equal(applied_in.frames[-1], world.render(8, 0, 48, 48, "islands"))


async def test_reset_and_close_report_dropped_events(server: RunningServer) -> None:
    ws = await raw_socket(server)
    try:
        await ws.send(json.dumps({"type": "session.start", "prompt": "desert", "seed": 3, "options": {"media": "raw"}}))
        lag = (await reply(ws, "session.started"))["max_lag_chunks"]
        # Without acks the server stops generating after max_lag_chunks: the event stays pending.
        seqs = [chunk["seq"] for chunk in await unacked_chunks(ws, lag)]
        await ws.send(json.dumps({"type": "input.event", "event_id": 1, "controls": [keys("S").to_dict()]}))
        assert (await reply(ws, "input.accepted"))["pending"] == 1
        await ws.send(json.dumps({"type": "session.reset", "id": "r"}))
        dropped = await reply(ws, "input.dropped")
        assert (dropped["event_ids"], dropped["reason"]) == ([1], "reset")
        assert (await reply(ws, "session.reset"))["epoch"] == 1
        chunk = await reply(ws, "chunk")
        frames = [np.frombuffer(await ws.recv(), dtype=np.uint8).reshape(48, 48, 3) for _ in range(4)]
        assert (chunk["epoch"], chunk["chunk_index"], chunk["applied_event_ids"]) == (1, 0, [])
        assert chunk["seq"] > seqs[-1]  # seq numbers the connection's chunks, across resets
        assert np.array_equal(frames[0], World(3).render(0, 0, 48, 48, "desert"))
        # Paused again (the old epoch's chunks no longer count): an event accepted now is
        # dropped by close, and said so.
        await unacked_chunks(ws, lag - 1)
        await ws.send(json.dumps({"type": "input.event", "event_id": 2, "prompt": "snow"}))
        await reply(ws, "input.accepted")
        await ws.send(json.dumps({"type": "session.close", "id": "c"}))
        dropped = await reply(ws, "input.dropped")
        assert (dropped["event_ids"], dropped["reason"]) == ([2], "closed")
        assert (await reply(ws, "session.closed"))["id"] == "c"
    finally:
        await ws.close()


async def test_close_and_disconnect_release_the_session(server: RunningServer) -> None:
    async with WorldClient(server.ws) as world:
        await world.start(seed=1)
        await world.next_chunk(timeout=30)
        await world.close()
    await healthz_sessions(server, 0)

    world = WorldClient(server.ws)
    await world.connect()
    await world.start(seed=2)
    await world.next_chunk(timeout=30)
    _, body = http_get(server.http + "/healthz")
    assert json.loads(body)["sessions"] >= 1
    await world.disconnect()  # no session.close: the server must release it anyway
    await healthz_sessions(server, 0)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        ("{not json", "invalid_json"),
        ('["a", "list"]', "invalid_message"),
        ('{"type": "teleport"}', "unknown_type"),
        ('{"type": "input.event", "event_id": "seven"}', "invalid_message"),
        ('{"type": "input.event", "event_id": 3, "controls": [{"track": "keys"}]}', "invalid_message"),
        ('{"type": "input.event", "event_id": 3}', "invalid_message"),
        (
            '{"type": "input.event", "event_id": 4, "controls": [{"track": "keys", "schema": "worldserve.keys.v1",'
            ' "data": {"held": ["Q"]}}]}',
            "invalid_control",
        ),
        (
            '{"type": "input.event", "event_id": 5, "controls": [{"track": "jetpack", "schema": "x.v1", "data": {}}]}',
            "invalid_control",
        ),
        ('{"type": "session.start"}', "session_exists"),
        ('{"type": "ping", "extra": 1}', "invalid_message"),
    ],
)
async def test_bad_input_gets_a_typed_error_and_the_session_goes_on(
    server: RunningServer, payload: str, code: str
) -> None:
    ws = await raw_socket(server)
    try:
        await ws.send(json.dumps({"type": "session.start", "seed": 4, "options": {"media": "raw"}}))
        await reply(ws, "session.started")
        await ws.send(payload)
        error = await reply(ws, "error")
        assert error["code"] == code, error
        # The session goes on: a good event is accepted and chunks keep coming.
        await ws.send(json.dumps({"type": "input.event", "event_id": 100, "prompt": "snow", "id": "ok"}))
        accepted = await reply(ws, "input.accepted")
        assert accepted["id"] == "ok"
        assert accepted["status"] == "accepted"
        await reply(ws, "chunk")
    finally:
        await ws.close()


async def test_errors_before_start_binary_and_oversized(server: RunningServer) -> None:
    ws = await raw_socket(server)
    try:
        await ws.send(json.dumps({"type": "input.event", "event_id": 1, "prompt": "x", "id": "early"}))
        error = await reply(ws, "error")
        assert (error["code"], error["id"], error["event_id"]) == ("no_session", "early", 1)
        await ws.send(b"\x00\x01")
        assert (await reply(ws, "error"))["code"] == "invalid_message"
        # Before a session, a start may carry images (up to --max-start-bytes, 4 MiB); nothing else is that large.
        await ws.send(json.dumps({"type": "input.event", "event_id": 2, "prompt": "x" * 300_000}))
        assert (await reply(ws, "error"))["code"] == "message_too_large"
        await ws.send(json.dumps({"type": "session.start", "prompt": "x" * 300_000}))
        assert (await reply(ws, "error"))["code"] == "invalid_message"  # parsed: its prompt is too long
        await ws.send(json.dumps({"type": "session.start", "prompt": "x" * 5_000_000}))
        assert (await reply(ws, "error"))["code"] == "message_too_large"
        await ws.send(json.dumps({"type": "session.start", "model": "gpt-9"}))
        assert (await reply(ws, "error"))["code"] == "unknown_model"
        await ws.send(json.dumps({"type": "session.start", "image": "bm90IGFuIGltYWdl"}))
        assert (await reply(ws, "error"))["code"] == "invalid_image"
        await ws.send(json.dumps({"type": "ping", "id": "p"}))
        assert (await reply(ws, "pong"))["id"] == "p"
    finally:
        await ws.close()


async def test_event_flood_is_rate_limited_without_hurting_the_session(client: WorldClient) -> None:
    await client.start(seed=5)
    outcomes = []
    for event_id in range(1, 80):
        try:
            outcomes.append((await client.send_event(event_id=event_id, prompt=f"p{event_id}")).status)
        except WorldError as error:
            outcomes.append(error.code)
    assert "rate_limited" in outcomes
    assert "queue_full" in outcomes or outcomes.count("accepted") >= 40
    chunk = await client.next_chunk(timeout=30)
    assert chunk.frames.shape[0] == 4


async def test_stale_events_and_start_image(client: WorldClient) -> None:
    image = np.zeros((48, 48, 3), dtype=np.uint8)
    image[:, :, 0] = 200
    await client.start(seed=6, image=image)
    chunk = await client.next_chunk(timeout=30)
    assert np.array_equal(chunk.frames[0], image)
    accepted = await client.send_event(event_id=10, prompt="snow")
    while accepted.event_id not in (await client.next_chunk(timeout=30)).applied_event_ids:
        pass
    with pytest.raises(WorldError) as stale:
        await client.send_event(event_id=3, prompt="late")
    assert stale.value.code == "stale_event"


async def test_two_clients_are_isolated(server: RunningServer) -> None:
    async with WorldClient(server.ws) as a, WorldClient(server.ws) as b:
        await a.start(prompt="forest", seed=8)
        await b.start(prompt="forest", seed=8)
        # The same event ids in both sessions are independent; garbage on one affects nobody.
        assert (await a.send_event(event_id=1, controls=[keys("S")])).status == "accepted"
        assert (await b.send_event(event_id=1, controls=[keys("W")])).status == "accepted"
        with pytest.raises(WorldError):
            await a.send_event(event_id=2, controls=[{"track": "keys", "schema": "worldserve.keys.v1", "data": {}}])
        ends = {}
        for name, world in (("a", a), ("b", b)):
            chunk = await world.next_chunk(timeout=30)
            while 1 not in chunk.applied_event_ids:
                chunk = await world.next_chunk(timeout=30)
            ends[name] = chunk.frames[-1]
        world_8 = World(8)
        assert np.array_equal(ends["a"], world_8.render(0, 8, 48, 48, "forest"))
        assert np.array_equal(ends["b"], world_8.render(0, -8, 48, 48, "forest"))


async def test_backpressure_pauses_a_client_that_does_not_ack(server: RunningServer) -> None:
    ws = await raw_socket(server)
    try:
        await ws.send(json.dumps({"type": "session.start", "options": {"media": "raw"}}))
        started = await reply(ws, "session.started")
        lag = started["max_lag_chunks"]
        seqs = [chunk["seq"] for chunk in await unacked_chunks(ws, lag)]
        assert seqs == list(range(lag))
        await assert_no_chunk(ws)  # paused: no more until an ack
        await ws.send(json.dumps({"type": "chunk.ack", "seq": seqs[-1]}))
        assert (await reply(ws, "chunk", timeout=5))["seq"] == lag
    finally:
        await ws.close()


async def test_generation_is_paced_to_playback(client: WorldClient) -> None:
    # Chunk n is never started before chunk 0 was ready plus (n - lead) periods of playback:
    # never faster than real time. (Slower is a slow machine's right; nothing here bounds it.)
    lead = ServerConfig().lead_chunks
    loop = asyncio.get_running_loop()
    began = loop.time()
    info = await client.start(seed=9)
    period = info.model["frames_per_chunk"] / info.model["fps"]
    for _ in range(10):
        chunk = await client.next_chunk(timeout=30)
        received = loop.time() - began
        assert received >= (chunk.chunk_index - lead) * period, (chunk.chunk_index, received, period)
    assert chunk.chunk_index == 9


async def test_http_endpoints_and_metrics(server: RunningServer, client: WorldClient) -> None:
    status, body = http_get(server.http + "/healthz")
    assert status == 200
    assert json.loads(body)["model"] == "procedural"
    status, body = http_get(server.http + "/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["controls"][0]["track"] in {"keys", "camera"}
    await client.start(seed=2)
    await client.send_event(controls=[keys("W")])
    await client.next_chunk(timeout=30)
    await client.next_chunk(timeout=30)
    status, body = http_get(server.http + "/metrics")
    text = body.decode()
    assert status == 200
    for name in (
        "worldserve_sessions_active",
        "worldserve_time_to_first_chunk_seconds_bucket",
        "worldserve_chunk_latency_seconds_bucket",
        "worldserve_event_applied_latency_seconds_bucket",
        'worldserve_events_total{outcome="accepted"}',
        "worldserve_queue_depth",
        "worldserve_chunks_total",
    ):
        assert name in text, name
    status, body = http_get(server.http + "/")
    assert status == 200
    assert b"<canvas" in body


async def test_failed_session_says_why_and_accepts_reset() -> None:
    # One resident session per worker: once the first world's player stops acking for
    # --evict-idle-s, it is no longer in use and a second session evicts it.
    running = start_server(
        "--model", "procedural", "--workers", "1", "--max-sessions-per-worker", "1", "--evict-idle-s", "0.5"
    )  # fmt: skip
    try:
        async with WorldClient(running.ws) as first, WorldClient(running.ws) as second:
            await first.start(seed=1)
            await first.next_chunk(timeout=30)  # ... and reads no more for now
            for _ in range(400):
                try:
                    await second.start(seed=2)
                except WorldError as refused_start:
                    code = refused_start.code
                else:
                    break
                assert code == "admission_refused"
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the second session was never admitted")
            with pytest.raises(SessionFailedError) as failed:
                await drain(first, 20)
            assert failed.value.code == "evicted"
            with pytest.raises(WorldError) as refused:
                await first.send_event(prompt="still there?")
            assert refused.value.code == "invalid_state"
            await second.close()
            assert await first.reset() == 1
            chunk = await first.next_chunk(timeout=30)
            assert chunk.chunk_index == 0
    finally:
        running.stop()


async def test_auth_and_origin() -> None:
    running = start_server("--model", "procedural", "--allow-origin", "http://good.example", token=TOKEN)
    try:
        assert http_get(running.http + "/v1/models")[0] == 401
        assert http_get(running.http + "/metrics")[0] == 401
        assert http_get(running.http + "/v1/models", TOKEN)[0] == 200
        assert http_get(running.http + "/healthz")[0] == 200
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(running.ws)
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(running.ws, additional_headers={"Authorization": "Bearer wrong"})
        async with WorldClient(running.ws, token=TOKEN) as world:
            await world.start(seed=1)
            await world.next_chunk(timeout=30)
        # Browsers send the token as a subprotocol; origins must be allowed.
        protocols = [websockets.Subprotocol("worldserve.v1"), websockets.Subprotocol(f"bearer.{TOKEN}")]
        ws = await websockets.connect(
            running.ws, subprotocols=protocols, origin=websockets.Origin("http://good.example")
        )
        assert ws.subprotocol == "worldserve.v1"
        await ws.close()
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(
                running.ws, subprotocols=protocols, origin=websockets.Origin("http://evil.example")
            )
    finally:
        running.stop()


async def test_idle_connections_are_closed() -> None:
    running = start_server("--model", "procedural", "--idle-timeout", "1")
    try:
        ws = await raw_socket(running)
        await ws.send(json.dumps({"type": "session.start"}))
        await reply(ws, "session.started")
        closed = await reply(ws, "session.closed", timeout=10)
        assert closed["reason"] == "idle_timeout"
    finally:
        running.stop()


async def test_healthz_reports_capacity_and_a_refusal_carries_a_retry_hint(tmp_path: Path) -> None:
    # One session per worker, and its first step held in the model (a session with a tick in the
    # engine is never evicted): the worker is full, so the next session is refused.
    gate = Gate(tmp_path / "gate")
    running = start_server(
        "--model", "runtime_models:FaultyModel", "--model-option", f"gate={gate.path}", "--workers", "1",
        "--max-sessions-per-worker", "1", test_models=True,
    )  # fmt: skip
    try:
        _, body = http_get(running.http + "/healthz")
        assert json.loads(body)["capacity"] == {"free": 1, "slots": 1, "room": True, "workers_alive": 1}
        async with WorldClient(running.ws) as holder, WorldClient(running.ws) as world:
            await holder.start(seed=1, prompt="gate")
            await gate.wait_entered()
            _, body = http_get(running.http + "/healthz")
            assert json.loads(body)["capacity"] == {"free": 0, "slots": 1, "room": False, "workers_alive": 1}
            with pytest.raises(WorldError) as refused:
                await world.start(seed=1)
            assert refused.value.code == "admission_refused"
            # The runtime's hint: the longer of a worker restart's first backoff and a chunk period.
            assert refused.value.retry_after_ms == 500
            gate.open()
    finally:
        gate.open()
        running.stop()


def test_a_real_servers_log_lives_in_the_test_runs_own_folder() -> None:
    import server_harness

    server = start_server("--model", "procedural")
    try:
        assert server_harness.LOG_ROOT is not None
        assert server.log_path.parent == server_harness.LOG_ROOT / "test_server"  # not the system's /tmp
        assert server.log_path.is_file()
    finally:
        server.stop()
    assert "worldserve: serving procedural (exact) on 1 worker x" in server.log()


async def test_just_in_time_makes_no_chunk_ahead_of_playback() -> None:
    # --lead jit: chunk n's tick goes at the first one's + n periods (never a lead chunk), so it is
    # never received before n periods after the session started; a lead of one chunk gets it one
    # period sooner (test_generation_is_paced_to_playback). Slower is a slow machine's right.
    server = start_server("--model", "procedural", "--lead", "jit")
    try:
        async with WorldClient(server.ws) as client:
            loop = asyncio.get_running_loop()
            began = loop.time()
            info = await client.start(seed=9)
            period = info.model["frames_per_chunk"] / info.model["fps"]
            for _ in range(8):
                chunk = await client.next_chunk(timeout=30)
                assert loop.time() - began >= chunk.chunk_index * period, (chunk.chunk_index, period)
            assert chunk.chunk_index == 7
    finally:
        server.stop()
    assert "worldserve: pacing: just in time (a margin of 62 ms) (--lead), input preempts" in server.log(), server.log()
    assert "Traceback" not in server.log()
