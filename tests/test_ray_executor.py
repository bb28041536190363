"""The Ray executor on a real Ray cluster of this machine (Ray's ``cluster_utils.Cluster``, loopback).

One cluster for the module (Ray takes seconds to start): a head with no CPUs for work and
worker nodes each offering one ``worldserve`` slot, which every worker actor reserves, so
each node holds one worker. Nodes are removed without grace (their raylet and actors are
killed, as when a machine vanishes) and added back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from runtime_models import Truth  # noqa: E402
from server_harness import (  # noqa: E402
    check_a_playing_world_is_never_evicted,
    check_frames_and_events,
    free_port,
    start_server,
)
from worldserve import Session, SessionEvent, SessionStatus  # noqa: E402
from worldserve.media import EncodedFrames, FrameEncoding, encode_frames  # noqa: E402
from worldserve.models.base import SessionOptions  # noqa: E402
from worldserve.runtime import (  # noqa: E402
    AdmissionRefusedError,
    Chunk,
    Runtime,
    RuntimeConfig,
    TickFailedError,
    WorkerDiedError,
)
from worldserve.runtime.executor.ray_actor import LOCAL_SYSTEM_CONFIG, RayExecutor  # noqa: E402
from worldserve.runtime.messages import ResidencyLimits, WorkerConfig  # noqa: E402

# One xdist group for every Ray test: they share the machine's Ray address file and its cores.
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("ray")]

FAULTY = "runtime_models:FaultyModel"
SLOT = {"worldserve": 1.0}
#: Every worker in these tests: no CPU of its own (the machine has 2), one slot.
RAY = {"executor": "ray", "ray_num_cpus": 0.0, "ray_resources": SLOT}


class Nodes:
    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.workers: list[Any] = []

    def add(self) -> Any:
        node = self.cluster.add_node(num_cpus=1, resources=dict(SLOT))
        self.workers.append(node)
        return node

    def by_id(self, node_id: str | None) -> Any:
        return next(node for node in self.workers if node.node_id == node_id)

    def remove(self, node: Any) -> None:
        self.cluster.remove_node(node, allow_graceful=False)  # SIGKILL: the machine vanishes
        self.workers.remove(node)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    root = Path(__file__).resolve().parent
    saved = os.environ.get("PYTHONPATH")
    # Ray's worker processes import worldserve and the tests' models by name.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root.parent / "src"), str(root), saved or ""])
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,  # nothing here reads it: ~4 s less per cluster on a busy box, and no poller
            "_system_config": dict(LOCAL_SYSTEM_CONFIG),
        },
    )
    result = Nodes(cluster)
    try:
        result.add()
        result.add()
        ray.init(address=cluster.address, log_to_driver=False)
        yield result
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait (a generous bound, not a timing claim) until ``condition()`` holds."""
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    assert condition()


async def play(session: Session[Chunk], stop: asyncio.Event, seen: list[int]) -> BaseException | None:
    """Tick until ``stop`` or a failure; record chunk indexes; return the failure."""
    while not stop.is_set():
        try:
            chunk = await session.next_chunk()
        except TickFailedError as error:
            return error
        seen.append(chunk.metadata.chunk_index)
    return None


