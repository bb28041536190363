"""The topology script's own service, as docs/deploy.md gives it: a Ray head, two Ray worker nodes where the
front-ends' workers run (``--executor ray``), two front-ends sharing the head's session directory, nginx
in front; a world started through the balancer, resumed through the door it does not live on; then all
of it torn down, no process of it left."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")
if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
    pytest.skip("nginx is not installed (make services installs Debian's nginx-light)", allow_module_level=True)

from worldserve.client import WorldClient
from worldserve.tools.topology import processes_of, service

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]


async def test_the_scripts_service_runs_worlds_on_its_worker_nodes_and_leaves_nothing_behind() -> None:
    folder = Path(tempfile.mkdtemp(prefix="ws-"))  # short: Ray's socket paths live under it
    with service(2, worker_nodes=2, serve_args=["--model", "procedural"], folder=folder) as running:
        client = WorldClient(running.url.replace("http", "ws", 1) + "/v1/world")
        await client.connect()
        info = await client.start(seed=3)
        assert info.url in (running.door(1), running.door(2))
        other = running.door(2) if info.url == running.door(1) else running.door(1)
        await client.next_chunk(timeout=30)
        await client.drop()
        client.url = other
        await client.resume()
        assert client.url == info.url  # moved to where it lives
        await client.next_chunk(timeout=30)
        await client.close()
        logs = [(folder / f"front-end-{index}.log").read_text() for index in (1, 2)]
        assert all("a front-end of a service" in log for log in logs)
        assert all("Traceback" not in log for log in logs)
    assert processes_of(folder) == []  # the head, the nodes, the front-ends and nginx all ended
    shutil.rmtree(folder, ignore_errors=True)
