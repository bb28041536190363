"""Resume and multiplayer over real sockets: a ``worldserve serve`` process per module.

Drops are real (the client aborts its TCP connection, no close handshake); every test
checks what happened (seqs, ids, codes), never how fast.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import websockets

from server_harness import RunningServer, start_server
from worldserve.client import ClientChunk, WorldClient, WorldClientError, WorldError, keys


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--workers", "1", "--resume-grace-s", "30")
    yield running
    running.stop()


async def _until_applied(client: WorldClient, wanted: set[int], seen: list[ClientChunk], limit: int = 40) -> None:
    """Consume chunks (recording them) until every id in ``wanted`` was applied or dropped."""
    for _ in range(limit):
        applied = {i for chunk in seen for i in chunk.applied_event_ids}
        dropped = {i for notice in client.dropped for i in notice.event_ids}
        if wanted <= applied | dropped:
            return
        seen.append(await client.next_chunk(timeout=10))
    raise AssertionError(f"events never applied: {sorted(wanted - applied - dropped)}")


def _applied_once(chunks: list[ClientChunk]) -> list[int]:
    ids = [i for chunk in chunks for i in chunk.applied_event_ids]
    assert len(ids) == len(set(ids)), f"an event was applied twice: {ids}"
    return ids


async def test_drop_mid_chunk_and_resume_keeps_seq_and_every_event(server: RunningServer) -> None:
    client = WorldClient(server.ws)
    await client.connect()
    info = await client.start(seed=5)
    assert info.resume_token
    assert len(info.resume_token) >= 24
    seen = [await client.next_chunk(timeout=10)]
    accepted = set()
    for step in range(3):
        accepted.add((await client.send_event(controls=[keys("W" if step % 2 else "D")])).event_id)
    # Pending events, a chunk paced to come: the socket dies with no close handshake.
    await client.drop()
    await asyncio.sleep(0.6)  # the chunk in flight commits while the session is parked
    resumed = await client.resume()
    assert resumed.session_id == info.session_id
    assert resumed.role == "host"
    for step in range(3):
        accepted.add((await client.send_event(prompt=f"after {step}")).event_id)
    await _until_applied(client, accepted, seen)
    for _ in range(3):
        seen.append(await client.next_chunk(timeout=10))
    seqs = [chunk.seq for chunk in seen]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap or repeat across the resume: {seqs}"
    assert client.skipped == []
    # Held keys coalesce: an earlier one superseded by a later one is reported, not applied.
    superseded = {i for notice in client.dropped for i in notice.event_ids}
    assert {notice.reason for notice in client.dropped} <= {"superseded"}
    assert set(_applied_once(seen)) | superseded == accepted
    assert not set(_applied_once(seen)) & superseded
    await client.close()


async def test_resume_refused_after_the_grace_period() -> None:
    running = start_server("--model", "procedural", "--workers", "1", "--resume-grace-s", "0.5")
    try:
        client = WorldClient(running.ws)
        await client.connect()
        await client.start(seed=1)
        await client.next_chunk(timeout=10)
        await client.drop()
        for _ in range(50):  # the parked session is released once the grace is over
            if (await asyncio.to_thread(_sessions, running)) == 0:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(WorldError) as refused:
            await client.resume()
        assert refused.value.code == "resume_refused"
        await client.disconnect()
    finally:
        running.stop()


def _sessions(server: RunningServer) -> int:
    return int(server.health()["sessions"])


def _metrics(server: RunningServer) -> str:
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as response:
        return str(response.read().decode())


async def _until_closed(client: WorldClient) -> None:
    for _ in range(20):
        await client.next_chunk(timeout=10)


async def _pump(client: WorldClient) -> None:
    while True:
        await client.next_chunk(timeout=10)


async def _refusal(server: RunningServer, message: dict[str, Any]) -> dict[str, Any]:
    async with websockets.connect(server.ws) as ws:
        await ws.send(json.dumps(message))
        reply: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10))
        return reply


async def test_a_wrong_token_is_refused_like_an_unknown_session(server: RunningServer) -> None:
    async with WorldClient(server.ws) as host:
        info = await host.start(seed=2, share_viewers=True)
        assert info.viewer_token is not None
        assert info.controller_token is None
        resume = {"type": "session.resume", "id": "r", "last_seq": -1}
        wrong = await _refusal(server, {**resume, "session_id": info.session_id, "token": "not-the-token"})
        unknown = await _refusal(server, {**resume, "session_id": "no-such-session", "token": "not-the-token"})
        assert wrong == unknown
        assert wrong["code"] == "resume_refused"
        assert wrong["id"] == "r"
        # A share token is not a resume token, and a viewer token does not grant control.
        shared = await _refusal(server, {**resume, "session_id": info.session_id, "token": info.viewer_token})
        assert shared == unknown
        join = {"type": "session.join", "id": "j", "role": "controller"}
        as_controller = await _refusal(server, {**join, "session_id": info.session_id, "token": info.viewer_token})
        nowhere = await _refusal(server, {**join, "session_id": "no-such-session", "token": info.viewer_token})
        assert as_controller == nowhere
        assert nowhere["code"] == "join_refused"
        await host.close()


async def test_two_controllers_and_three_viewers_share_one_world(server: RunningServer) -> None:
    host = WorldClient(server.ws)
    await host.connect()
    info = await host.start(seed=3, share_viewers=True, share_controllers=True)
    assert info.viewer_token
    assert info.controller_token
    controllers = [WorldClient(server.ws) for _ in range(2)]
    viewers = [WorldClient(server.ws) for _ in range(3)]
    for client in controllers + viewers:
        await client.connect()
    for client in controllers:
        joined = await client.join(info.session_id, info.controller_token, role="controller")
        assert joined.role == "controller"
    for client in viewers:
        assert (await client.join(info.session_id, info.viewer_token)).role == "viewer"
    with pytest.raises(WorldError) as refused:
        await viewers[0].send_event(prompt="let me drive")
    assert refused.value.code == "not_controller"

    # Every controller (the host is one) uses the same wire ids 1..5: each sees only its own.
    everyone = [host, *controllers]
    accepted: list[set[int]] = []
    for client in everyone:
        ids = set()
        for event_id in range(1, 6):
            acceptance = await client.send_event(event_id=event_id, controls=[keys("A")])
            assert acceptance.status == "accepted"
            ids.add(acceptance.event_id)
        accepted.append(ids)
    assert (await controllers[0].send_event(event_id=5, prompt="again")).status == "duplicate"

    seen: list[list[ClientChunk]] = [[] for _ in everyone]
    for client, ids, chunks in zip(everyone, accepted, seen, strict=True):
        await _until_applied(client, ids, chunks)
        # Held keys coalesce across controllers: a superseded one is reported to its own sender.
        superseded = {i for notice in client.dropped for i in notice.event_ids}
        assert {notice.reason for notice in client.dropped} <= {"superseded"}
        applied = set(_applied_once(chunks))
        assert applied | superseded == ids
        assert not applied & superseded
    with pytest.raises(WorldError) as stale:  # per connection: 0 is below this controller's own floor (5)
        await controllers[1].send_event(event_id=0, prompt="older than my last")
    assert stale.value.code == "stale_event"
    # Both were caught per connection, before the session's queue; its counters (the metrics) still see them.
    metrics = await asyncio.to_thread(_metrics, server)
    for outcome in ("duplicate", "stale"):
        line = next(
            line for line in metrics.splitlines() if line.startswith(f'worldserve_events_total{{outcome="{outcome}"}}')
        )
        assert float(line.split()[-1]) >= 1, line
    # Controllers' acks drive the pace: they go on playing while the viewers catch up.
    pumps = [asyncio.create_task(_pump(client)) for client in everyone]
    viewer_chunks = [[await viewer.next_chunk(timeout=10) for _ in range(6)] for viewer in viewers]
    for pump in pumps:
        pump.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
    for chunks in viewer_chunks:
        assert all(chunk.applied_event_ids == () for chunk in chunks)
        seqs = [chunk.seq for chunk in chunks]
        assert seqs == sorted(set(seqs))

    # A joiner leaving leaves the world running; the host leaving ends it for everyone.
    await controllers[1].close()
    await host.send_event(prompt="still here")
    await host.next_chunk(timeout=10)
    await host.close()
    for client in [controllers[0], *viewers]:
        with pytest.raises(WorldClientError, match="host_left"):
            await _until_closed(client)
        await client.disconnect()


async def test_a_viewer_that_never_reads_or_acks_does_not_slow_the_host(server: RunningServer) -> None:
    async with WorldClient(server.ws) as host:
        info = await host.start(seed=4, share_viewers=True)
        assert info.viewer_token is not None
        async with websockets.connect(server.ws) as stuck:
            await stuck.send(
                json.dumps(
                    {
                        "type": "session.join",
                        "session_id": info.session_id,
                        "token": info.viewer_token,
                        "role": "viewer",
                    }
                )
            )
            chunks = [await host.next_chunk(timeout=10) for _ in range(12)]
            seqs = [chunk.seq for chunk in chunks]
            assert seqs == list(range(seqs[0], seqs[0] + 12))
            # The viewer got at most max_lag_chunks chunks, then skips; an ack brings it back.
            got: list[dict[str, Any]] = []
            async with asyncio.timeout(10):
                while sum(1 for m in got if m["type"] == "chunk") < info.max_lag_chunks:
                    message = await stuck.recv()
                    if isinstance(message, str):
                        got.append(json.loads(message))
            assert got[0]["type"] == "session.joined"
            last = [m for m in got if m["type"] == "chunk"][-1]["seq"]
            await stuck.send(json.dumps({"type": "chunk.ack", "seq": last}))
            async with asyncio.timeout(10):
                while True:
                    message = await stuck.recv()
                    if isinstance(message, str) and json.loads(message)["type"] == "chunk.skipped":
                        skipped = json.loads(message)
                        break
            assert skipped["from_seq"] == last + 1
            assert skipped["to_seq"] >= skipped["from_seq"]
            async with asyncio.timeout(10):
                while True:
                    message = await stuck.recv()
                    if isinstance(message, str) and json.loads(message)["type"] == "chunk":
                        assert json.loads(message)["seq"] == skipped["to_seq"] + 1
                        break
        await host.close()


async def test_bench_smoke_with_viewers_and_drop_resume(server: RunningServer) -> None:
    from worldserve.tools.loadtest import format_viewers_table, run_viewers_bench

    alone, shared = await run_viewers_bench(
        server.ws, clients=1, duration=1.5, event_interval=0.2, viewers=2, drop_resume=True
    )
    table = format_viewers_table(alone, shared)
    assert "server CPU ms per chunk, per extra viewer" in table
    for result in (alone, shared):
        for report in result.reports:
            assert report.resumes == 1
            assert report.errors == {}
            assert (report.lost, report.applied_twice, report.seq_gaps) == (0, 0, 0)
            assert report.accepted == report.applied_once + report.dropped
    assert len(shared.viewers) == 2
    assert all(viewer.chunks > 0 and not viewer.errors for viewer in shared.viewers)
    assert shared.server is not None  # the server's /metrics carries its CPU time
