"""A lost Ray head that comes back (Ray's GCS fault tolerance: its state in Redis): each front-end of the
service finds the session directory again by itself, and a share link through the other door joins a
world that played on, untouched, the whole time.

The head's state is kept in a Redis server of the test's own (Debian's ``redis-server``; ``make
services`` installs it): a restarted head reloads it, and the front-ends' Ray drivers reconnect. The
directory's actor died with the head, and a driver cannot reach an actor it knew through a restarted
head, so the first front-end to notice starts its next generation and the other follows
(``directory_ray.RayDirectoryStore``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
REDIS = shutil.which("redis-server")
if REDIS is None:
    pytest.skip("redis-server is not installed (make services installs Debian's)", allow_module_level=True)

from server_harness import RunningServer, free_port, start_server  # noqa: E402
from worldserve.client import WorldClient  # noqa: E402
from worldserve.tools.topology import start_ray, stop_ray  # noqa: E402

pytestmark = [pytest.mark.timeout(480), pytest.mark.xdist_group("ray")]


def _directory(server: RunningServer) -> str:
    with urllib.request.urlopen(server.http + "/healthz", timeout=5) as response:
        return str(json.loads(response.read())["directory"]["state"])


async def _until(servers: list[RunningServer], state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_directory(server) != state for server in servers):
        assert time.monotonic() < deadline, f"the front-ends' directory never became {state}"
        await asyncio.sleep(0.2)


async def test_a_head_that_comes_back_with_its_state_gives_the_front_ends_their_directory_again() -> None:
    folder = Path(tempfile.mkdtemp(prefix="ws-"))  # short: Ray's socket paths live under it
    redis_port, ray_port = free_port(), free_port()
    assert REDIS is not None
    redis = subprocess.Popen(  # noqa: ASYNC220 -- set-up, before any client runs
        [REDIS, "--port", str(redis_port), "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    ray = [str(Path(sys.executable).with_name("ray"))]
    env = {**os.environ, "RAY_TMPDIR": str(folder / "ray"), "RAY_REDIS_ADDRESS": f"127.0.0.1:{redis_port}"}
    head = ("--head", "--port", str(ray_port), "--num-cpus", "0", "--num-gpus", "0", "--include-dashboard", "false")
    servers: list[RunningServer] = []
    player: Any = None
    try:
        await asyncio.sleep(0.3)
        start_ray(ray, env, *head)
        for _ in range(2):
            port = free_port()
            args = ["--model", "procedural", "--directory", "ray", "--public-url", f"http://127.0.0.1:{port}"]
            servers.append(start_server(*args, port=port, timeout=120.0, env={"RAY_TMPDIR": env["RAY_TMPDIR"]}))
        a, b = servers
        player = WorldClient(a.ws)
        await player.connect()
        info = await player.start(seed=4, share_viewers=True)
        assert info.viewer_token
        seqs = [(await player.next_chunk(timeout=10)).seq]
        await _until(servers, "ok", 30)

        stop_ray(folder)  # the head, and the directory's actor with it
        await _until(servers, "lost", 60)
        seqs += [(await player.next_chunk(timeout=10)).seq for _ in range(3)]
        start_ray(ray, env, *head)  # back, with its state from Redis
        await _until(servers, "ok", 240)
        seqs += [(await player.next_chunk(timeout=10)).seq for _ in range(3)]

        async with WorldClient(b.ws) as viewer:  # a share link through the other door finds the world again
            joined = await viewer.join(info.session_id, info.viewer_token)
            assert (joined.session_id, viewer.url) == (info.session_id, a.ws)
            await viewer.next_chunk(timeout=10)
        seqs += [(await player.next_chunk(timeout=10)).seq for _ in range(2)]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # it played on, untouched, throughout
        assert "starts again as generation 1" in a.log() + b.log()
        await player.close()
    finally:
        for server in servers:
            server.stop()
        stop_ray(folder)
        redis.terminate()
        redis.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