async def test_calls_to_a_worker_run_in_order_and_keep_their_codes(nodes: Nodes) -> None:
    config = WorkerConfig("procedural", limits=ResidencyLimits(max_sessions=60))
    executor = RayExecutor(config, num_cpus=0, resources=SLOT)
    await executor.start()
    try:
        assert executor.spec.name == "procedural"
        calls = []
        for index in range(50):  # none awaited before the next is sent
            calls.append(executor.call(0, "admit", (f"s{index}", SessionOptions(seed=index), ())))
            calls.append(executor.call(0, "resident_sessions"))
        results = await asyncio.gather(*calls)
        for index in range(50):
            assert results[2 * index + 1] == tuple(f"s{i}" for i in range(index + 1))
        limited = [f"s{i}" for i in range(50)] + [f"t{i}" for i in range(10)]
        await asyncio.gather(*(executor.call(0, "admit", (sid, SessionOptions(), ())) for sid in limited[50:]))
        with pytest.raises(AdmissionRefusedError) as refused:  # a runner's coded error crosses as itself
            await executor.call(0, "admit", ("one-more", SessionOptions(), tuple(limited)))
        assert refused.value.code == "admission_refused"
        assert await executor.call(0, "no_such_method") == {
            "supported": False,
            "error": "worker 0 has no RPC method 'no_such_method'.",
        }
    finally:
        await executor.shutdown()
    with pytest.raises(TickFailedError) as closed:
        await executor.call(0, "resident_sessions")
    assert closed.value.code == "runtime_closed"


async def test_ray_workers_hand_back_the_bytes_the_server_would_have_made(nodes: Nodes) -> None:
    # Before the tests that remove nodes: a removed node that Ray has not yet declared dead
    # may be given a starting actor, which then fails the runtime's start.
    jpeg = FrameEncoding("jpeg", 75)
    async with Runtime("procedural", workers=1, **RAY) as rt:
        assert rt.config.encodes_in_worker  # auto: frames cross machines, so the worker encodes
        encoded = await rt.create_session(seed=1, encoding=jpeg)
        plain = await rt.create_session(seed=2)
        truths = [Truth(1), Truth(2)]
        for _ in range(2):
            first, second = await asyncio.gather(encoded.next_chunk(), plain.next_chunk())
            made = [truth.next(None, ()) for truth in truths]
            assert isinstance(first.frames, EncodedFrames)
            assert list(first.frames.payloads) == encode_frames(made[0], "jpeg", 75)
            assert np.array_equal(second.array(), made[1])


async def test_an_actor_encodes_the_extra_media_a_session_is_given(nodes: Nodes) -> None:
    """``set_extra_encodings`` reaches a Ray actor like ``request_keyframe``: the session's next
    chunk comes back in both media (the H.264 stream and, as its alternate, JPEG), then in H.264 alone."""
    async with Runtime("procedural", workers=1, **RAY) as rt:
        session = await rt.create_session(seed=3, encoding=FrameEncoding.for_media("h264"))
        await session.next_chunk()
        assert rt.set_extra_encodings(session.session_id, (FrameEncoding("jpeg", 75),))
        chunk = await session.next_chunk()
        assert isinstance(chunk.frames, EncodedFrames)
        (alternate,) = chunk.frames.alternates
        truth = Truth(3)
        truth.next(None, ())
        assert list(alternate.payloads) == encode_frames(truth.next(None, ()), "jpeg", 75)
        assert rt.set_extra_encodings(session.session_id, ())
        chunk = await session.next_chunk()
        assert isinstance(chunk.frames, EncodedFrames)
        assert chunk.frames.alternates == ()


async def test_a_killed_actor_fails_only_its_sessions_and_is_replaced(nodes: Nodes) -> None:
    async with Runtime("procedural", workers=2, **RAY) as rt:
        executor = rt.engine.executor
        assert isinstance(executor, RayExecutor)
        assert executor.node_of(0) != executor.node_of(1)  # spread: one worker per node
        a = await rt.create_session(seed=1)
        b = await rt.create_session(seed=2)
        assert [rt.engine.worker_of(s.session_id) for s in (a, b)] == [0, 1]
        for session in (a, b):
            assert (await session.next_chunk()).metadata.chunk_index == 0
        victim = executor.pid(0)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        died = await play(a, asyncio.Event(), [])  # ticks until the death is noticed (a call or a ping fails)
        assert isinstance(died, WorkerDiedError)
        assert died.code == "worker_died"
        assert a.status is SessionStatus.FAILED
        assert (await b.next_chunk()).metadata.chunk_index == 1  # the other worker's session goes on
        await rt.engine.wait_workers_ready(timeout=60)
        assert executor.is_alive(0)
        assert executor.pid(0) != victim
        await a.reset()
        chunk = await a.next_chunk()
        assert chunk.metadata.chunk_index == 0
        assert np.array_equal(chunk.frames, Truth(1).next(None, ()))
        stats = rt.stats().engine
        assert (stats.worker_deaths, stats.worker_restarts) == (1, 1)


