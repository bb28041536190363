"""A full server never takes a world from someone playing it; newcomers wait in line (real server, real sockets).

Each server here has one worker holding one session (``--max-sessions-per-worker 1``), so
every second start meets a full server. The assertions are on what each client was told
and in which order, never on how long anything took.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import pytest
import websockets

from runtime_models import until
from server_harness import (
    RunningServer,
    check_a_playing_world_is_never_evicted,
    play_until,
    start_server,
    until_failed,
)
from worldserve.client import Queued, WorldClient, WorldClientError, WorldError

pytestmark = pytest.mark.timeout(180)

ONE_SLOT = ("--model", "procedural", "--workers", "1", "--max-sessions-per-worker", "1")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


async def _start_once_admitted(client: WorldClient, seed: int, *, queue: bool = False) -> list[str]:
    """Start, retrying each ``admission_refused`` (until a world stops being in use); the codes refused."""
    codes = []
    for _ in range(400):
        try:
            await client.start(seed=seed, queue=queue)
        except WorldError as refused:
            codes.append(refused.code)
            await asyncio.sleep(0.05)
        else:
            return codes
    raise AssertionError(f"never admitted: {codes[-3:]}")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(*ONE_SLOT, "--queue-max", "3", "--queue-timeout-s", "120")
    try:
        yield running
    finally:
        running.stop()
    assert "Traceback" not in running.log()


async def test_a_playing_world_is_never_evicted_by_newcomers(server: RunningServer) -> None:
    await check_a_playing_world_is_never_evicted(server.ws)


async def test_a_parked_world_is_evicted_for_a_newcomer_and_its_resume_says_evicted(server: RunningServer) -> None:
    parked = WorldClient(server.ws)
    await parked.connect()
    await parked.start(seed=1)
    await parked.next_chunk(timeout=30)
    await parked.drop()  # no close handshake: the server parks the world for a resume
    async with WorldClient(server.ws) as newcomer:
        # the drop reaches the server a moment later: until then the world is in use
        assert set(await _start_once_admitted(newcomer, 2)) <= {"admission_refused"}
        await newcomer.next_chunk(timeout=30)
        await parked.resume()  # the world is still there, its state is not
        assert (await until_failed(parked)).code == "evicted"
        await newcomer.close()
    assert await parked.reset() == 1  # room again: the evicted world starts over
    assert (await parked.next_chunk(timeout=30)).chunk_index == 0
    await parked.close()


async def test_newcomers_wait_in_line_first_come_first_served(server: RunningServer) -> None:
    async with WorldClient(server.ws) as player:
        await player.start(seed=1)
        stop = asyncio.Event()
        playing = asyncio.ensure_future(play_until(player, stop, []))
        waiters = [WorldClient(server.ws) for _ in range(3)]
        starts: list[asyncio.Future[object]] = []
        for index, waiter in enumerate(waiters):
            await waiter.connect()
            starts.append(asyncio.ensure_future(waiter.start(seed=10 + index, queue=True)))
            await until(lambda waiter=waiter: bool(waiter.queued), "joined the line before the next one comes")
        assert [w.queued[0].position for w in waiters] == [1, 2, 3]
        assert [w.queued[0].ahead for w in waiters] == [0, 1, 2]
        health = json.loads(_get(server.http + "/healthz"))
        assert health["queue"] == {"waiting": 3, "max": 3, "line": "front-end"}
        assert health["capacity"]["room"] is False

        async with WorldClient(server.ws) as late:  # the line is full
            with pytest.raises(WorldError, match="waiting line is too") as full:
                await late.start(seed=99, queue=True)
            assert full.value.code == "admission_refused"
            with pytest.raises(WorldError, match="came first"):  # a plain start never overtakes the line
                await late.start(seed=99)
        video_url = server.ws.replace("/v1/world", "/v1/realtime/video")
        async with websockets.connect(video_url) as video:  # nor does a vllm-omni client's start
            await video.send(json.dumps({"type": "session.start", "prompt": "islands"}))
            refused = json.loads(await asyncio.wait_for(video.recv(), 30))
            assert refused["type"] == "error"
            assert "came first" in refused["message"]

        await waiters[1].close()  # the second leaves the line (session.close): the third moves up
        with pytest.raises(WorldClientError, match="left the waiting line"):
            await starts[1]
        await until(lambda: waiters[2].queued[-1].position == 2, "the third moved up")

        stop.set()
        await playing
        await player.close()  # a slot opens: the first in line gets it
        await starts[0]
        assert waiters[0].session is not None
        assert not starts[2].done()
        assert (await waiters[0].next_chunk(timeout=30)).chunk_index == 0
        await waiters[0].close()
        await starts[2]  # then the third
        assert (await waiters[2].next_chunk(timeout=30)).chunk_index == 0
        positions = [q.position for q in waiters[2].queued]  # a notice may also bring only a fresher estimate
        moves = [p for i, p in enumerate(positions) if i == 0 or p != positions[i - 1]]
        assert moves[:2] == [3, 2]  # counted down (at most one notice a second: 1 may come or not)
        assert moves == sorted(set(moves), reverse=True)
        await waiters[2].close()

    metrics = _get(server.http + "/metrics")
    assert 'worldserve_queue_starts_total{outcome="admitted"} 2.0' in metrics
    assert 'worldserve_queue_starts_total{outcome="left"} 1.0' in metrics
    assert 'worldserve_queue_starts_total{outcome="full"} 1.0' in metrics
    assert "worldserve_queue_wait_seconds_count 3.0" in metrics
    assert "worldserve_queue_waiting 0.0" in metrics
    health = json.loads(_get(server.http + "/healthz"))
    assert health["queue"]["waiting"] == 0


async def test_the_newcomers_bench_phase_against_a_full_server(server: RunningServer) -> None:
    """`worldserve bench --newcomers` (its smoke run): no world in use evicted, the line first come
    first served, plain starts refused with a hint."""
    from worldserve.tools.newcomers import format_newcomers_table, run_newcomers

    result = await run_newcomers(server.ws, newcomers=3, leave_every=0.2)
    assert result.players == 1
    assert result.evicted_in_use == 0
    assert result.first_positions == [1, 2, 3]
    assert result.admitted_order == [0, 1, 2]
    assert len(result.waits) == 3
    assert (result.refused_with_hint, result.plain_starts, result.plain_admitted) == (3, 3, 0)
    assert result.ok
    table = format_newcomers_table(result)
    assert "| worlds evicted while in use (must be 0)    | 0 |" in table
    assert "yes [1, 2, 3]" in table


async def test_a_wait_past_the_queue_timeout_is_refused_and_idle_players_may_be_evicted() -> None:
    server = start_server(*ONE_SLOT, "--queue-timeout-s", "1", "--evict-idle-s", "1")
    try:
        async with WorldClient(server.ws) as player, WorldClient(server.ws) as waiter:
            await player.start(seed=1)
            stop = asyncio.Event()
            playing = asyncio.ensure_future(play_until(player, stop, []))
            told: list[Queued] = []
            with pytest.raises(WorldError, match="in line and the server is still full") as timed_out:
                await waiter.start(seed=2, queue=True, on_queued=told.append)
            assert timed_out.value.code == "admission_refused"
            assert [q.position for q in told] == [1]
            stop.set()
            await playing
            # The player stops reading (no acks): after --evict-idle-s its world is no longer in use.
            assert set(await _start_once_admitted(waiter, 3, queue=True)) <= {"admission_refused"}
            assert (await until_failed(player)).code == "evicted"  # the player reads on: its world was evicted
    finally:
        server.stop()
    assert "Traceback" not in server.log()
