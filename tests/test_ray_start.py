"""``worldserve serve --executor ray`` without ``--ray-address``: where ``ray start`` ran, and where not.

docs/deploy.md's rule: serve joins the cluster ``RAY_ADDRESS`` names (tests/test_ray_executor.py),
else the one a ``ray start`` runs on this machine, else it starts a private local Ray. Here a
real ``ray start --head --block`` runs one node; the server must join it (not fail on Ray's
``_system_config`` refusal, not start a second Ray); once it is stopped, the server starts its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

from server_harness import free_port

# One xdist group for every Ray test: they share the machine's Ray address file and its cores.
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]

RAY = str(Path(sys.executable).with_name("ray"))


def _serve(*args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "worldserve", "serve", "--model", "procedural", "--port", str(free_port())]
    command += ["--executor", "ray", "--ray-num-cpus", "0.5", *args]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _serve_until_running() -> str:
    """Start ``serve --executor ray`` (no address), wait until it serves, stop it with SIGTERM; its output."""
    process = _serve()
    assert process.stdout is not None
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "Uvicorn running on" in line:
                break
    finally:
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    text = "".join(lines) + rest
    assert "Uvicorn running on" in text, text
    assert process.returncode == 0, text
    assert "Traceback" not in text
    return text


def _stop_ray_node(port: int) -> None:
    """Kill the processes of the Ray node whose GCS listens on ``port`` (not `ray stop`: that stops
    every Ray on the machine)."""
    import psutil  # Ray's own copy (importing ray puts its third-party packages on the path)

    marks = (f":{port}", f"port={port}", f"port {port}")
    doomed = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if "ray" in command and any(mark in command for mark in marks):
            doomed.append(process)
    for process in doomed:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(doomed, timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # gone means its GCS port refuses, not just its processes killed
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()  # the GCS listens on every address
        except OSError:
            return
        time.sleep(0.2)
    raise AssertionError(f"the Ray node on port {port} still answers after its processes were killed")


@pytest.fixture
def ray_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Ray's temp folder for this test alone (short: Ray's sockets live in it), so that neither the
    machine's own `ray start` nor another test's cluster is touched or seen: `ray start`, serve and
    the private Ray all read RAY_TMPDIR. serve must still join only what the address file names."""
    temp = tempfile.mkdtemp(prefix="wsray", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", temp)
    yield temp
    shutil.rmtree(temp, ignore_errors=True)


def test_serve_joins_a_ray_start_of_this_machine_else_starts_its_own(ray_tmpdir: str) -> None:
    from ray._common.utils import get_ray_address_file

    temp = ray_tmpdir
    address_file = Path(get_ray_address_file(None))
    assert address_file == Path(temp, "ray", "ray_current_cluster")
    port = free_port()
    started = subprocess.run(
        [RAY, "start", "--head", "--port", str(port), "--num-cpus", "1", "--num-gpus", "0",
         "--include-dashboard", "false", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        text = _serve_until_running()
        assert f"joined the Ray cluster at {address_file.read_text().strip()}" in text, text
        assert "the cluster of this machine's last `ray start`" in text
        assert str(port) in address_file.read_text()
        assert "Started a local Ray instance" not in text
        assert "_system_config must not be provided" not in text
    finally:
        _stop_ray_node(port)  # as the machine going down would: its address file stays
    # The address file of a `ray start` that is gone: joining fails, loudly, naming the file.
    process = _serve("--ray-connect-timeout-s", "2")
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 2, out
    assert f"no Ray cluster answered at {address_file.read_text().strip()} (the cluster of this machine's" in out
    assert str(address_file) in out
    address_file.unlink()  # what `ray stop` does
    text = _serve_until_running()  # no cluster any more: a private one
    assert "Started a local Ray instance" in text
    assert "joined the Ray cluster" not in text
