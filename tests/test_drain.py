"""Draining a real front-end (``--drain-timeout-s``): SIGTERM or ``POST /admin/drain`` admits no more starts,
``/healthz`` answers 503 ``draining``, the worlds already playing go on (nothing lost, a resume too), and
the server stops when the last one ends, or ends those left when the time is up."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from server_harness import RunningServer, start_server
from worldserve.client import ClientChunk, WorldClient, WorldClientError, WorldError
from worldserve.protocol import ControlInput

pytestmark = pytest.mark.timeout(180)


def keys(*held: str) -> ControlInput:
    return ControlInput("keys", "worldserve.keys.v1", {"held": list(held)})


def _health(server: RunningServer) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(server.http + "/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 -- the players' progress is plain state, polled
            await asyncio.sleep(0.05)


async def _until_draining(server: RunningServer) -> dict[str, Any]:
    for _ in range(100):
        status, health = _health(server)
        if status == 503:
            return health
        await asyncio.sleep(0.05)
    raise AssertionError("the server never said it was draining")


class Player:
    """One playing session: events now and then, every chunk kept, until told to stop."""

    def __init__(self, url: str, seed: int) -> None:
        self.client = WorldClient(url)
        self.seed = seed
        self.chunks: list[ClientChunk] = []
        self.accepted: set[int] = set()
        self.ended: BaseException | None = None

    async def play(self, stop: asyncio.Event) -> None:
        await self.client.connect()
        await self.client.start(seed=self.seed)
        step = 0
        try:
            while not stop.is_set():
                self.chunks.append(await self.client.next_chunk(timeout=10))
                if step % 2 == 0:
                    held = "W" if step % 4 else "D"
                    self.accepted.add((await self.client.send_event(controls=[keys(held)])).event_id)
                step += 1
        except WorldClientError as error:  # the world ended under it (the drain's time was up)
            self.ended = error

    async def settle(self) -> None:
        """Read on until every accepted event was applied or reported dropped."""
        for _ in range(40):
            applied = {i for chunk in self.chunks for i in chunk.applied_event_ids}
            dropped = {i for notice in self.client.dropped for i in notice.event_ids}
            if self.accepted <= applied | dropped:
                return
            self.chunks.append(await self.client.next_chunk(timeout=10))
        raise AssertionError("events never applied")

    def ledger(self) -> tuple[list[int], set[int]]:
        seqs = [chunk.seq for chunk in self.chunks]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap or repeat: {seqs}"
        applied = [i for chunk in self.chunks for i in chunk.applied_event_ids]
        assert len(applied) == len(set(applied)), f"an event applied twice: {applied}"
        return seqs, set(applied)


async def test_sigterm_drains_eight_playing_worlds_and_stops_when_the_last_one_ends() -> None:
    server = start_server("--model", "procedural", "--drain-timeout-s", "60", "--resume-grace-s", "30")
    try:
        players = [Player(server.ws, seed) for seed in range(8)]
        stops = [asyncio.Event() for _ in players]
        playing = [asyncio.create_task(player.play(stop)) for player, stop in zip(players, stops, strict=True)]
        await until(lambda: min(len(player.chunks) for player in players) >= 3)
        server.process.send_signal(signal.SIGTERM)
        health = await _until_draining(server)
        assert health["status"] == "draining"
        assert health["drain"]["worlds"] == 8
        assert health["drain"]["why"] == "SIGTERM"

        async with WorldClient(server.ws) as newcomer:  # no more starts: retry elsewhere
            with pytest.raises(WorldError) as refused:
                await newcomer.start(seed=99)
            assert refused.value.code == "admission_refused"
            assert "draining" in str(refused.value)
            assert refused.value.retry_after_ms is not None

        counts = [len(player.chunks) for player in players]  # every world plays on through the drain
        await until(lambda: all(len(p.chunks) >= count + 6 for p, count in zip(players, counts, strict=True)))

        stops[0].set()  # a resume is still taken while draining
        await playing[0]
        await players[0].client.drop()
        await players[0].client.resume()
        for _ in range(3):
            players[0].chunks.append(await players[0].client.next_chunk(timeout=10))
        for stop in stops:
            stop.set()
        await asyncio.gather(*playing)
        for player in players:
            assert player.ended is None
            await player.settle()
            _, applied = player.ledger()
            superseded = {i for notice in player.client.dropped for i in notice.event_ids}
            assert {notice.reason for notice in player.client.dropped} <= {"superseded"}
            await player.client.close()
            missing = player.accepted - applied - superseded
            assert not missing, f"accepted, never applied: {missing}"
        assert server.process.wait(timeout=30) == 0  # the last world ended: the drain is over
        assert "draining (SIGTERM)" in server.log()
        assert "Traceback" not in server.log()
    finally:
        server.stop()


async def test_a_drain_past_its_time_ends_the_worlds_left_with_shutdown_and_accounts_for_every_event() -> None:
    server = start_server("--model", "procedural", "--drain-timeout-s", "1.5")
    try:
        player = Player(server.ws, 4)
        stop = asyncio.Event()
        playing = asyncio.create_task(player.play(stop))
        await until(lambda: len(player.chunks) >= 3)
        server.process.send_signal(signal.SIGTERM)
        await _until_draining(server)
        await asyncio.wait_for(playing, timeout=30)
        assert player.ended is not None
        assert "shutdown" in str(player.ended)
        _, applied = player.ledger()
        dropped = {i for notice in player.client.dropped for i in notice.event_ids}
        assert {notice.reason for notice in player.client.dropped} <= {"superseded", "closed"}
        assert player.accepted <= applied | dropped
        assert len(player.chunks) > 3  # it played on through the drain before the time was up
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()


async def test_admin_drain_is_behind_the_token() -> None:
    server = start_server("--model", "procedural", "--drain-timeout-s", "30", token="drain-test-token")
    try:
        request = urllib.request.Request(server.http + "/admin/drain", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
        assert refused.value.code == 401
        assert _health(server)[0] == 200
        request.add_header("Authorization", "Bearer drain-test-token")
        response = await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
        with response:
            assert response.status == 202
            assert json.loads(response.read())["begun"] is True
        # No world here: the drain is over at once and the server stops.
        assert server.process.wait(timeout=30) == 0
        assert "draining (POST /admin/drain)" in server.log()
    finally:
        server.stop()
