"""Two front-ends of one service, their session directory kept on a real Ray cluster.

Each front-end is a real ``worldserve serve --directory ray`` process with a public URL of its
own; the directory is the cluster's named actor. A resume or a share link's join that reaches the
front-end a world does not live on is told ``session.moved {url}``, and the Python client goes
there by itself, with nothing lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from server_harness import RunningServer, free_port, start_server  # noqa: E402
from worldserve.client import ClientChunk, WorldClient, WorldError  # noqa: E402
from worldserve.protocol import ControlInput  # noqa: E402
from worldserve.runtime.executor.ray_actor import LOCAL_SYSTEM_CONFIG  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]


def keys(*held: str) -> ControlInput:
    return ControlInput("keys", "worldserve.keys.v1", {"held": list(held)})


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    root = Path(__file__).resolve().parent
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root.parent / "src"), str(root), saved or ""])
    made = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": dict(LOCAL_SYSTEM_CONFIG)}
    )
    try:
        yield made
    finally:
        with contextlib.suppress(Exception):
            made.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def doors(cluster: Any) -> Iterator[tuple[RunningServer, RunningServer]]:
    started: list[RunningServer] = []
    try:
        for _ in range(2):
            port = free_port()
            args = ["--model", "procedural", "--workers", "1", "--resume-grace-s", "30", "--directory", "ray"]
            args += ["--ray-address", cluster.address, "--public-url", f"http://127.0.0.1:{port}"]
            started.append(start_server(*args, port=port, timeout=120.0))
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


def _health(server: RunningServer) -> dict[str, Any]:
    with urllib.request.urlopen(server.http + "/healthz", timeout=5) as response:
        return dict(json.loads(response.read()))


def _moved(server: RunningServer) -> float:
    with urllib.request.urlopen(server.http + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("worldserve_sessions_moved_total "):
                return float(line.split()[1])
    raise AssertionError("no worldserve_sessions_moved_total")


async def _until_known(server: RunningServer, world: str) -> None:
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
        seen.append(await client.next_chunk(timeout=10))
    raise AssertionError("events never applied")


async def test_both_front_ends_say_the_directory_answers(doors: tuple[RunningServer, RunningServer]) -> None:
    for server in doors:
        health = _health(server)["directory"]
        assert health["state"] == "ok"
        assert health["url"] == server.ws


async def test_a_player_dropped_on_one_door_resumes_through_the_other_with_its_ledger_exact(
    doors: tuple[RunningServer, RunningServer],
) -> None:
    a, b = doors
    moved_before = _moved(b)
    client = WorldClient(a.ws)
    await client.connect()
    info = await client.start(seed=11)
    assert info.resume_token
    seen = [await client.next_chunk(timeout=10)]
    accepted = {(await client.send_event(controls=[keys("W" if step % 2 else "D")])).event_id for step in range(3)}
    await client.drop()  # the socket dies; the world is parked on a for its grace
    client.url = b.ws  # the reconnect lands on the other front-end, as through a balancer
    resumed = await client.resume()
    assert resumed.session_id == info.session_id
    assert client.url == a.ws  # told session.moved, the client went where the world lives
    assert _moved(b) == moved_before + 1
    accepted |= {(await client.send_event(prompt=f"after {step}")).event_id for step in range(3)}
    await _until_applied(client, accepted, seen)
    for _ in range(2):
        seen.append(await client.next_chunk(timeout=10))
    seqs = [chunk.seq for chunk in seen]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap or repeat across the move: {seqs}"
    applied = [i for chunk in seen for i in chunk.applied_event_ids]
    assert len(applied) == len(set(applied)), f"an event applied twice: {applied}"
    superseded = {i for notice in client.dropped for i in notice.event_ids}
    assert {notice.reason for notice in client.dropped} <= {"superseded"}
    assert set(applied) | superseded == accepted
    await client.close()


async def test_a_share_link_opened_through_either_door_joins(doors: tuple[RunningServer, RunningServer]) -> None:
    a, b = doors
    async with WorldClient(b.ws) as host:
        info = await host.start(seed=3, share_viewers=True, share_controllers=True)
        assert info.viewer_token
        assert info.controller_token
        await host.next_chunk(timeout=10)
        for door in (a, b):
            async with WorldClient(door.ws) as viewer:
                joined = await viewer.join(info.session_id, info.viewer_token)
                assert (joined.session_id, joined.role, viewer.url) == (info.session_id, "viewer", b.ws)
                assert len((await viewer.next_chunk(timeout=10)).frames) > 0  # the world's frames, from b
        async with WorldClient(a.ws) as controller:
            await controller.join(info.session_id, info.controller_token, role="controller")
            event = await controller.send_event(controls=[keys("A")])
            for _ in range(20):
                if event.event_id in (await controller.next_chunk(timeout=10)).applied_event_ids:
                    break
            else:
                raise AssertionError("the controller's event, sent through the other door, was never applied")
        await host.close()


async def test_an_ended_world_or_an_unknown_one_is_refused_at_either_door(
    doors: tuple[RunningServer, RunningServer],
) -> None:
    a, b = doors
    async with WorldClient(a.ws) as host:
        info = await host.start(seed=8, share_viewers=True)
        await host.next_chunk(timeout=10)
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
