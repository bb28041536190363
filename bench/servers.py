"""A real ``worldserve serve`` on a free port for a benchmark, and its stop (shared by the benches).

Owns: :class:`BenchServer` (the process, its port and its log file), :func:`start_server`
(``serve`` with the arguments given, bench/ on its ``PYTHONPATH`` so models such as
``timed_model:TimedModel`` load; returns once ``/healthz`` answers), :func:`free_port` and
:func:`stop_process` (SIGTERM, then SIGKILL after 20 s) for a bench that starts its own. Must not know: what a
bench measures.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BenchServer", "free_port", "start_server", "stop_process"]


@dataclass
class BenchServer:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/world"

    def stop(self) -> None:
        """Stop it and remove its log."""
        stop_process(self.process)
        self.log.unlink(missing_ok=True)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 20 s."""
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(args: list[str], label: str, timeout: float = 180.0) -> BenchServer:
    """``worldserve serve ARGS`` on a free port (its log in a temporary file named by ``label``)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"{label}-", suffix=".log")[1])
    command = [sys.executable, "-m", "worldserve", "serve", "--port", str(port), "--log-level", "warning", *args]
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]))
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": path}
        )
    server = BenchServer(process, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return server
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")