async def test_node_loss_fails_only_its_sessions_then_capacity_moves_and_returns(nodes: Nodes) -> None:
    options = {"model_options": {"slow_s": 1.0}, "max_sessions_per_worker": 4}
    async with Runtime(FAULTY, workers=2, **RAY, **options) as rt:
        executor = rt.engine.executor
        assert isinstance(executor, RayExecutor)
        sessions = [await rt.create_session(seed=seed) for seed in range(1, 5)]
        assert [rt.engine.worker_of(s.session_id) for s in sessions] == [0, 1, 0, 1]
        doomed_node = executor.node_of(1)
        assert doomed_node is not None
        assert doomed_node != executor.node_of(0)
        stop = asyncio.Event()
        seen: list[list[int]] = [[] for _ in sessions]
        players = [asyncio.ensure_future(play(s, stop, seen[i])) for i, s in enumerate(sessions)]
        await until(lambda: min(len(indexes) for indexes in seen) >= 3)  # both nodes tick

        nodes.remove(nodes.by_id(doomed_node))
        lost = await asyncio.wait_for(asyncio.gather(players[1], players[3]), 20.0)
        for error in lost:
            assert isinstance(error, WorkerDiedError), error
            assert error.code == "worker_died"
        for index in (0, 2):
            assert not players[index].done()  # the live node's sessions never noticed
        before = [len(seen[0]), len(seen[2])]
        await until(lambda: len(seen[0]) >= before[0] + 2 and len(seen[2]) >= before[1] + 2)
        stop.set()
        assert await asyncio.gather(players[0], players[2]) == [None, None]
        for index in (0, 2):
            assert seen[index] == list(range(len(seen[index])))  # contiguous, none repeated or skipped
        assert not executor.is_alive(1)  # no node has room: the replacement waits

        for index in (1, 3):  # reset moves a failed session to the live node; it plays from chunk 0
            await sessions[index].reset()
            assert rt.engine.worker_of(sessions[index].session_id) == 0
        lost_chunks = await asyncio.gather(sessions[1].next_chunk(), sessions[3].next_chunk())
        assert [chunk.metadata.chunk_index for chunk in lost_chunks] == [0, 0]
        assert np.array_equal(lost_chunks[0].frames, Truth(2).next(None, ()))

        # Worker 0 is full of sessions whose ticks are queued or running; worker 1 has no node: refused at once.
        await sessions[0].accept_event(SessionEvent(1, prompt="slow"))  # its next step sleeps 1 s
        busy = [asyncio.ensure_future(s.next_chunk()) for s in sessions]
        await asyncio.sleep(0.3)
        with pytest.raises(AdmissionRefusedError) as refused:
            await asyncio.wait_for(rt.create_session(seed=20), 0.9)
        assert refused.value.code == "admission_refused"
        await asyncio.gather(*busy)

        added = nodes.add()  # capacity returns by itself: the waiting replacement lands there
        await rt.engine.wait_workers_ready(timeout=60)
        assert executor.is_alive(1)
        assert executor.node_of(1) == added.node_id
        fresh = await rt.create_session(seed=21)
        assert rt.engine.worker_of(fresh.session_id) == 1
        chunk = await fresh.next_chunk()
        assert chunk.worker == 1
        assert np.array_equal(chunk.frames, Truth(21).next(None, ()))
        assert rt.stats().engine.tick_failures["worker_died"] == 2

        # An idle worker's node vanishes: the executor's pings notice it without any tick.
        deaths = rt.stats().engine.worker_deaths
        nodes.remove(added)
        await until(lambda: rt.stats().engine.worker_deaths == deaths + 1)
        assert rt.engine.worker_of(fresh.session_id) is None  # its state is gone with the node
        with pytest.raises(WorkerDiedError):
            await fresh.next_chunk()
        nodes.add()  # room again for the next test
        await rt.engine.wait_workers_ready(timeout=60)


