"""The engine on the in-process executor: batching, deadlines, RPC shapes, errors (fast, no processes)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from runtime_models import Gate, Truth, keys, until
from worldserve import SessionError, SessionEvent, SessionStatus, WorkerLifecycle
from worldserve.models import SessionOptions
from worldserve.protocol import TickRequest
from worldserve.runtime import (
    AdmissionRefusedError,
    DeadlineExceededError,
    Engine,
    EngineConfig,
    InprocExecutor,
    Runtime,
    RuntimeConfig,
    UnknownSessionError,
    WorkerConfig,
)
from worldserve.runtime.config import parse_bytes
from worldserve.runtime.metrics import Capacity
from worldserve.runtime.scheduler import BatchQueue

pytestmark = pytest.mark.timeout(120)


def runtime(*, slow_s: float = 0.5, gate: str | None = None, **options: object) -> Runtime:
    """An in-process runtime (the FaultyModel unless ``model=`` says otherwise)."""
    if "model" not in options:
        options.update(model="runtime_models:FaultyModel", model_options={"slow_s": slow_s, "gate": gate})
    return Runtime(executor="inprocess", **options)


def test_batch_queue_rule() -> None:
    queue: BatchQueue[str] = BatchQueue(batch_limit=3, batch_wait_s=0.5)
    assert queue.due_at(resident=4) is None
    queue.push("a", now=10.0)
    assert queue.due_at(resident=4) == 10.5  # waits for company at most batch_wait_s
    assert queue.due_at(resident=1) == float("-inf")  # alone on its worker: no wait
    queue.push("b", now=10.2)
    assert queue.due_at(resident=2) == float("-inf")  # everyone is here
    queue.push("c", now=10.3)
    queue.push("d", now=10.4)
    assert queue.due_at(resident=9) == float("-inf")  # a full batch
    assert [entry.item for entry in queue.take()] == ["a", "b", "c"]
    assert queue.due_at(resident=9) == 10.9


async def test_ready_ticks_of_different_sessions_run_as_one_step() -> None:
    async with runtime(model="procedural", batch_wait_s=10.0) as rt:
        sessions = [await rt.create_session(seed=seed) for seed in range(4)]
        chunks = await asyncio.gather(*(session.next_chunk() for session in sessions))
        assert [chunk.batch_size for chunk in chunks] == [4, 4, 4, 4]
        assert max(chunk.queued_s for chunk in chunks) < 10.0  # complete: no wait for more company
        for seed, chunk in enumerate(chunks):
            assert np.array_equal(chunk.frames, Truth(seed).next(None, ()))
        stats = rt.stats().engine
        assert (stats.batches, stats.chunks, stats.mean_batch_size) == (1, 4, 4.0)


async def test_ticks_arriving_during_a_step_go_together_when_it_ends(tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    async with runtime(gate=str(gate.path), batch_wait_s=0.0) as rt:
        held = await rt.create_session(prompt="gate")
        others = [await rt.create_session(seed=seed) for seed in range(3)]
        first = asyncio.ensure_future(held.next_chunk())
        await gate.wait_entered()  # the held step is running
        later = asyncio.gather(*(session.next_chunk() for session in others))
        await until(lambda: rt.stats().engine.queued_ticks == 3, "the three ticks queued behind the step")
        loop = asyncio.get_running_loop()
        queued_by = loop.time()
        await asyncio.sleep(0.05)  # hold the step a little longer: the ticks wait at least this
        held_until = loop.time()
        gate.open()
        chunks = await later
        assert (await first).batch_size == 1
        assert [chunk.batch_size for chunk in chunks] == [3, 3, 3]
        assert min(chunk.queued_s for chunk in chunks) >= held_until - queued_by  # they waited for the step


async def test_a_lone_tick_waits_at_most_batch_wait_for_company() -> None:
    async with runtime(model="procedural", batch_wait_s=1.0) as rt:
        alone = await rt.create_session()
        assert (await alone.next_chunk()).queued_s < 1.0  # the only session on its worker: no wait
        await rt.create_session()  # idle company that never ticks
        chunk = await alone.next_chunk()
        # It waits for company until batch_wait_s, then goes alone (not until the company ticks).
        assert 0.99 <= chunk.queued_s < 10.0
        assert chunk.batch_size == 1


async def test_deadline_fails_the_session_closed_without_waiting_for_the_step(tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    async with runtime(gate=str(gate.path), tick_deadline_s=0.5) as rt:
        session = await rt.create_session(seed=5)
        await session.accept_event(SessionEvent(1, prompt="gate desert"))
        with pytest.raises(DeadlineExceededError, match=r"missed its 0\.5 s deadline") as caught:
            await session.next_chunk()
        assert gate.entered
        assert not gate.left  # failed while the step is still held: the caller did not wait for it
        assert caught.value.code == "deadline_exceeded"
        assert session.status is SessionStatus.FAILED
        assert rt.engine.worker_of(session.session_id) is None  # released on failure
        # Its only worker is stalled in the held step: a reset is refused at once, not queued behind it.
        with pytest.raises(AdmissionRefusedError, match="stalled in a step"):
            await session.reset()
        assert session.failure_code == "admission_refused"
        assert not gate.left
        gate.open()
        await until(lambda: rt.engine.stats().queued_ticks == 0 and gate.left, "the held step to end")
        while True:  # the step's result reaches the engine: the worker is no longer stalled
            try:
                await session.reset()  # then a fresh state
                break
            except AdmissionRefusedError:
                await asyncio.sleep(0.01)
        chunk = await session.next_chunk()
        assert chunk.metadata.chunk_index == 0
        assert np.array_equal(chunk.frames, Truth(5).next(None, ()))
        assert rt.stats().engine.deadline_exceeded == 1


async def test_collective_rpc_shapes_work_with_worker_lifecycle() -> None:
    async with runtime(model="procedural", workers=2) as rt:
        engine = rt.engine
        a = await rt.create_session(session_id="a")
        await rt.create_session(session_id="b")
        assert await engine.collective_rpc("resident_sessions") == [[("a",), ("b",)]]
        assert await engine.collective_rpc("close_ar_diffusion_session", args=("nobody",)) == [True]
        assert await engine.collective_rpc("reset_ar_diffusion_session", kwargs={"session_id": "a"}) == [True]
        assert await engine.collective_rpc("nope") == [
            [{"supported": False, "error": f"worker {index} has no RPC method 'nope'."} for index in (0, 1)]
        ]
        assert await engine.collective_rpc("step", args=([],)) == [
            {"supported": False, "error": "step is the engine's own call; use the engine's API."}
        ]
        unsupported = await engine.collective_rpc("resident_sessions", stage_ids=[0, 3])
        assert unsupported[1] == {"supported": False, "error": "this engine runs one stage (0), not stage 3."}
        lifecycle = WorkerLifecycle(engine, stage_ids=[0])
        await lifecycle.close_session("a")
        assert await engine.collective_rpc("resident_sessions") == [[(), ("b",)]]
        await lifecycle.reset_session("a")  # re-admitted from its options
        assert engine.worker_of("a") is not None
        assert (await a.next_chunk()).metadata.chunk_index == 0
        with pytest.raises(SessionError, match="not stage 1"):
            await WorkerLifecycle(engine, stage_ids=[0, 1]).close_session("a")
        with pytest.raises(SessionError, match="was released") as released:  # stage 0 did close it
            await a.next_chunk()
        assert released.value.code == "not_resident"


async def test_unknown_sessions_and_closed_engines_answer_with_codes() -> None:
    executor = InprocExecutor(WorkerConfig("procedural"))
    engine = Engine(executor, EngineConfig())
    tick = TickRequest("ghost", "r", 0)
    with pytest.raises(SessionError, match="engine is new") as closed:
        await engine.execute_tick(tick)
    assert closed.value.code == "runtime_closed"
    await engine.start()
    try:
        with pytest.raises(UnknownSessionError, match="was not admitted") as unknown:
            await engine.execute_tick(tick)
        assert unknown.value.code == "unknown_session"
        await engine.add_session("s", SessionOptions())
        with pytest.raises(SessionError, match="already admitted"):
            await engine.add_session("s", SessionOptions())
        with pytest.raises(ValueError, match="48x48 RGB"):
            await engine.add_session("t", SessionOptions(image=b"123"))
    finally:
        await engine.shutdown()
    assert engine.stats().tick_failures == {"unknown_session": 1}


async def test_events_reach_their_chunk_in_process() -> None:
    async with runtime(model="procedural") as rt:
        session = await rt.create_session(prompt="snowy", seed=2)
        truth = Truth(2, "snowy")
        await session.accept_event(SessionEvent(1, controls=(keys("D"),)))
        chunk = await session.next_chunk()
        assert chunk.metadata.applied_event_ids == (1,)
        assert np.array_equal(chunk.frames, truth.next(None, [keys("D")]))
        assert not chunk.frames.flags.writeable


def test_runtime_config_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    RuntimeConfig.add_cli_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            "procedural",
            "--model-option",
            "height=64",
            "--model-option",
            "label=plain text",
            "--workers",
            "3",
            "--memory-budget",
            "2MiB",
            "--tick-deadline-s",
            "0",
            "--batch-wait-ms",
            "5",
            "--threads-per-worker",
            "2",
        ]
    )
    config = RuntimeConfig.from_cli_arguments(args)
    assert dict(config.model_options) == {"height": 64, "label": "plain text"}
    assert (config.workers, config.memory_budget_bytes, config.tick_deadline_s) == (3, 2 * 2**20, None)
    assert config.batch_wait_s == 0.005
    assert config.worker_config().limits.capacity(1024) == 2048
    assert config.worker_config().cpu_threads == 2
    with pytest.raises(ValueError, match="executor must be one of"):
        RuntimeConfig(executor="threads")
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("lots")
    with pytest.raises(TypeError, match="unexpected keyword argument 'wokers'"):
        Runtime("procedural", wokers=2)


def test_default_threads_leave_a_core_to_the_server_and_say_why() -> None:
    from worldserve.runtime.config import default_threads_per_worker

    # 2 cores, 1 worker: 2 threads fought the server and a browser (1.2-4.8 s per tinyworld step on AVX2).
    assert default_threads_per_worker(1, cores=2) == (1, "2 cores, 1 left to the server, shared by 1 worker")
    assert default_threads_per_worker(1, cores=16)[0] == 15
    assert default_threads_per_worker(4, cores=16)[0] == 3
    assert default_threads_per_worker(2, cores=2) == (1, "2 cores, shared by 2 workers")
    assert default_threads_per_worker(1, cores=1)[0] == 1
    assert RuntimeConfig(threads_per_worker=3).worker_threads() == (3, "--threads-per-worker")
    assert RuntimeConfig(executor="inprocess").worker_config().cpu_threads is None
    threads, why = RuntimeConfig().worker_threads()
    assert RuntimeConfig().worker_config().cpu_threads == threads
    assert why.startswith(f"{len(os.sched_getaffinity(0))} cores")


@pytest.mark.parametrize("executor", ["inprocess", "multiprocess"])
async def test_a_model_that_cannot_load_fails_start_with_its_reason(executor: str) -> None:
    runtime = Runtime("no_such_module:Model", executor=executor)
    with pytest.raises(SessionError, match=r"could not load model 'no_such_module:Model'.*No module named") as caught:
        await runtime.start()
    assert caught.value.code == "worker_start_failed"
    await runtime.aclose()


async def test_capacity_counts_free_slots_on_ready_workers() -> None:
    async with Runtime("procedural", executor="inprocess", workers=2, max_sessions_per_worker=2) as rt:
        assert rt.capacity() == Capacity(free=4, workers_alive=2, slots=4, room=True)
        await rt.create_session(seed=1)
        assert rt.capacity() == Capacity(free=3, workers_alive=2, slots=4, room=True)
        rt.engine.executor.kill(1)  # worker 1 is down until its replacement is ready
        assert rt.capacity() == Capacity(free=1, workers_alive=1, slots=2, room=True)
        await rt.engine.wait_workers_ready(timeout=30)
        assert rt.capacity() == Capacity(free=3, workers_alive=2, slots=4, room=True)
        for seed in (2, 3, 4):
            session = await rt.create_session(seed=seed)
            rt.mark_in_use(session.session_id, 600.0)
        # Every slot held; the first session is not in use (it may be evicted): room, but no free slot.
        assert rt.capacity() == Capacity(free=0, workers_alive=2, slots=4, room=True)
        for session in rt.manager:
            rt.mark_in_use(session.session_id, 600.0)
        assert rt.capacity() == Capacity(free=0, workers_alive=2, slots=4, room=False)
    async with Runtime("procedural", executor="inprocess") as unlimited:
        assert unlimited.capacity() == Capacity(free=None, workers_alive=1, slots=None, room=True)
    assert unlimited.capacity() == Capacity(free=0, workers_alive=0)  # shut down


async def test_clocked_workers_without_real_time_headroom_take_no_more_sessions() -> None:
    """Admission weighs a clocked worker's measured step time against the chunk period."""
    async with runtime(slow_s=0.4, workers=2) as rt:  # a slow step (0.4 s) outgrows the 0.25 s period
        slow = await rt.create_session(prompt="slow", session_id="slow")
        fast = await rt.create_session(session_id="fast")
        assert (rt.engine.worker_of("slow"), rt.engine.worker_of("fast")) == (0, 1)
        for session in (slow, fast):
            rt.tick_due(session.session_id, None)  # paced on the clock from now on
            await session.next_chunk()
        # equal loads: worker 0 comes first, but its step would not hold real time
        await rt.create_session(session_id="third")
        assert rt.engine.worker_of("third") == 1
        # slow down worker 1 too: no worker has headroom, so the next session is refused
        await fast.accept_event(SessionEvent(1, prompt="slow"))
        await fast.next_chunk()
        with pytest.raises(SessionError, match="no real-time headroom") as refused:
            await rt.create_session(session_id="fourth")
        assert refused.value.code == "admission_refused"
        assert rt.stats().engine.admissions_refused == 1


