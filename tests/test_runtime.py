"""The runtime end to end: real spawned worker processes, the procedural world checked on its frames."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime_models import CAMERA, Gate, Truth, carried_by, chunk_controls, keys, until
from worldserve import ControlInput, Session, SessionEvent, SessionStatus
from worldserve.runtime import (
    AdmissionRefusedError,
    Chunk,
    DeadlineExceededError,
    Runtime,
    RuntimeConfig,
    SessionEvictedError,
    TickFailedError,
    WorkerDiedError,
)

pytestmark = pytest.mark.timeout(300)  # spawned workers: generous on a slow or busy CPU

FAULTY = "runtime_models:FaultyModel"


async def drive(
    session: Session[Chunk], worker: int, seed: int, start_prompt: str | None, chunks: int, rng: random.Random
) -> int:
    """Tick ``chunks`` chunks while another task sends events at random moments; check every frame.

    Returns how many events were applied (each in exactly one chunk).
    """
    events: dict[int, SessionEvent] = {}
    done = asyncio.Event()

    async def send() -> None:
        event_id = 0
        while not done.is_set():
            event_id += 1
            choice = rng.random()
            if choice < 0.4:
                held = rng.sample(["W", "A", "S", "D"], rng.randint(0, 2))
                event = SessionEvent(event_id, controls=(keys(*held),))
            elif choice < 0.8:
                pan = {"dx": rng.uniform(-3, 3), "dy": rng.uniform(-3, 3)}
                event = SessionEvent(event_id, controls=(ControlInput("camera", CAMERA, pan),))
            else:
                event = SessionEvent(event_id, prompt=rng.choice(["snowy peaks", "sahara", "deep woods", "islands"]))
            events[event_id] = event
            await session.accept_event(event)
            await asyncio.sleep(rng.uniform(0, 0.004))

    sender = asyncio.ensure_future(send())
    truth = Truth(seed, start_prompt)
    prompt: str | None = None
    controls: dict[str, ControlInput] = {}
    carried: dict[int, list[int]] = {}  # a superseding event -> those it superseded (their presses show with it)
    applied = 0
    for index in range(chunks):
        chunk = await session.next_chunk()
        assert chunk.metadata.chunk_index == index
        assert chunk.worker == worker  # affinity: always the worker holding the state
        for event_id in chunk.metadata.applied_event_ids:
            event = events[event_id]
            prompt = event.prompt if event.prompt is not None else prompt
        applied += len(chunk.metadata.applied_event_ids)
        for superseder, superseded in carried_by((d.event_ids, d.detail) for d in session.take_dropped()).items():
            carried.setdefault(superseder, []).extend(superseded)
        controls_by_id = {event_id: event.controls for event_id, event in events.items()}
        shown = chunk_controls(controls, chunk.metadata.applied_event_ids, controls_by_id, carried)
        expected = truth.next(prompt, shown)
        assert np.array_equal(chunk.frames, expected), f"chunk {index} of {session.session_id}"
        await asyncio.sleep(rng.uniform(0, 0.003))
    done.set()
    await sender
    return applied


async def test_concurrent_sessions_get_their_events_in_the_right_chunk_on_their_own_worker() -> None:
    async with Runtime("procedural", workers=2, batch_wait_s=0.001) as rt:
        rng = random.Random(7)
        specs = [(seed, rng.choice([None, "snowy", "desert"])) for seed in range(6)]
        sessions = [await rt.create_session(prompt=prompt, seed=seed) for seed, prompt in specs]
        placed = [rt.engine.worker_of(session.session_id) or 0 for session in sessions]
        assert placed == [0, 1, 0, 1, 0, 1]  # least loaded first
        applied = await asyncio.gather(
            *(
                drive(session, worker, seed, prompt, 12, random.Random(seed))
                for session, worker, (seed, prompt) in zip(sessions, placed, specs, strict=True)
            )
        )
        assert min(applied) > 0
        assert [rt.engine.worker_of(session.session_id) for session in sessions] == placed  # affinity
        stats = rt.stats()
        assert stats.engine.chunks == stats.sessions.chunks == 6 * 12
        assert stats.sessions.applied == sum(applied)
        assert stats.engine.mean_batch_size > 1  # sessions shared steps
        assert sum(len(ids) for ids in (await rt.engine.collective_rpc("resident_sessions"))[0]) == 6


async def test_reset_and_close_reach_the_worker() -> None:
    async with Runtime("procedural", workers=1) as rt:
        session = await rt.create_session(prompt="forest", seed=11, session_id="s1")
        other = await rt.create_session(session_id="s2")
        await session.accept_event(SessionEvent(1, controls=(keys("D", "S"),)))
        first = await session.next_chunk()
        await session.next_chunk()
        await session.reset()
        again = await session.next_chunk()
        assert again.metadata.chunk_index == 0
        assert np.array_equal(again.frames, Truth(11, "forest").next(None, ()))  # fresh state, start options
        assert not np.array_equal(again.frames, first.frames)  # the held keys were dropped with the history
        await rt.close_session("s1")
        assert await rt.engine.collective_rpc("resident_sessions") == [[("s2",)]]
        assert rt.engine.worker_of("s1") is None
        assert rt.stats().engine.sessions == 1
        await other.close()  # closed directly on the session: the state goes, the routing is swept later
        assert await rt.engine.collective_rpc("resident_sessions") == [[()]]
        await rt.create_session(session_id="s3")
        assert rt.stats().engine.sessions == 1
        assert [s.session_id for s in rt.manager] == ["s3"]


async def test_idle_sessions_are_evicted_lru_and_a_full_worker_refuses_at_once(tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    async with Runtime(FAULTY, model_options={"gate": str(gate.path)}, workers=1, max_sessions_per_worker=2) as rt:
        a = await rt.create_session(seed=1)
        b = await rt.create_session(seed=2)
        await a.next_chunk()  # b is now the least recently used
        c = await rt.create_session(seed=3)
        assert rt.stats().engine.evictions == 1
        with pytest.raises(SessionEvictedError, match="evicted from worker 0") as evicted:
            await b.next_chunk()
        assert evicted.value.code == "evicted"
        assert b.status is SessionStatus.FAILED
        await b.reset()  # comes back (evicting a, now the idle one)
        assert np.array_equal((await b.next_chunk()).frames, Truth(2).next(None, ()))
        # Both resident sessions busy with held ticks: nothing can be evicted.
        await b.accept_event(SessionEvent(1, prompt="gate"))
        await c.accept_event(SessionEvent(1, prompt="gate"))
        busy = asyncio.gather(b.next_chunk(), c.next_chunk())
        await gate.wait_entered()
        await until(lambda: rt.engine.stats().queued_ticks + len(gate.batch()) == 2, "both ticks in the engine")
        with pytest.raises(AdmissionRefusedError, match="no worker can make room") as refused:
            await rt.create_session(seed=4)
        assert not gate.left  # refused at once, while the step still holds the worker
        assert refused.value.code == "admission_refused"
        gate.open()
        await busy
        assert rt.stats().engine.admissions_refused == 1
        with pytest.raises(SessionEvictedError):
            await a.next_chunk()


async def test_a_session_marked_in_use_is_never_evicted_until_its_mark_lapses() -> None:
    """The server's mechanism (docs/sessions.md, "Who may be evicted"): a session marked in use
    stays resident although it is the least recently used; with every resident session in use
    a newcomer is refused at once; a mark of 0 makes the session evictable again."""
    async with Runtime(FAULTY, workers=1, max_sessions_per_worker=2) as rt:
        a = await rt.create_session(seed=1)
        b = await rt.create_session(seed=2)
        await a.next_chunk()
        await b.next_chunk()  # least recently used first: a, b
        rt.mark_in_use(a.session_id, 600.0)
        c = await rt.create_session(seed=3)  # evicts b, the least recently used of those not in use
        with pytest.raises(SessionEvictedError):
            await b.next_chunk()
        assert (await a.next_chunk()).metadata.chunk_index == 1
        rt.mark_in_use(c.session_id, 600.0)
        with pytest.raises(AdmissionRefusedError, match="every session is in use") as refused:
            await rt.create_session(seed=4)
        assert refused.value.retry_after_s is not None
        assert rt.stats().engine.evictions == 1
        rt.mark_in_use(a.session_id, 0.0)  # a is no longer in use: the next newcomer takes its place
        d = await rt.create_session(seed=5)
        with pytest.raises(SessionEvictedError):
            await a.next_chunk()
        assert (await c.next_chunk()).metadata.chunk_index == 0
        assert (await d.next_chunk()).metadata.chunk_index == 0
        with pytest.raises(ValueError, match="seconds"):
            rt.mark_in_use(d.session_id, -1.0)
        rt.mark_in_use("unknown", 5.0)  # a session the runtime does not know: nothing to mark


async def test_a_session_with_a_tick_waiting_is_never_evicted_even_when_least_recently_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(tmp_path / "gate")
    async with Runtime(FAULTY, model_options={"gate": str(gate.path)}, workers=1, max_sessions_per_worker=3) as rt:
        x = await rt.create_session(seed=1)
        y = await rt.create_session(seed=2)
        w = await rt.create_session(prompt="gate", seed=3)
        await x.next_chunk()
        await y.next_chunk()  # least recently used first: w, x, y
        busy = asyncio.ensure_future(w.next_chunk())  # w's step holds the worker (and w becomes most recent)
        await gate.wait_entered()
        waiting = asyncio.ensure_future(x.next_chunk())  # queued in the engine behind w's step
        await until(lambda: rt.engine.stats().queued_ticks == 1, "x's tick queued behind w's step")
        admits: list[tuple[Any, ...]] = []
        call = rt.engine.executor.call

        def spy(index: int, method: str, args: tuple[Any, ...]) -> Any:
            if method == "admit":
                admits.append(args)
            return call(index, method, args)

        monkeypatch.setattr(rt.engine.executor, "call", spy)
        admitting = asyncio.ensure_future(rt.create_session(seed=4))  # x is the LRU, but its tick is waiting
        await until(lambda: bool(admits), "z's admission sent to the worker")
        assert not gate.left  # decided while w's step holds the worker and x's tick waits behind it
        gate.open()
        z = await admitting
        assert (await waiting).metadata.chunk_index == 1
        await busy
        with pytest.raises(SessionEvictedError):
            await y.next_chunk()
        assert (await z.next_chunk()).metadata.chunk_index == 0
        assert rt.stats().engine.evictions == 1


async def test_a_worker_killed_mid_tick_fails_only_its_sessions_and_is_replaced(tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    async with Runtime(FAULTY, model_options={"gate": str(gate.path)}, workers=2) as rt:
        a = await rt.create_session(prompt="gate", seed=1)  # worker 0
        b = await rt.create_session(seed=2)  # worker 1
        c = await rt.create_session(seed=3)  # worker 0
        assert [rt.engine.worker_of(s.session_id) for s in (a, b, c)] == [0, 1, 0]
        victim = rt.engine.executor.pid(0)
        assert victim is not None
        ticks = [asyncio.ensure_future(s.next_chunk()) for s in (a, b, c)]
        await gate.wait_entered()  # worker 0 is inside the held step of a and c
        assert sorted(gate.batch()) == sorted([a.session_id, c.session_id])
        os.kill(victim, signal.SIGKILL)
        # The gate never opens: the held tick can only end by the worker's death being noticed.
        results = await asyncio.wait_for(asyncio.gather(*ticks, return_exceptions=True), 30)
        for result in (results[0], results[2]):
            assert isinstance(result, WorkerDiedError), result
            assert result.code == "worker_died"
            assert f"worker 0 (pid {victim}) died (killed by SIGKILL)" in str(result)
        assert isinstance(results[1], Chunk)
        assert np.array_equal((await b.next_chunk()).frames[0], Truth(2).next(None, ())[0])  # unaffected
        await until(lambda: rt.stats().engine.worker_restarts == 1, "worker 0 replaced")
        await rt.engine.wait_workers_ready(timeout=30)
        assert rt.engine.executor.pid(0) not in (None, victim)
        await c.reset()
        assert np.array_equal((await c.next_chunk()).frames, Truth(3).next(None, ()))
        d = await rt.create_session(seed=4)
        assert np.array_equal((await d.next_chunk()).frames, Truth(4).next(None, ()))
        stats = rt.stats().engine
        assert (stats.worker_deaths, stats.worker_restarts, stats.tick_failures["worker_died"]) == (1, 1, 2)
        assert a.status is SessionStatus.FAILED


async def test_a_tick_past_its_deadline_fails_closed_and_a_hung_worker_is_replaced(tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")  # never opened: the step hangs until the worker is killed
    options = {"tick_deadline_s": 1.0, "hang_timeout_s": 2.0}
    async with Runtime(FAULTY, model_options={"gate": str(gate.path)}, workers=1, **options) as rt:
        stuck = await rt.create_session(prompt="gate", seed=1)
        with pytest.raises(DeadlineExceededError, match="running on worker 0") as late:
            await stuck.next_chunk()
        assert gate.entered  # the caller is not held by the step, which cannot end
        assert late.value.code == "deadline_exceeded"
        assert stuck.status is SessionStatus.FAILED
        # The hang timeout kills the worker; a fresh one starts.
        await until(lambda: rt.stats().engine.worker_restarts == 1, "the hung worker killed and replaced")
        await rt.engine.wait_workers_ready(timeout=30)
        stats = rt.stats().engine
        assert (stats.deadline_exceeded, stats.workers_killed_hung, stats.worker_restarts) == (1, 1, 1)
        assert not gate.left
        fine = await rt.create_session(seed=2)
        assert np.array_equal((await fine.next_chunk()).frames, Truth(2).next(None, ()))


async def test_one_failing_session_of_a_batch_fails_alone() -> None:
    async with Runtime(FAULTY, workers=1, batch_wait_s=0.5) as rt:
        good = [await rt.create_session(seed=seed) for seed in (1, 2)]
        bad = await rt.create_session(prompt="poison", seed=3)
        results = await asyncio.gather(*(s.next_chunk() for s in (good[0], bad, good[1])), return_exceptions=True)
        assert isinstance(results[1], TickFailedError)
        assert results[1].code == "model_error"
        assert "poisoned session" in str(results[1])
        for seed, result in zip((1, 2), (results[0], results[2]), strict=True):
            assert isinstance(result, Chunk)
            assert result.batch_size == 3
            assert np.array_equal(result.frames, Truth(seed).next(None, ()))
        assert bad.status is SessionStatus.FAILED
        assert rt.engine.worker_of(bad.session_id) is None
        assert [s.chunk_index for s in good] == [1, 1]


async def events_accepted_inside(
    work: Callable[[], Awaitable[object]], gate: Gate, accept: Callable[[int], Awaitable[object]], count: int
) -> int:
    """Run ``work``; once its step is inside the gate, accept ``count`` events (one per loop turn)
    and open the gate. Returns how many were accepted while the step was still inside: all of
    them when the step runs off the event loop, none when it blocks the loop."""
    task = asyncio.ensure_future(work())
    await gate.wait_entered()
    inside = 0
    for event_id in range(1, count + 1):
        await accept(event_id)
        await asyncio.sleep(0)
        inside += not gate.left
    gate.open()
    await task
    return inside


@pytest.mark.parametrize("executor", ["multiprocess", "inprocess"])
async def test_a_slow_forward_does_not_stall_the_event_loop(executor: str, tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    config = {"executor": executor, "max_pending_events": 10_000}
    async with Runtime(FAULTY, model_options={"gate": str(gate.path)}, **config) as rt:
        session = await rt.create_session(prompt="gate")

        async def accept(event_id: int) -> None:
            await session.accept_event(SessionEvent(event_id, controls=(keys("D"),)))

        # The step is held until the test opens the gate: had it run on the loop, nothing could
        # run until it ended (and the gate could not open).
        assert await events_accepted_inside(session.next_chunk, gate, accept, 200) == 200

    # The same probe catches a forward run on the loop: a step that blocks it until it is done.
    blocking_gate = Gate(tmp_path / "blocking")

    async def blocking() -> None:
        blocking_gate.path.with_name("blocking.entered").touch()
        time.sleep(0.1)  # noqa: ASYNC251 -- deliberately blocking the loop
        blocking_gate.path.with_name("blocking.left").touch()

    async def count(_: int) -> None:
        return None

    assert await events_accepted_inside(blocking, blocking_gate, count, 20) == 0


async def test_worker_processes_share_the_cpu_threads() -> None:
    async with Runtime("runtime_models:ThreadsModel", workers=2, threads_per_worker=3) as rt:
        assert rt.spec.description == "OMP_NUM_THREADS=3"
    auto = RuntimeConfig(workers=2).worker_config().cpu_threads
    assert auto == max(1, (os.cpu_count() or 1) // 2)
    assert RuntimeConfig(executor="inprocess").worker_config().cpu_threads is None  # shares this process
    with pytest.raises(ValueError, match="threads_per_worker"):
        RuntimeConfig(threads_per_worker=0)


async def test_workers_leave_sigterm_to_the_parent_and_a_runtime_never_closed_still_lets_python_exit(
    tmp_path: Path,
) -> None:
    """A SIGTERM to a worker (systemd and `kill -- -PGID` signal the whole group) does not kill it: the
    parent stops its workers itself. So a script that never closes its runtime must still end:
    its workers are killed and their shared memory unlinked at exit."""
    import subprocess
    import sys

    async with Runtime("procedural", workers=1) as rt:
        session = await rt.create_session(seed=5)
        await session.next_chunk()
        pid = rt.engine.executor.pid(0)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        second = await session.next_chunk()  # the same worker made it: it is alive, the state kept
        assert second.metadata.chunk_index == 1
        assert rt.engine.executor.pid(0) == pid
        assert rt.stats().engine.worker_deaths == 0
    script = tmp_path / "never_closed.py"
    script.write_text(
        "import asyncio\n"
        "from worldserve.runtime import Runtime\n\n"
        "async def main():\n"
        "    runtime = Runtime('procedural', workers=2)\n"
        "    await runtime.start()\n"
        "    await (await runtime.create_session(seed=1)).next_chunk()\n"
        "    print('leaving without closing', flush=True)\n\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "leaving without closing\n"
    assert "leaked shared_memory" not in done.stderr
