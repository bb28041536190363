"""Two front-ends of one service whose Ray head (and with it the session directory) is lost.

A cluster of its own, since the test kills its head. Each front-end's workers are its own (not Ray
actors), so without a head it goes on alone: it says so (``/healthz``: the directory ``lost``, its
waiting line the front-end's own), its worlds play on and resume through its own door, it admits new
worlds, and a resume for a world on the other front-end is refused as on a single server (nobody can
say where it lives). The process lives on past Ray's own minute without a head.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from ray_harness import local_cluster  # noqa: E402
from server_harness import RunningServer, free_port, start_server  # noqa: E402
from worldserve.client import WorldClient, WorldError  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]


@pytest.fixture
def cluster() -> Iterator[Any]:
    with local_cluster() as made:
        yield made


def _health(server: RunningServer) -> dict[str, Any]:
    return server.health()


async def test_without_the_head_each_front_end_goes_on_alone_and_says_so(cluster: Any) -> None:
    servers: list[RunningServer] = []
    try:
        for _ in range(2):
            port = free_port()
            args = ["--model", "procedural", "--directory", "ray", "--ray-address", cluster.address]
            args += ["--public-url", f"http://127.0.0.1:{port}", "--resume-grace-s", "60"]
            servers.append(start_server(*args, port=port, timeout=120.0))
        a, b = servers
        client = WorldClient(a.ws)
        await client.connect()
        info = await client.start(seed=6)
        await client.next_chunk(timeout=10)
        assert [_health(server)["directory"]["state"] for server in servers] == ["ok", "ok"]

        cluster.remove_node(cluster.head_node, allow_graceful=False)  # the head, and the directory's actor
        deadline = time.monotonic() + 60
        while any(_health(server)["directory"]["state"] != "lost" for server in servers):
            assert time.monotonic() < deadline, "a front-end never said its directory was lost"
            await asyncio.sleep(0.2)
        for server in servers:
            health = _health(server)
            assert health["status"] == "ok"
            assert health["queue"]["line"] == "front-end"

        for _ in range(3):  # its world plays on
            await client.next_chunk(timeout=10)
        await client.drop()
        client.url = b.ws  # the other door cannot say where the world lives now
        with pytest.raises(WorldError) as refused:
            await client.resume()
        assert refused.value.code == "resume_refused"
        client.url = a.ws  # its own door can
        assert (await client.resume()).session_id == info.session_id
        await client.next_chunk(timeout=10)
        async with WorldClient(b.ws) as newcomer:  # and each front-end admits new worlds
            await newcomer.start(seed=7)
            await newcomer.next_chunk(timeout=10)
            await newcomer.close()
        await client.close()
        assert all(server.process.poll() is None for server in servers)
        assert "the session directory" in a.log()
        assert "is lost" in a.log()
        began = time.monotonic()
        for server in servers:  # a stop without a head is as quick as with one, and clean
            server.process.terminate()
            assert server.process.wait(timeout=20) == 0
        assert time.monotonic() - began < 15
    finally:
        for server in servers:
            server.stop()