async def test_a_full_clocked_worker_without_headroom_still_swaps_a_session_nobody_uses() -> None:
    """A newcomer that takes an evicted session's place adds no load: the clock's headroom does not
    refuse it, so a world nobody uses is evicted for it, as the eviction policy says. One session's
    step (0.15 s) fits 0.9 of the 0.25 s period; two sessions' is predicted at 0.3 s."""
    async with runtime(slow_s=0.15, max_sessions_per_worker=2) as rt:
        playing = await rt.create_session(prompt="slow", session_id="playing")
        rt.tick_due(playing.session_id, None)
        await playing.next_chunk()  # the clock runs, one session's step measured
        with pytest.raises(SessionError, match="no real-time headroom"):  # a free slot: it would add load
            await rt.create_session(session_id="more")
    async with runtime(slow_s=0.15, max_sessions_per_worker=1) as rt:
        playing = await rt.create_session(prompt="slow", session_id="playing")  # never marked in use
        rt.tick_due(playing.session_id, None)
        await playing.next_chunk()
        await rt.create_session(session_id="newcomer")  # full: it takes the idle one's place
        assert rt.engine.worker_of("newcomer") == 0
        assert rt.engine.worker_of("playing") is None
        assert rt.stats().engine.evictions == 1


async def test_a_session_held_back_does_not_stretch_its_workers_clock() -> None:
    """The period follows the step of the sessions that pace on the clock, not of every resident one."""
    async with runtime(slow_s=0.15) as rt:  # one session's step: 0.15 s of the 0.25 s period
        playing = await rt.create_session(prompt="slow")
        await rt.create_session()  # resident, but its client never asks for a chunk (held back)
        assert rt.stats().engine.chunk_periods == (None,)
        rt.tick_due(playing.session_id, None)
        await playing.next_chunk()
        # one size measured: two sessions' step is predicted at 0.3 s, which would stretch the period
        assert rt.stats().engine.chunk_periods == (pytest.approx(0.25),)
        rt.tick_due(playing.session_id, None)
        await playing.next_chunk()
        assert rt.stats().engine.chunk_periods == (pytest.approx(0.25),)


async def test_unclocked_workers_admit_by_counts_and_bytes_only() -> None:
    async with runtime(slow_s=0.4) as rt:
        slow = await rt.create_session(prompt="slow")
        await slow.next_chunk()  # a slow step, but nobody paces on the clock
        await rt.create_session()
        assert rt.stats().engine.admissions == 2
