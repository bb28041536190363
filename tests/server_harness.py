"""Start a real ``worldserve serve`` process on a free port, for tests; check what it sends against the
published schema (:func:`missing_fields`)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime_models import Truth
from worldserve.client import SessionFailedError, WorldClient, WorldError

#: JPEG at quality 80 (4:4:4 chroma) keeps the procedural world's 48x48 frames within ~3.5-4.5 of the
#: truth (mean abs error); another seed's world is 30+ away.
JPEG_MEAN_ERROR = 8.0


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    token: str | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, Any]:
        """Its ``/healthz`` answer (sessions, queue, directory, ...)."""
        with urllib.request.urlopen(self.http + "/healthz", timeout=10) as response:
            return dict(json.loads(response.read()))

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/world"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


TESTS = Path(__file__).resolve().parent

#: The run's folder for server logs (set by conftest.py to its temporary folder); None: the system's.
LOG_ROOT: Path | None = None


def log_dir() -> Path | None:
    """Where the running test's servers write their logs: ``LOG_ROOT/<test module>``."""
    if LOG_ROOT is None:
        return None
    current = os.environ.get("PYTEST_CURRENT_TEST", "unknown.py::")
    folder = LOG_ROOT / Path(current.split("::", 1)[0]).stem
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def start_server(
    *args: str,
    token: str | None = None,
    timeout: float = 180.0,
    test_models: bool = False,
    own_group: bool = False,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> RunningServer:
    """Run ``python -m worldserve serve`` with ``args``; return once /healthz answers.

    ``test_models``: the server can load ``runtime_models:...`` (tests/ on its PYTHONPATH).
    ``own_group``: the server leads a process group of its own (its workers join it), as a
    service manager or a terminal would start it, so that a test can signal the whole group.
    ``env``: variables added to the server's environment. ``port``: listen there (default: a free one).
    """
    port = port or free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="worldserve-", suffix=".log", dir=log_dir(), delete=False)  # noqa: SIM115
    command = [sys.executable, "-m", "worldserve", "serve", "--port", str(port), "--log-level", "warning", *args]
    if token is not None:
        command += ["--token", token]
    environment = {**os.environ, **(env or {})}
    if test_models:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), environment.get("PYTHONPATH")]))
    process = subprocess.Popen(
        command, stdout=log_file, stderr=subprocess.STDOUT, env=environment, start_new_session=own_group
    )
    server = RunningServer(process, port, Path(log_file.name), token)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.http}/healthz", timeout=1) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{server.log()}")


async def check_procedural_frames(url: str) -> None:
    """One client per media on a ``--model procedural`` server: its decoded frames are the world's
    (raw exactly, JPEG within its loss), so every payload was a valid image of the right chunk."""
    for media in ("jpeg", "raw"):
        async with WorldClient(url) as client:
            await client.start(seed=7, media=media, quality=80)
            truth = Truth(7)
            for _ in range(2):
                chunk = await client.next_chunk(timeout=30)
                made = truth.next(None, ())
                assert chunk.frames.shape == made.shape
                if media == "raw":
                    assert np.array_equal(chunk.frames, made)
                else:
                    assert np.abs(chunk.frames.astype(np.int16) - made).mean() < JPEG_MEAN_ERROR


async def check_frames_and_events(server: RunningServer) -> None:
    """A ``--model procedural`` server end to end, then stopped: valid frames of each media, and 4
    clients' events each applied exactly once or reported dropped (none lost, none twice, no errors)."""
    from worldserve.tools.loadtest import run_bench

    try:
        await check_procedural_frames(server.ws)
        result = await run_bench(server.ws, clients=4, duration=3.0, event_interval=0.1, settle=5.0)
        for report in result.reports:
            assert report.chunks > 0
            assert report.accepted > 0
            assert (report.lost, report.applied_twice, dict(report.errors)) == (0, 0, {})
            assert report.applied_once + report.dropped == report.accepted
    finally:
        server.stop()
    assert "Traceback" not in server.log()


async def play_until(client: WorldClient, stop: asyncio.Event, chunks: list[int]) -> BaseException | None:
    """Play (read and ack every chunk) until ``stop``; record chunk indexes; return what ended it early."""
    while not stop.is_set():
        try:
            chunk = await client.next_chunk(timeout=1.0)
        except TimeoutError:
            continue
        except Exception as error:  # the caller asserts on it
            return error
        chunks.append(chunk.chunk_index)
    return None


async def check_a_playing_world_is_never_evicted(url: str, newcomers: int = 8) -> None:
    """On a server with one session slot: a world someone plays keeps it; each newcomer is refused
    at once with ``admission_refused`` and a retry hint, and the player never notices."""
    async with WorldClient(url) as player:
        await player.start(seed=1)
        stop = asyncio.Event()
        chunks: list[int] = []
        playing = asyncio.ensure_future(play_until(player, stop, chunks))
        for attempt in range(newcomers):
            while len(chunks) <= attempt:  # a newcomer between each pair of the player's chunks
                assert not playing.done(), playing.result()
                await asyncio.sleep(0.02)
            async with WorldClient(url) as newcomer:
                with pytest.raises(WorldError) as refused:
                    await newcomer.start(seed=100 + attempt)
            assert refused.value.code == "admission_refused", refused.value
            assert refused.value.retry_after_ms is not None
            assert refused.value.retry_after_ms > 0
        seen = len(chunks)
        while len(chunks) < seen + 2:  # still playing after the last newcomer
            assert not playing.done(), playing.result()
            await asyncio.sleep(0.02)
        stop.set()
        assert await playing is None
        assert chunks == list(range(len(chunks)))  # none lost, none repeated: never evicted
        await player.close()


async def until_failed(client: WorldClient, chunks: int = 200) -> SessionFailedError:
    """Read (and ack) chunks until the session fails (``session.failed``); that failure."""
    for _ in range(chunks):
        try:
            await client.next_chunk(timeout=60)
        except SessionFailedError as failed:
            return failed
    raise AssertionError(f"the session did not fail within {chunks} chunks")


_PUBLISHED_SCHEMA = TESTS.parent / "docs" / "protocol.schema.json"


@functools.cache
def _published_server_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(_PUBLISHED_SCHEMA.read_text())["server_to_client"]
    return schema


def missing_fields(message: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """The always-present fields (the published schema's ``required``) that a server message lacks,
    nested objects included (as dotted paths); ``[]`` when it carries all of them."""
    if schema is None:
        schema = _published_server_schema()
    definitions = schema["$defs"]
    reference = schema["discriminator"]["mapping"].get(message.get("type"))
    if reference is None:
        return [f"type {message.get('type')!r} (not a server message type)"]
    return _missing(message, definitions[reference.rsplit("/", 1)[1]], definitions, "")


def _missing(value: dict[str, Any], model: dict[str, Any], definitions: dict[str, Any], path: str) -> list[str]:
    missing = [path + name for name in model.get("required", []) if name not in value]
    for name, field in model.get("properties", {}).items():
        inner = value.get(name)
        if not isinstance(inner, dict):
            continue
        for option in [field, *field.get("anyOf", [])]:
            if "$ref" in option:
                nested = definitions[option["$ref"].rsplit("/", 1)[1]]
                missing += _missing(inner, nested, definitions, f"{path}{name}.")
    return missing
