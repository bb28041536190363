"""Two front-ends of one service behind a real L7 balancer, their session directory on a real Ray cluster.

Each front-end is a real ``worldserve serve --directory ray`` process whose public URL is the
balancer's path to it (``/fe/N``); nginx (Debian's, run from a folder of the test's:
``worldserve.tools.topology.Nginx``) balances ``/v1/world`` round robin over both; the directory is
the cluster's named actor. A resume or a share link's join that reaches the front-end a world does
not live on is told ``session.moved {url}``, and the Python client goes there by itself, with
nothing lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from ray_harness import local_cluster  # noqa: E402
from server_harness import RunningServer, free_port, start_server  # noqa: E402
from worldserve.client import ClientChunk, WorldClient, WorldError  # noqa: E402
from worldserve.protocol import ControlInput  # noqa: E402
from worldserve.tools.topology import Nginx, front_end_path  # noqa: E402

if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
    pytest.skip("nginx is not installed (make services installs Debian's nginx-light)", allow_module_level=True)

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]


def keys(*held: str) -> ControlInput:
    return ControlInput("keys", "worldserve.keys.v1", {"held": list(held)})


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster() as made:
        yield made


class Door:
    """One front-end as clients reach it: through the balancer's path to it."""

    def __init__(self, server: RunningServer, balancer: str, index: int) -> None:
        self.server = server
        self.http = f"{balancer}{front_end_path(index)}"
        self.ws = "ws" + self.http.removeprefix("http") + "/v1/world"


