"""Cancel without losing the world (issue 13, item 5): ``cancel_chunk()`` abandons the chunk being made,
the session stays active at its last commit with the chunk's events queued, and the worker rolls the
state back, so the chunks after it equal those of a run that never started the cancelled one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from runtime_models import CAMERA, Truth, keys
from test_session import Consumer, Lifecycle, make
from worldserve import (
    CancelUnsupportedError,
    ChunkCancelledError,
    ChunkMetadata,
    ControlInput,
    NothingToCancelError,
    Session,
    SessionEvent,
    SessionStatus,
    TickRequest,
)
from worldserve.models import SessionOptions, load_model
from worldserve.models.base import WorldModel
from worldserve.runtime import ModelRunner, Runtime
from worldserve.runtime.messages import TickOutput

pytestmark = pytest.mark.timeout(60)

FAULTY = "runtime_models:FaultyModel"


class CancellableConsumer(Consumer):
    """Holds each tick until ``finish()``; ``cancel_tick`` makes it raise ``ChunkCancelledError``."""

    def __init__(self) -> None:
        super().__init__()
        self.waiter: asyncio.Future[ChunkMetadata] | None = None
        self.cancelled: list[TickRequest] = []

    async def execute_tick(self, tick: TickRequest) -> ChunkMetadata:
        self.ticks.append(tick)
        self.started.set()
        self.waiter = asyncio.get_running_loop().create_future()
        return await self.waiter

    def cancel_tick(self, tick: TickRequest) -> None:
        if self.waiter is None or self.waiter.done():
            raise NothingToCancelError("done")
        self.cancelled.append(tick)
        self.waiter.set_exception(ChunkCancelledError(f"chunk {tick.chunk_index} cancelled"))

    def finish(self) -> None:
        assert self.waiter is not None
        self.waiter.set_result(ChunkMetadata.from_tick(self.ticks[-1]))


def cancellable(max_pending: int = 4) -> tuple[Session[Any], CancellableConsumer]:
    consumer, lifecycle = CancellableConsumer(), Lifecycle()
    session: Session[Any] = Session(
        "w",
        tick_consumer=consumer,
        lifecycle=lifecycle,
        max_pending_events=max_pending,
        request_id_factory=lambda session_id, index: f"{session_id}-{index}",
    )
    lifecycle.session = session
    return session, consumer


async def test_cancel_returns_to_the_last_commit_with_the_events_still_queued() -> None:
    session, consumer = cancellable()
    await session.accept_event(SessionEvent(1, prompt="forest"))
    first = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    consumer.finish()
    await first
    await session.accept_event(SessionEvent(2, prompt="snow"))
    await session.accept_event(SessionEvent(3, controls=(keys("W"),)))
    second = asyncio.create_task(session.next_chunk())
    await asyncio.sleep(0)
    assert session.chunk_in_flight == 1
    assert await session.cancel_chunk() == 1
    with pytest.raises(ChunkCancelledError) as raised:
        await second
    assert raised.value.code == "chunk_cancelled"
    assert session.status is SessionStatus.ACTIVE
    assert (session.chunk_index, session.prompt, session.controls) == (1, "forest", ())
    assert session.pending_event_ids == (2, 3)
    assert session.event_floor == 1
    assert session.failure is None
    assert session.stats.cancelled == 1
    await session.accept_event(SessionEvent(4, controls=(keys("A"),)))
    third = asyncio.create_task(session.next_chunk())
    await asyncio.sleep(0)
    consumer.finish()
    metadata = await third
    assert (metadata.chunk_index, metadata.applied_event_ids) == (1, (2, 3, 4))
    assert consumer.ticks[-1].prompt == "snow"
    assert session.dropped_events == ()
    assert session.stats.applied == 4


async def test_what_cannot_be_cancelled_changes_nothing() -> None:
    session, _ = cancellable()
    with pytest.raises(NothingToCancelError):
        await session.cancel_chunk()  # idle
    tick = asyncio.create_task(session.next_chunk())
    await asyncio.sleep(0)
    await session.cancel_chunk()
    with pytest.raises(NothingToCancelError):
        await session.cancel_chunk()  # already cancelled
    with pytest.raises(ChunkCancelledError):
        await tick
    # A consumer without cancel_tick: refused, and the chunk still arrives.
    plain, plain_consumer, _ = make()
    plain_consumer.gate = asyncio.Event()
    tick = asyncio.create_task(plain.next_chunk())
    await plain_consumer.started.wait()
    with pytest.raises(CancelUnsupportedError) as refused:
        await plain.cancel_chunk()
    assert str(refused.value) == f"the tick consumer of session {plain.session_id!r} cannot cancel a chunk."
    assert "''" not in str(refused.value)  # no doubled quote ('s1''s)
    plain_consumer.gate.set()
    await tick
    assert (plain.status, plain.chunk_index) == (SessionStatus.ACTIVE, 1)


async def test_an_asyncio_cancellation_still_fails_the_session_closed() -> None:
    session, consumer = cancellable()
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    tick.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tick
    assert (session.status, session.failure_code) == (SessionStatus.FAILED, "cancelled")


async def test_a_cancellation_nobody_asked_for_fails_the_session() -> None:
    session, consumer = cancellable()
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    assert consumer.waiter is not None
    consumer.waiter.set_exception(ChunkCancelledError("spontaneous"))
    with pytest.raises(ChunkCancelledError):
        await tick
    assert (session.status, session.failure_code) == (SessionStatus.FAILED, "chunk_cancelled")


# -- the runner: the model rolls back -------------------------------------------------------------------------


def _step(runner: ModelRunner, tick: TickRequest) -> np.ndarray:
    (result,) = runner.step([tick]).results
    assert isinstance(result, TickOutput), result
    return result.frames


def _tick(chunk: int, *controls: ControlInput, request: str = "") -> TickRequest:
    return TickRequest("s", f"s-{chunk}{request}", chunk, (), None, tuple(sorted(controls, key=lambda c: c.track)))


PAN = ControlInput("camera", CAMERA, {"dx": 2.5, "dy": -1.0})


@pytest.mark.timeout(240)  # tinyworld's steps on a shared, busy CPU
@pytest.mark.parametrize("name", ["procedural", "tinyworld"])
def test_a_rolled_back_step_leaves_the_state_as_if_it_never_ran(name: str) -> None:
    model: WorldModel = load_model(name)
    assert model.spec.can_rollback
    options = SessionOptions(prompt="forest", seed=11)
    cancelled, straight = ModelRunner(model), ModelRunner(model)
    for runner in (cancelled, straight):
        runner.admit("s", options)
        _step(runner, _tick(0, keys("D")))
    _step(cancelled, _tick(1, keys("W")))  # the chunk that gets cancelled
    assert cancelled.call("rollback_ar_diffusion_session", ("s", 1)) is True
    assert cancelled.rollback_ar_diffusion_session("s", 1) is False  # one step back, once: the state is released
    assert cancelled.resident_sessions() == ()
    cancelled.admit("s", options)
    _step(cancelled, _tick(0, keys("D")))
    _step(cancelled, _tick(1, keys("W")))
    assert cancelled.rollback_ar_diffusion_session("s", 1) is True
    for chunk, controls in ((1, (keys("A"), PAN)), (2, (keys("S"),))):
        assert np.array_equal(_step(cancelled, _tick(chunk, *controls)), _step(straight, _tick(chunk, *controls)))


# -- the runtime: worker processes -----------------------------------------------------------------------------


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_cancel_mid_chunk_through_the_runtime_keeps_the_world() -> None:
    """A running chunk (slow step) and a queued one are cancelled; the frames after them are those of
    a session that never started them, and equal the exact world."""
    async with Runtime(FAULTY, model_options={"slow_s": 0.3}, workers=1, batch_wait_s=0.001) as rt:
        events = {
            1: SessionEvent(1, controls=(keys("D"),)),
            2: SessionEvent(2, controls=(keys("W"),)),
            3: SessionEvent(3, controls=(PAN,)),
        }
        straight = await rt.create_session(prompt="slow", seed=5)
        await straight.accept_event(events[1])
        expected = [await straight.next_chunk()]
        await straight.accept_event(events[2])
        await straight.accept_event(events[3])
        expected += [await straight.next_chunk(), await straight.next_chunk()]

        session = await rt.create_session(prompt="slow", seed=5)
        queued = await rt.create_session(prompt="slow", seed=6)
        await session.accept_event(events[1])
        got = [await session.next_chunk()]
        await session.accept_event(events[2])
        batches = rt.engine.stats().batches
        running = asyncio.create_task(session.next_chunk())
        await _until(lambda: rt.engine.stats().batches > batches)  # its step runs now (0.3 s)
        waiting = asyncio.create_task(queued.next_chunk())
        await _until(lambda: rt.engine.stats().queued_ticks == 1)
        assert await queued.cancel_chunk() == 0  # still queued: it just leaves the queue
        assert await session.cancel_chunk() == 1  # running: its result is dropped, the state rolled back
        for task in (running, waiting):
            with pytest.raises(ChunkCancelledError):
                await task
        assert (session.status, session.chunk_index, session.pending_event_ids) == (SessionStatus.ACTIVE, 1, (2,))
        assert (queued.status, queued.chunk_index) == (SessionStatus.ACTIVE, 0)
        await session.accept_event(events[3])
        got += [await session.next_chunk(), await session.next_chunk()]
        assert [chunk.metadata.applied_event_ids for chunk in got] == [(1,), (2, 3), ()]
        truth = Truth(5, "slow")
        for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
            assert mine.metadata.chunk_index == index
            assert np.array_equal(mine.frames, theirs.frames), f"chunk {index}"
            controls = [events[1].controls[0]] if index == 0 else [PAN, events[2].controls[0]]
            assert np.array_equal(mine.frames, truth.next(None, controls)), f"chunk {index} is not the world"
        queued_chunk = await queued.next_chunk()
        assert np.array_equal(queued_chunk.frames, Truth(6, "slow").next(None, []))
        stats = rt.engine.stats()
        assert (stats.ticks_cancelled, stats.rollbacks_failed) == (2, 0)


async def test_a_model_that_cannot_roll_back_refuses_and_the_chunk_arrives() -> None:
    options = {"slow_s": 0.3, "rollback": False}
    async with Runtime(FAULTY, model_options=options, workers=1, executor="inprocess") as rt:
        assert rt.spec.can_rollback is False
        session = await rt.create_session(prompt="slow", seed=2)
        batches = rt.engine.stats().batches
        running = asyncio.create_task(session.next_chunk())
        await _until(lambda: rt.engine.stats().batches > batches)
        with pytest.raises(CancelUnsupportedError) as refused:
            await session.cancel_chunk()
        assert refused.value.code == "cancel_unsupported"
        chunk = await running
        assert chunk.metadata.chunk_index == 0
        assert (session.status, session.chunk_index) == (SessionStatus.ACTIVE, 1)
        with pytest.raises(NothingToCancelError):
            await session.cancel_chunk()