def _freeze(node: Any) -> list[Any]:
    """SIGSTOP every process of a cluster_utils node (its raylet and what it started: the actors):
    the machine goes silent -- frozen or partitioned -- without closing a single socket."""
    import psutil  # Ray's own copy (importing ray puts its third-party packages on the path)

    processes = []
    for infos in node.all_processes.values():
        for info in infos:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(info.process.pid)
                processes += [root, *root.children(recursive=True)]
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGSTOP)
    return processes


async def test_a_silent_node_fails_its_sessions_within_5_s_and_its_worker_lands_on_a_live_node(nodes: Nodes) -> None:
    nodes.add()  # room for the replacement
    async with Runtime("procedural", workers=2, **RAY) as rt:
        executor = rt.engine.executor
        assert isinstance(executor, RayExecutor)
        sessions = [await rt.create_session(seed=seed) for seed in (1, 2)]
        assert [rt.engine.worker_of(s.session_id) for s in sessions] == [0, 1]
        silent = nodes.by_id(executor.node_of(1))
        stop = asyncio.Event()
        seen: list[list[int]] = [[], []]
        players = [asyncio.ensure_future(play(s, stop, seen[i])) for i, s in enumerate(sessions)]
        await until(lambda: min(len(indexes) for indexes in seen) >= 2)
        loop = asyncio.get_running_loop()
        frozen = _freeze(silent)
        try:
            froze_at = loop.time()
            died = await asyncio.wait_for(players[1], 30.0)
            noticed_after = loop.time() - froze_at
            assert isinstance(died, WorkerDiedError), died
            assert noticed_after < 5.0, noticed_after  # the pings' bound (1 s apart, 3 s to answer)
            assert not players[0].done()  # the live node's session never noticed
            await rt.engine.wait_workers_ready(timeout=60)
            assert executor.is_alive(1)
            placed = executor.node_of(1)  # never on the silent node: on the spare, or the one the spread left free
            assert placed != silent.node_id
            assert placed in {node.node_id for node in nodes.workers}
            await sessions[1].reset()
            chunk = await sessions[1].next_chunk()
            assert chunk.metadata.chunk_index == 0
            assert np.array_equal(chunk.frames, Truth(2).next(None, ()))
            stop.set()
            assert await players[0] is None
            assert seen[0] == list(range(len(seen[0])))
        finally:
            for process in frozen:
                with contextlib.suppress(Exception):
                    process.kill()
            nodes.remove(silent)


async def test_server_with_ray_executor_loses_and_duplicates_no_event(nodes: Nodes) -> None:
    address = nodes.cluster.address
    config = RuntimeConfig(**RAY, ray_address=address)
    assert config.executor == "ray"
    resource = ",".join(f"{k}={v}" for k, v in SLOT.items())
    server = start_server(
        "--model", "procedural", "--workers", "2", "--executor", "ray", "--ray-address", address,
        "--ray-num-cpus", "0", "--ray-resource", resource, "--encode-frames", "worker", timeout=90.0,
    )  # fmt: skip
    await check_frames_and_events(server)  # JPEG and raw payloads made by the Ray workers


async def test_a_playing_world_is_never_evicted_on_ray_either(nodes: Nodes) -> None:
    resource = ",".join(f"{k}={v}" for k, v in SLOT.items())
    server = start_server(
        "--model", "procedural", "--workers", "1", "--max-sessions-per-worker", "1", "--executor", "ray",
        "--ray-address", nodes.cluster.address, "--ray-num-cpus", "0", "--ray-resource", resource, timeout=90.0,
    )  # fmt: skip
    try:
        await check_a_playing_world_is_never_evicted(server.ws)
    finally:
        server.stop()
    assert "Traceback" not in server.log()