@pytest.fixture(scope="module")
def balancer(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    return ("127.0.0.1", free_port())


@contextlib.contextmanager
def _service(cluster: Any, balancer: tuple[str, int], folder: Path, *extra: str) -> Iterator[list[Door]]:
    """Two front-ends (procedural, ``extra`` flags) sharing the cluster's directory, behind nginx at ``balancer``."""
    started: list[RunningServer] = []
    lb = f"http://{balancer[0]}:{balancer[1]}"
    try:
        for index in (1, 2):
            args = ["--model", "procedural", "--workers", "1", "--directory", "ray", *extra]
            args += ["--ray-address", cluster.address, "--public-url", f"{lb}{front_end_path(index)}"]
            started.append(start_server(*args, timeout=120.0))
        with Nginx(balancer, [("127.0.0.1", server.port) for server in started], folder):
            yield [Door(server, lb, index) for index, server in enumerate(started, 1)]
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def doors(cluster: Any, balancer: tuple[str, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Door]]:
    with _service(cluster, balancer, tmp_path_factory.mktemp("nginx"), "--resume-grace-s", "30") as made:
        yield made


@pytest.fixture(scope="module")
def lb(balancer: tuple[str, int]) -> str:
    """The service's one WebSocket URL: the balancer's, round robin over the front-ends."""
    return f"ws://{balancer[0]}:{balancer[1]}/v1/world"


def _health(door: Door) -> dict[str, Any]:
    with urllib.request.urlopen(door.http + "/healthz", timeout=5) as response:
        return dict(json.loads(response.read()))


def _moved(door: Door) -> float:
    with urllib.request.urlopen(door.http + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("worldserve_sessions_moved_total "):
                return float(line.split()[1])
    raise AssertionError("no worldserve_sessions_moved_total")


async def _until_known(server: Door, world: str) -> None:
    """Wait until ``server``'s directory knows ``world`` (published at once; a refresh a second later at worst)."""
    for _ in range(50):
        async with WorldClient(server.ws) as probe:
            with contextlib.suppress(WorldError):  # the owner's refusal after the move, or a world not known yet
                await probe.join(world, "x" * 24)
            if probe.url != server.ws:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{server.ws} never learned where {world} lives")


async def _until_applied(client: WorldClient, wanted: set[int], seen: list[ClientChunk]) -> None:
    for _ in range(60):
        applied = {i for chunk in seen for i in chunk.applied_event_ids}
        dropped = {i for notice in client.dropped for i in notice.event_ids}
        if wanted <= applied | dropped:
            return
        seen.append(await client.next_chunk(timeout=30))
    raise AssertionError("events never applied")


async def test_both_front_ends_say_the_directory_answers(doors: list[Door]) -> None:
    for door in doors:
        health = _health(door)["directory"]
        assert health["state"] == "ok"
        assert health["url"] == door.ws


async def test_a_player_dropped_mid_world_resumes_through_the_balancer_with_its_ledger_exact(
    doors: list[Door], lb: str
) -> None:
    client = WorldClient(lb)
    await client.connect()
    info = await client.start(seed=11)
    assert info.resume_token
    (a,) = [door for door in doors if door.ws == info.url]  # where the balancer put the world
    (b,) = [door for door in doors if door is not a]
    moved_before = _moved(b)
    seen = [await client.next_chunk(timeout=30)]
    accepted = {(await client.send_event(controls=[keys("W" if step % 2 else "D")])).event_id for step in range(3)}
    await client.drop()  # the socket dies; the world is parked on a for its grace
    client.url = b.ws  # the reconnect lands on the other front-end
    resumed = await client.resume()
    assert resumed.session_id == info.session_id
    assert client.url == a.ws  # told session.moved, the client went where the world lives
    assert _moved(b) == moved_before + 1
    seen.append(await client.next_chunk(timeout=30))
    await client.drop()  # and once more, through the balancer's round robin, whichever door it picks
    client.url = lb
    await client.resume()
    assert client.url in (lb, a.ws)
    accepted |= {(await client.send_event(prompt=f"after {step}")).event_id for step in range(3)}
    await _until_applied(client, accepted, seen)
    for _ in range(2):
        seen.append(await client.next_chunk(timeout=30))
    seqs = [chunk.seq for chunk in seen]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap or repeat across the move: {seqs}"
    applied = [i for chunk in seen for i in chunk.applied_event_ids]
    assert len(applied) == len(set(applied)), f"an event applied twice: {applied}"
    superseded = {i for notice in client.dropped for i in notice.event_ids}
    assert {notice.reason for notice in client.dropped} <= {"superseded"}
    assert set(applied) | superseded == accepted
    await client.close()


async def test_a_share_link_opened_through_either_door_joins(doors: list[Door]) -> None:
    a, b = doors
    async with WorldClient(b.ws) as host:
        info = await host.start(seed=3, share_viewers=True, share_controllers=True)
        assert info.viewer_token
        assert info.controller_token
        await host.next_chunk(timeout=30)

        async def play() -> None:  # the host plays on (acking), or its world waits for it: paced to its acks
            while True:
                await host.next_chunk()

        playing = asyncio.create_task(play())
        for door in (a, b):
            async with WorldClient(door.ws) as viewer:
                joined = await viewer.join(info.session_id, info.viewer_token)
                assert (joined.session_id, joined.role, viewer.url) == (info.session_id, "viewer", b.ws)
                assert len((await viewer.next_chunk(timeout=30)).frames) > 0  # the world's frames, from b
        async with WorldClient(a.ws) as controller:
            await controller.join(info.session_id, info.controller_token, role="controller")
            event = await controller.send_event(controls=[keys("A")])
            for _ in range(20):
                if event.event_id in (await controller.next_chunk(timeout=30)).applied_event_ids:
                    break
            else:
                raise AssertionError("the controller's event, sent through the other door, was never applied")
        playing.cancel()
        await host.close()


async def test_an_ended_world_or_an_unknown_one_is_refused_at_either_door(doors: list[Door]) -> None:
    a, b = doors
    async with WorldClient(a.ws) as host:
        info = await host.start(seed=8, share_viewers=True)
        await host.next_chunk(timeout=30)
        await _until_known(b, info.session_id)
        await host.close()  # the world ends: withdrawn from the directory at once
    assert info.viewer_token
    for door in (b, a):
        async with WorldClient(door.ws) as late:
            with pytest.raises(WorldError) as refused:
                await late.join(info.session_id, info.viewer_token)
            assert refused.value.code == "join_refused"
            assert late.url == door.ws  # not sent anywhere
    async with WorldClient(b.ws) as stranger:
        resume = {"type": "session.resume", "session_id": "no-such-world", "token": "x" * 24, "last_seq": -1}
        with pytest.raises(WorldError) as refused:
            await stranger._request(resume)
        assert refused.value.code == "resume_refused"


def test_the_players_share_link_through_the_balancer_joins_wherever_it_lands(
    doors: list[Door], balancer: tuple[str, int]
) -> None:
    """The page (Chromium) through nginx: a viewer's share link lands on either front-end; where it lands
    on the one the world does not live on, the page follows session.moved and plays the world."""
    from test_browser import open_page, wait_for  # Playwright is imported by the browser tests only

    service = SimpleNamespace(http=f"http://{balancer[0]}:{balancer[1]}")
    moved_before = sum(_moved(door) for door in doors)
    with open_page(service) as host:  # type: ignore[arg-type]
        host.fill("#seed", "5")
        host.click("#start")
        wait_for(host, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        session_id = host.evaluate("() => window.worldserve.sessionId")
        link = host.evaluate("() => window.worldserve.shareLinks")["viewer"]
        assert link.startswith(service.http)
        assert host.context.browser is not None
        landed = []
        # Through the balancer's root (round robin: either front-end), then through each front-end's own path
        # (the page's socket goes below its own path, so the page opened there talks to that front-end).
        query = link.split("?", 1)[1]
        for url in (link, *(f"{door.http}/?{query}" for door in doors)):
            viewer = host.context.browser.new_page()
            viewer.goto(url)
            wait_for(viewer, "window.worldserve.status === 'live' && window.worldserve.displayed > 2")
            assert viewer.evaluate("() => [window.worldserve.role, window.worldserve.sessionId]") == [
                "viewer",
                session_id,
            ]
            landed.append(viewer.evaluate("() => window.worldserve.worldUrl"))
            viewer.close()
        assert None in landed[1:], "no page landed on the world's own front-end"
        assert {url for url in landed if url} <= {door.ws for door in doors}, landed
        assert any(landed[1:]), "no page landed on the other front-end (and was moved)"
    assert sum(_moved(door) for door in doors) == moved_before + sum(1 for url in landed if url)


@pytest.fixture(scope="module")
def full_doors(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Door]]:
    """Two front-ends of one session slot each, behind a balancer of their own, a service of their own on the
    cluster (its own worlds and line)."""
    folder = tmp_path_factory.mktemp("nginx")
    with _service(
        cluster, ("127.0.0.1", free_port()), folder, "--max-sessions-per-worker", "1", "--service", "full"
    ) as made:
        yield made


async def test_twelve_queued_starts_across_both_doors_start_in_arrival_order_as_room_opens_on_either(
    full_doors: list[Door],
) -> None:
    """One line for the service: starts queued at either door are told their place in the whole line and
    start in arrival order on whichever front-end frees a slot (moved there when it is the other one)."""
    running: list[WorldClient] = []
    waiting: list[tuple[WorldClient, asyncio.Task[Any]]] = []
    try:
        for door in full_doors:  # both slots taken
            host = WorldClient(door.ws)
            await host.connect()
            await host.start(seed=1)
            running.append(host)
        for i in range(12):
            door = full_doors[i % 2]
            client = WorldClient(door.ws)
            await client.connect()
            waiting.append((client, asyncio.create_task(client.start(seed=100 + i, queue=True))))
            async with asyncio.timeout(20):
                while not client.queued:  # noqa: ASYNC110 -- its first notice: it is in line
                    await asyncio.sleep(0.02)
            first = client.queued[0]
            assert (first.position, first.ahead) == (i + 1, i), f"start {i} told {first}"
        assert all(_health(door)["queue"]["line"] == "service" for door in full_doors)

        moved = 0
        for i in range(12):
            # A slot opens on a (then b, a, ...) for three starts in a row: the head waits there or not.
            door = full_doors[(i // 3) % 2]
            there = [client for client in running if client.url == door.ws] or running
            running.remove(there[0])
            await there[0].close()
            pending = {task for _, task in waiting if not task.done()}
            async with asyncio.timeout(30):
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            client, task = waiting[i]
            assert done == {task}, f"start {i} was not the one to start next"
            info = task.result()
            moved += client.url != full_doors[i % 2].ws
            assert client.url == info.url  # it plays on the front-end it started on
            running.append(client)
            positions = [notice.position for notice in client.queued]
            assert positions == sorted(positions, reverse=True), positions  # counted down, never back
            assert all(notice.ahead == notice.position - 1 for notice in client.queued)
        assert moved > 0, "no start was moved to the other front-end"
        assert moved < 12, "every start was moved"
    finally:
        for _, task in waiting:
            task.cancel()
        for client in running + [client for client, _ in waiting]:
            with contextlib.suppress(Exception):
                await client.close()


def test_the_players_queued_start_moves_to_the_front_end_that_frees_a_slot(full_doors: list[Door]) -> None:
    """Chromium through nginx: both front-ends full, the page's start waits in the service's line on the
    front-end it landed on; a slot frees on the other one: the page follows session.moved, starts there."""
    from test_browser import open_page, wait_for  # Playwright is imported by the browser tests only

    async def hold(door: Door) -> WorldClient:
        for _ in range(10):  # a start without queue is refused while the line (as last polled) had anyone: retry
            client = WorldClient(door.ws)
            await client.connect()
            try:
                await client.start(seed=2)
                return client
            except WorldError as error:
                await client.disconnect()
                if error.code != "admission_refused":
                    raise
                await asyncio.sleep(0.5)
        raise AssertionError(f"{door.ws} never admitted a start")

    loop = asyncio.new_event_loop()  # the clients' own, in a thread: Playwright's sync API holds this one
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=30)

    try:
        hosts = [run(hold(door)) for door in full_doors]
        lb = full_doors[0].http.rsplit("/fe/", 1)[0]
        with open_page(SimpleNamespace(http=lb)) as page:  # type: ignore[arg-type]
            page.click("#start")
            wait_for(page, "window.worldserve.status === 'queued'")
            (here,) = [i for i, door in enumerate(full_doors) if _health(door)["queue"]["waiting"] == 1]
            other = 1 - here
            run(hosts[other].close())  # the slot opens on the front-end it does not wait on
            wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 2")
            assert page.evaluate("() => window.worldserve.worldUrl") == full_doors[other].ws
            page.click("#close")
            wait_for(page, "window.worldserve.status === 'idle'")
        run(hosts[here].close())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
