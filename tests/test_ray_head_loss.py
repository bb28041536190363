"""A front-end whose Ray head (GCS) dies: every session is told ``worker_died``, then the server stops cleanly.

A cluster of its own (a head with no work, one worker node), since the test kills its head.
Without the head the front-end's Ray driver can neither place nor replace a worker, and Ray
would end the whole process about a minute later with every socket dropped: instead the
front-end notices within ``--ray-head-timeout-s``, each world gets ``session.failed
{code: "worker_died"}`` and ``session.closed {reason: "shutdown"}``, and the process exits 1
with one line saying why.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from ray_harness import local_cluster  # noqa: E402
from server_harness import start_server, until_failed  # noqa: E402
from worldserve.client import WorldClient, WorldClientError  # noqa: E402

# One xdist group for every Ray test: they share the machine's Ray address file and its cores.
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]


@pytest.fixture
def cluster() -> Iterator[Any]:
    with local_cluster() as made:
        made.add_node(num_cpus=1, resources={"worldserve": 1.0})
        yield made


async def test_a_lost_head_fails_every_session_worker_died_then_the_server_stops(cluster: Any) -> None:
    server = start_server(
        "--model", "procedural", "--workers", "1", "--executor", "ray", "--ray-address", cluster.address,
        "--ray-num-cpus", "0", "--ray-resource", "worldserve=1", "--ray-head-timeout-s", "3", timeout=120.0,
    )  # fmt: skip
    try:
        async with WorldClient(server.ws) as client:
            await client.start(seed=4)
            for _ in range(3):
                await client.next_chunk(timeout=30)
            cluster.remove_node(cluster.head_node, allow_graceful=False)  # the head (GCS) is gone
            failed = await until_failed(client)  # chunks made before the loss was noticed, then the failure
            assert failed.code == "worker_died"
            assert "Ray head (GCS) did not answer within 3 s" in failed.message
            with pytest.raises(WorldClientError, match="shutdown"):
                await client.next_chunk(timeout=60)  # session.closed {reason: shutdown}, then the socket closes
        server.process.wait(timeout=60)  # it stops by itself, well before Ray's own minute
        assert server.process.returncode == 1
        log = server.log()
        assert "worldserve: stopped: the Ray head (GCS) did not answer within 3 s" in log
        assert "Traceback" not in log
    finally:
        server.stop()