async def test_an_address_other_than_the_cluster_this_process_is_connected_to_is_refused(nodes: Nodes) -> None:
    """Ray connects a process to one cluster: an explicit ray_address naming another one would start
    the workers on the connected cluster without a word; it is refused, naming both. The connected
    cluster's own address (written as localhost here) is that cluster: the workers start."""
    from worldserve.runtime.errors import WorkerStartError

    joined = ray.get_runtime_context().gcs_address
    other = f"127.0.0.1:{free_port()}"
    with pytest.raises(WorkerStartError) as refused:
        async with Runtime("procedural", workers=1, ray_address=other, **RAY):
            pass
    assert str(refused.value) == (
        f"ray_address={other} names another Ray cluster than the one this process is already connected to "
        f"({joined}), and Ray connects a process to one cluster only: call ray.shutdown() before starting "
        f"the runtime to join {other}, or pass ray_address=None to use {joined}."
    )
    assert ray.get_runtime_context().gcs_address == joined  # still connected, nothing joined
    same = f"localhost:{joined.rpartition(':')[2]}"
    async with Runtime("procedural", workers=1, ray_address=same, **RAY) as rt:
        session = await rt.create_session(seed=1)
        assert np.array_equal((await session.next_chunk()).array(), Truth(1).next(None, ()))


def test_ray_flags_and_no_ray_import_unless_named() -> None:
    parser = argparse.ArgumentParser()
    RuntimeConfig.add_cli_arguments(parser)
    flags = ["--executor", "ray", "--ray-address", "head:6379", "--ray-num-gpus", "1", "--ray-resource", "worldserve=2"]
    config = RuntimeConfig.from_cli_arguments(parser.parse_args(flags))
    assert (config.executor, config.ray_address, config.ray_num_cpus, config.ray_num_gpus) == ("ray", "head:6379", 1, 1)
    assert dict(config.ray_resources) == {"worldserve": 2.0}
    with pytest.raises(SystemExit):  # the parser refuses it: one line, exit status 2 (tests/test_cli.py)
        parser.parse_args(["--ray-resource", "worldserve"])
    assert (config.ray_ping_interval_s, config.ray_ping_timeout_s) == (1.0, 3.0)
    pings = parser.parse_args(["--executor", "ray", "--ray-ping-interval-s", "0.5", "--ray-ping-timeout-s", "2"])
    executor = Runtime(config=RuntimeConfig.from_cli_arguments(pings)).engine.executor
    assert isinstance(executor, RayExecutor)
    assert (executor._ping_interval_s, executor._ping_timeout_s) == (0.5, 2.0)
    with pytest.raises(ValueError, match="ray_ping_timeout_s"):
        RuntimeConfig(ray_ping_timeout_s=0)
    code = (
        "import sys, worldserve, worldserve.server.app, worldserve.runtime, worldserve.tools.cli;"
        "from worldserve.runtime import Runtime; Runtime('procedural', executor='multiprocess');"
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


async def test_a_worker_lost_before_it_was_ready_is_placed_again_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray may place a starting actor on a node that is dying but not yet declared dead: the
    actor dies before it is ready. That worker is placed again (as a replacement would be)
    instead of failing the whole start; only the start timeout ends the retries. ``_launch``
    is faked here (a real dying node cannot be timed); the node-loss tests above run it for real."""
    from worldserve.runtime.errors import WorkerStartError
    from worldserve.runtime.executor.ray_actor import _PlacementLost

    executor = RayExecutor(WorkerConfig("procedural"), 2, retry_s=0.01)
    tries: list[tuple[int, float | None]] = []

    async def launch_losing_the_first_of_worker_1(index: int, timeout: float | None) -> None:
        tries.append((index, timeout))
        if index == 1 and sum(1 for i, _ in tries if i == 1) == 1:
            raise _PlacementLost("it was lost before it was ready (ActorDiedError)")

    monkeypatch.setattr(executor, "_launch", launch_losing_the_first_of_worker_1)
    await asyncio.gather(executor._place(0, 5.0), executor._place(1, 5.0))
    assert [index for index, _ in tries].count(1) == 2
    assert [index for index, _ in tries].count(0) == 1
    assert all(timeout is not None and 0 < timeout <= 5.0 for _, timeout in tries)

    async def always_lost(index: int, timeout: float | None) -> None:
        raise _PlacementLost("it was lost before it was ready (ActorDiedError)")

    monkeypatch.setattr(executor, "_launch", always_lost)
    with pytest.raises(WorkerStartError, match="until its start timed out"):
        await executor._place(0, 0.05)


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``worldserve serve --model procedural`` with ``args``, its output in a pipe."""
    port = str(free_port())
    command = [sys.executable, "-m", "worldserve", "serve", "--model", "procedural", "--port", port, *args]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )


def _output_until(process: subprocess.Popen[str], marker: str) -> list[str]:
    """Read the process's output lines until one contains ``marker`` (or it ends)."""
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            break
    return lines


def test_a_cluster_nothing_answers_at_exits_within_the_connect_timeout_naming_the_address() -> None:
    process = _serve("--executor", "ray", "--ray-address", "127.0.0.1:9", "--ray-connect-timeout-s", "2")
    out, _ = process.communicate(timeout=90)  # would retry for minutes (ignoring SIGTERM) before
    assert process.returncode == 2
    lines = [line for line in out.splitlines() if line.startswith("worldserve")]
    assert lines == [
        "worldserve serve: error: cannot start the runtime: no Ray cluster answered at 127.0.0.1:9 within 2 s "
        "(--ray-connect-timeout-s); is the head running, and is the address right?"
    ]
    assert "Traceback" not in out


def test_workers_the_cluster_cannot_place_say_what_they_ask_and_stop_on_sigterm(nodes: Nodes) -> None:
    # The cluster has no GPU: a worker asking for one waits (saying so), until the start timeout.
    address = ("--ray-address", nodes.cluster.address)
    process = _serve("--executor", "ray", *address, "--ray-num-gpus", "1", "--worker-start-timeout-s", "4")
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 2
    ending = [line for line in out.splitlines() if line.startswith("worldserve serve: error:")]
    assert len(ending) == 1
    assert "worker 0 was not placed and ready within 4 s (--worker-start-timeout-s)" in ending[0]
    assert "it asks for 1 CPU, 1 GPU; the cluster has" in ending[0]
    assert " 0 GPU in all" in ending[0]
    assert "Traceback" not in out

    # SIGTERM while the start waits for placement: the process is gone within 5 s.
    process = _serve("--executor", "ray", *address, "--ray-num-gpus", "1")
    _output_until(process, "not placed and ready after")  # it says what it waits for
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=5)
    assert process.returncode == 1
    assert "worldserve: stopped by SIGTERM while starting." in out


def test_serve_joins_the_cluster_ray_address_names(nodes: Nodes) -> None:
    """docs/deploy.md: without --ray-address, serve joins the cluster RAY_ADDRESS names (and
    tests/test_ray_start.py: else the one a `ray start` runs on this machine)."""
    resource = ",".join(f"{k}={v}" for k, v in SLOT.items())
    process = _serve(
        "--executor", "ray", "--ray-num-cpus", "0", "--ray-resource", resource,
        env={"RAY_ADDRESS": nodes.cluster.address},
    )  # fmt: skip
    try:
        lines = _output_until(process, "Uvicorn running on")
    finally:
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    text = "".join(lines) + rest
    assert "Uvicorn running on" in text, text
    assert f"joined the Ray cluster at {nodes.cluster.address}" in text
    assert "Started a local Ray instance" not in text
    assert process.returncode == 0  # a stop asked for is a clean exit
