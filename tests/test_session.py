"""The session control plane beyond the seed's own suite: cancellation, commit atomicity, the duplicate
window, drop records, failure codes, stats, the validator hook and the manager."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from worldserve import (
    TRANSITIONS,
    ChunkMetadata,
    ChunkMetadataError,
    ControlInput,
    DroppedEvents,
    DropReason,
    EventAcceptanceStatus,
    EventQueueFullError,
    InvalidEventError,
    PreparedControls,
    Session,
    SessionError,
    SessionEvent,
    SessionManager,
    SessionStateError,
    SessionStats,
    SessionStatus,
    StaleEventError,
    TickRequest,
)


class CodedError(RuntimeError):
    code = "model_oom"


class Consumer:
    """Runs ticks; can hold a tick at a gate, fail, or answer with other metadata."""

    def __init__(self) -> None:
        self.ticks: list[TickRequest] = []
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.metadata: object = None
        self.on_metadata: Any = None

    async def execute_tick(self, tick: TickRequest) -> ChunkMetadata:
        self.ticks.append(tick)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return ChunkMetadata.from_tick(tick)

    def chunk_metadata(self, output: ChunkMetadata) -> Any:
        if self.on_metadata is not None:
            self.on_metadata()
        return output if self.metadata is None else self.metadata


class Lifecycle:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, SessionStatus]] = []
        self.session: Session[Any] | None = None
        self.reset_error: BaseException | None = None
        self.close_error: BaseException | None = None
        self.gate: asyncio.Event | None = None
        self.close_gate: asyncio.Event | None = None
        self.closes_done = 0

    async def reset_session(self, session_id: str) -> None:
        self.calls.append(("reset", session_id, self._status()))
        if self.gate is not None:
            await self.gate.wait()
        if self.reset_error is not None:
            raise self.reset_error

    async def close_session(self, session_id: str) -> None:
        self.calls.append(("close", session_id, self._status()))
        if self.close_gate is not None:
            await self.close_gate.wait()
        if self.close_error is not None:
            raise self.close_error
        self.closes_done += 1

    def _status(self) -> SessionStatus:
        assert self.session is not None
        return self.session.status


def make(max_pending: int = 4, **kwargs: Any) -> tuple[Session[Any], Consumer, Lifecycle]:
    consumer, lifecycle = Consumer(), Lifecycle()
    session: Session[Any] = Session(
        "w",
        tick_consumer=consumer,
        lifecycle=lifecycle,
        max_pending_events=max_pending,
        request_id_factory=lambda session_id, index: f"{session_id}-{index}",
        **kwargs,
    )
    lifecycle.session = session
    return session, consumer, lifecycle


def prompt(event_id: int, text: str = "p") -> SessionEvent:
    return SessionEvent(event_id, prompt=text)


def control(track: str, **data: Any) -> ControlInput:
    return ControlInput(track, f"test.{track}.v1", data)


async def fail_with(session: Session[Any], consumer: Consumer, error: BaseException) -> None:
    consumer.error = error
    with pytest.raises(type(error)):
        await session.next_chunk()
    consumer.error = None


# -- the status table and error codes ---------------------------------------------------------------------------


def test_transitions_are_the_seeds_state_machine() -> None:
    s = SessionStatus
    assert dict(TRANSITIONS) == {
        s.ACTIVE: {s.FAILED, s.RESETTING, s.CLOSING},
        s.FAILED: {s.RESETTING, s.CLOSING},
        s.RESETTING: {s.ACTIVE, s.FAILED},
        s.CLOSING: {s.CLOSED, s.CLEANUP_FAILED},
        s.CLEANUP_FAILED: {s.CLOSING},
        s.CLOSED: set(),
    }
    with pytest.raises(TypeError):
        TRANSITIONS[s.CLOSED] = frozenset({s.ACTIVE})  # type: ignore[index]


def test_errors_carry_stable_codes() -> None:
    assert SessionError.code == "session_error"
    assert SessionStateError.code == "invalid_state"
    assert EventQueueFullError.code == "queue_full"
    assert StaleEventError.code == "stale_event"
    assert ChunkMetadataError.code == "metadata_mismatch"
    assert InvalidEventError.code == "invalid_control"
    for error in (SessionStateError, EventQueueFullError, StaleEventError, ChunkMetadataError, InvalidEventError):
        assert issubclass(error, SessionError)
    assert issubclass(InvalidEventError, ValueError)


# -- construction and events --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"session_id": ""}, "session_id must be a non-empty string"),
        ({"session_id": "  "}, "session_id must be a non-empty string"),
        ({"max_pending_events": 0}, "max_pending_events must be a positive integer; got 0"),
        ({"max_pending_events": True}, "max_pending_events must be a positive integer; got True"),
        ({"max_pending_events": 2.0}, "max_pending_events must be a positive integer; got 2.0"),
    ],
)
def test_session_construction_is_validated(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {
        "session_id": "w",
        "tick_consumer": Consumer(),
        "lifecycle": Lifecycle(),
        "max_pending_events": 2,
    }
    with pytest.raises(ValueError, match=message):
        Session(**{**arguments, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"event_id": -1, "prompt": "p"}, "event_id must be a non-negative integer; got -1"),
        ({"event_id": True, "prompt": "p"}, "event_id must be a non-negative integer; got True"),
        ({"event_id": "3", "prompt": "p"}, "event_id must be a non-negative integer; got '3'"),
        ({"event_id": 1, "prompt": 5}, "prompt must be a string or None; got int"),
        ({"event_id": 1}, "An event must update the prompt, one or more controls, or both"),
        ({"event_id": 1, "controls": ({"track": "t"},)}, "controls must contain ControlInput values; got dict"),
        (
            {"event_id": 1, "controls": (control("cam", x=1), control("cam", x=2))},
            "A composite event may update each control track at most once",
        ),
    ],
)
def test_event_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SessionEvent(**kwargs)


def test_event_keeps_the_controls_it_is_given() -> None:
    cam = control("cam", x=1)
    event = SessionEvent(3, controls=[cam])  # type: ignore[arg-type]
    assert event.controls == (cam,)
    assert event.controls[0] is cam


async def test_accept_refuses_what_is_not_an_event() -> None:
    session, _, _ = make()
    with pytest.raises(TypeError, match="event must be a SessionEvent"):
        await session.accept_event({"event_id": 1, "prompt": "p"})  # type: ignore[arg-type]


# -- chunks: snapshots, sharing, ordering ---------------------------------------------------------------------------


async def test_chunk_snapshot_shares_the_accepted_controls_and_orders_them_by_track() -> None:
    session, consumer, _ = make()
    zoom, cam_a, cam_b = control("zoom", z=1), control("cam", x=1), control("cam", x=2)
    await session.accept_event(SessionEvent(5, controls=(cam_b,)))
    await session.accept_event(SessionEvent(2, prompt="first", controls=(zoom, cam_a)))
    await session.accept_event(SessionEvent(3, prompt="second"))
    await session.next_chunk()
    tick = consumer.ticks[0]
    assert tick.applied_event_ids == (2, 3, 5)
    assert tick.prompt == "second"  # the last prompt by event id wins
    assert [c.track for c in tick.controls] == ["cam", "zoom"]
    assert tick.controls[0] is cam_b  # the last control per track by event id wins, shared, not copied
    assert tick.controls[1] is zoom
    assert session.prompt == "second"
    assert session.controls == tick.controls

    await session.next_chunk()  # nothing new: the same snapshot goes again
    assert consumer.ticks[1].controls is consumer.ticks[0].controls
    assert consumer.ticks[1].prompt == "second"
    assert consumer.ticks[1].applied_event_ids == ()
    await session.accept_event(SessionEvent(6, controls=(control("aim", a=0),)))
    await session.next_chunk()
    assert [c.track for c in consumer.ticks[2].controls] == ["aim", "cam", "zoom"]
    assert consumer.ticks[2].controls[1] is cam_b


async def test_control_subclasses_go_through_as_in_the_seed() -> None:
    # SessionEvent accepts ControlInput subclasses; the tick built from them must too, or one such
    # event would sit in the queue and make every later chunk fail.
    class ModelControl(ControlInput):
        __slots__ = ()

    session, consumer, _ = make()
    special = ModelControl("cam", "model.cam.v1", {"x": 1})
    await session.accept_event(SessionEvent(1, controls=(special,)))
    await session.next_chunk()
    assert consumer.ticks[0].controls == (special,)
    assert consumer.ticks[0].controls[0] is special
    assert session.pending_event_count == 0


async def test_concurrent_next_chunk_calls_run_one_after_the_other() -> None:
    session, consumer, _ = make()
    consumer.gate = asyncio.Event()
    await session.accept_event(prompt(1))
    first = asyncio.create_task(session.next_chunk())
    second = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    await asyncio.sleep(0)
    assert len(consumer.ticks) == 1  # the second waits for the first to commit
    consumer.gate.set()
    results = await asyncio.gather(first, second)
    assert [m.chunk_index for m in results] == [0, 1]
    assert [t.applied_event_ids for t in consumer.ticks] == [(1,), ()]


async def test_events_accepted_during_a_tick_wait_for_the_next_chunk() -> None:
    session, consumer, _ = make(max_pending=3)
    consumer.gate = asyncio.Event()
    await session.accept_event(prompt(10, "first"))
    await session.accept_event(SessionEvent(12, controls=(control("cam", x=1),)))
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    assert session.event_floor == 12  # the floor of the tick in flight
    assert session.pending_event_count == 2  # in-flight events still count against the bound
    with pytest.raises(StaleEventError, match="event floor is 12"):
        await session.accept_event(prompt(11, "late"))
    late = await session.accept_event(SessionEvent(13, prompt="second", controls=(control("cam", x=2),)))
    assert late.status is EventAcceptanceStatus.ACCEPTED
    assert late.pending_event_count == 3
    with pytest.raises(EventQueueFullError, match=r"event queue is full \(3 pending\)"):
        await session.accept_event(prompt(14))
    assert consumer.ticks[0].applied_event_ids == (10, 12)
    consumer.gate.set()
    await tick
    assert session.pending_event_count == 1
    assert session.prompt == "first"
    assert session.controls[0].data == {"x": 1}
    await session.next_chunk()
    assert consumer.ticks[1].applied_event_ids == (13,)
    assert session.prompt == "second"
    assert session.controls[0].data == {"x": 2}
    assert session.event_floor == 13


# -- failing closed --------------------------------------------------------------------------------------------------


async def test_cancelling_a_tick_in_flight_fails_closed() -> None:
    session, consumer, lifecycle = make()
    consumer.gate = asyncio.Event()
    await session.accept_event(prompt(1))
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    tick.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tick
    assert session.status is SessionStatus.FAILED
    assert session.failure_code == "cancelled"
    assert session.failure is not None
    assert session.failure.startswith("CancelledError")
    assert lifecycle.calls == [("close", "w", SessionStatus.FAILED)]  # the worker's state is released
    assert session.chunk_index == 0  # nothing committed
    assert session.pending_event_count == 1
    assert session.event_floor == -1  # the in-flight floor is gone with the tick
    assert session.stats.failures == 1
    with pytest.raises(SessionStateError, match="is failed"):
        await session.accept_event(prompt(2))
    with pytest.raises(SessionStateError, match="is failed"):
        await session.next_chunk()
    await session.reset()
    assert session.take_dropped() == (DroppedEvents((1,), DropReason.FAILED, "CancelledError: "),)
    assert session.status is SessionStatus.ACTIVE
    assert session.failure_code is None


async def test_a_second_cancellation_cannot_interrupt_the_worker_cleanup() -> None:
    session, consumer, lifecycle = make()
    consumer.gate = asyncio.Event()
    lifecycle.close_gate = asyncio.Event()
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    tick.cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    assert lifecycle.calls == [("close", "w", SessionStatus.FAILED)]  # cleanup under way
    tick.cancel()  # the caller gives up again
    reset = asyncio.create_task(session.reset())  # queued behind the tick lock
    for _ in range(5):
        await asyncio.sleep(0)
    # The cleanup goes on, and the tick keeps the lock until it is done: the reset
    # must not reach the worker before the close (its fresh state would be released).
    assert not tick.done()
    assert lifecycle.calls == [("close", "w", SessionStatus.FAILED)]
    lifecycle.close_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await tick
    assert lifecycle.closes_done == 1  # the worker's state was released
    await reset
    assert [call[0] for call in lifecycle.calls] == ["close", "reset"]
    assert session.status is SessionStatus.ACTIVE


@pytest.mark.parametrize("where", ["chunk_metadata", "reducer_commit"])
async def test_a_commit_that_has_begun_completes_even_if_the_caller_is_cancelled(where: str) -> None:
    # The cancellation arrives after the consumer returned: during its metadata call, or in the
    # middle of the commit itself. The chunk commits; the caller still sees its cancellation.
    reducer = Reducer()
    session, consumer, lifecycle = make(control_reducer=reducer)
    await session.accept_event(SessionEvent(1, prompt="go", controls=(control("cam", x=1),)))

    def cancel_me() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()

    if where == "chunk_metadata":
        consumer.on_metadata = cancel_me
    else:
        reducer.on_commit = cancel_me
    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(session.next_chunk())
    assert session.status is SessionStatus.ACTIVE
    assert session.chunk_index == 1
    assert session.pending_event_count == 0
    assert session.event_floor == 1
    assert session.prompt == "go"
    assert len(reducer.committed) == 1
    assert session.stats.chunks == 1
    assert session.stats.applied == 1
    assert lifecycle.calls == []
    assert session.failure_code is None


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError("boom"), "tick_failed"),
        (CodedError("out of memory"), "model_oom"),
        (SessionStateError("worker has no such session"), "invalid_state"),
        (KeyboardInterrupt(), "tick_failed"),
    ],
)
async def test_failure_code_names_why_a_tick_failed(error: BaseException, code: str) -> None:
    session, consumer, _ = make()
    assert session.failure_code is None
    assert session.failure is None
    await fail_with(session, consumer, error)
    assert session.status is SessionStatus.FAILED
    assert session.failure_code == code
    assert session.failure == f"{type(error).__name__}: {error}"


async def test_failure_code_ignores_codes_that_are_not_strings() -> None:
    class Numbered(RuntimeError):
        code = 503

    class Exit(SystemExit):
        pass

    for error in (Numbered("busy"), Exit("shutting-down")):
        session, consumer, _ = make()
        await fail_with(session, consumer, error)
        assert session.failure_code == "tick_failed"


async def test_metadata_mismatch_fails_with_its_code_and_message() -> None:
    session, consumer, lifecycle = make()
    await session.accept_event(prompt(1))
    for wrong in (ChunkMetadata("w", "w-0", 1, (1,)), ChunkMetadata("w", "w-0", 0, ()), {"chunk_index": 0}):
        consumer.metadata = wrong
        with pytest.raises(ChunkMetadataError, match=r"does not match the submitted tick: expected .*got") as caught:
            await session.next_chunk()
        assert repr(wrong) in str(caught.value)
        assert session.failure_code == "metadata_mismatch"
        assert session.pending_event_count == 1
        assert session.chunk_index == 0
        await session.reset()
        await session.accept_event(prompt(session.event_floor + 1))
    assert [call[0] for call in lifecycle.calls] == ["close", "reset"] * 3


async def test_reducer_commit_failure_is_a_failed_tick() -> None:
    reducer = Reducer()
    reducer.commit_error = RuntimeError("reducer broke")
    session, _, _ = make(control_reducer=reducer)
    await session.accept_event(prompt(1))
    with pytest.raises(RuntimeError, match="reducer broke"):
        await session.next_chunk()
    assert session.failure_code == "tick_failed"
    assert session.pending_event_count == 1


async def test_cleanup_failure_after_a_tick_failure_is_reported_and_the_session_stays_failed() -> None:
    session, consumer, lifecycle = make()
    lifecycle.close_error = RuntimeError("worker gone")
    consumer.error = RuntimeError("boom")
    with pytest.raises(SessionError, match=r"tick failed \(RuntimeError: boom\) and worker session cleanup") as caught:
        await session.next_chunk()
    assert caught.value.__cause__ is consumer.error
    assert "worker gone" in str(caught.value)
    assert session.status is SessionStatus.FAILED
    assert session.failure_code == "tick_failed"  # the tick's failure, not the cleanup's


async def test_failure_code_of_a_failed_reset_and_its_clearing() -> None:
    session, _, lifecycle = make()
    lifecycle.reset_error = RuntimeError("reset rpc failed")
    with pytest.raises(RuntimeError, match="reset rpc failed"):
        await session.reset()
    assert session.status is SessionStatus.FAILED
    assert session.failure_code == "reset_failed"
    assert session.failure == "reset failed: RuntimeError: reset rpc failed"
    assert session.stats.failures == 1

    lifecycle.reset_error = SessionError("reset_ar_diffusion_session failed: not an AR stage")
    with pytest.raises(SessionError):
        await session.reset()
    assert session.failure_code == "session_error"

    lifecycle.reset_error = None
    lifecycle.gate = asyncio.Event()
    resetting = asyncio.create_task(session.reset())
    await asyncio.sleep(0)
    assert session.status is SessionStatus.RESETTING
    resetting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await resetting
    assert session.status is SessionStatus.FAILED
    assert session.failure_code == "cancelled"

    lifecycle.gate = None
    await session.reset()
    assert session.status is SessionStatus.ACTIVE
    assert session.failure_code is None
    assert session.failure is None
    assert session.stats.failures == 3
    assert session.stats.resets == 1


async def test_failure_code_is_kept_through_close() -> None:
    session, consumer, _ = make()
    await fail_with(session, consumer, CodedError("oom"))
    await session.close()
    assert session.status is SessionStatus.CLOSED
    assert session.failure_code == "model_oom"
    assert session.failure == "CodedError: oom"


# -- reset and close ---------------------------------------------------------------------------------------------


async def test_reset_and_close_wait_for_the_tick_in_flight() -> None:
    session, consumer, lifecycle = make()
    consumer.gate = asyncio.Event()
    await session.accept_event(prompt(1, "kept"))
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    reset = asyncio.create_task(session.reset())
    close = asyncio.create_task(session.close())
    await asyncio.sleep(0)
    assert lifecycle.calls == []
    assert session.status is SessionStatus.ACTIVE
    consumer.gate.set()
    metadata = await tick
    await reset
    await close
    assert metadata.applied_event_ids == (1,)  # committed before the reset ran
    assert [call[:2] for call in lifecycle.calls] == [("reset", "w"), ("close", "w")]
    assert [call[2] for call in lifecycle.calls] == [SessionStatus.RESETTING, SessionStatus.CLOSING]
    assert session.status is SessionStatus.CLOSED
    assert session.take_dropped() == ()


async def test_reset_starts_over_and_keeps_the_duplicate_window() -> None:
    session, consumer, _ = make()
    await session.accept_event(SessionEvent(1, prompt="a", controls=(control("cam", x=1),)))
    await session.next_chunk()
    await session.accept_event(prompt(4))
    await session.accept_event(prompt(3))
    await session.reset()
    assert session.chunk_index == 0
    assert session.epoch == 1
    assert session.prompt is None
    assert session.controls == ()
    assert session.pending_event_count == 0
    assert session.event_floor == 4  # dropped ids do not come back
    assert (await session.accept_event(prompt(3))).status is EventAcceptanceStatus.DUPLICATE
    assert (await session.accept_event(prompt(1))).status is EventAcceptanceStatus.DUPLICATE
    with pytest.raises(StaleEventError, match="event floor is 4"):
        await session.accept_event(prompt(2))
    await session.next_chunk()
    assert consumer.ticks[-1].chunk_index == 0
    assert consumer.ticks[-1].prompt is None
    assert consumer.ticks[-1].controls == ()


async def test_reset_and_close_refuse_where_the_status_machine_does() -> None:
    session, _, lifecycle = make()
    lifecycle.close_error = RuntimeError("cleanup failed")
    with pytest.raises(RuntimeError):
        await session.close()
    assert session.status is SessionStatus.CLEANUP_FAILED
    with pytest.raises(SessionStateError, match="is cleanup_failed"):
        await session.reset()
    with pytest.raises(SessionStateError, match="is cleanup_failed"):
        await session.accept_event(prompt(1))
    lifecycle.close_error = None
    await session.close()
    await session.close()  # closing a closed session is a no-op
    assert [call[2] for call in lifecycle.calls] == [SessionStatus.CLOSING, SessionStatus.CLOSING]
    with pytest.raises(SessionStateError, match="is closed"):
        await session.reset()
    with pytest.raises(SessionStateError, match="is closed"):
        await session.next_chunk()


async def test_cancelled_close_leaves_a_tombstone() -> None:
    session, _, lifecycle = make()
    lifecycle.close_error = asyncio.CancelledError()
    with pytest.raises(asyncio.CancelledError):
        await session.close()
    assert session.status is SessionStatus.CLEANUP_FAILED


# -- nothing dropped silently --------------------------------------------------------------------------------------


async def test_drop_records_say_which_events_and_why() -> None:
    session, consumer, _ = make()
    await session.accept_event(prompt(2))
    await session.accept_event(prompt(1))
    await session.reset()
    await session.reset()  # nothing pending: no record
    assert session.dropped_events == (DroppedEvents((1, 2), DropReason.RESET, "session reset"),)

    await session.accept_event(prompt(7))
    await fail_with(session, consumer, RuntimeError("model crashed"))
    await session.reset()
    assert session.dropped_events[-1] == DroppedEvents((7,), DropReason.FAILED, "RuntimeError: model crashed")

    assert len(session.take_dropped()) == 2
    assert session.take_dropped() == ()
    assert session.dropped_events == ()

    await session.accept_event(prompt(9))
    await session.accept_event(prompt(8))
    await session.close()
    assert session.take_dropped() == (DroppedEvents((8, 9), DropReason.CLOSED, "session closed"),)
    assert session.stats.dropped == 5
    assert session.stats.applied == 0


async def test_closing_a_failed_session_drops_with_the_failure() -> None:
    session, consumer, _ = make()
    await session.accept_event(prompt(3))
    await fail_with(session, consumer, CodedError("oom"))
    await session.close()
    assert session.take_dropped() == (DroppedEvents((3,), DropReason.FAILED, "CodedError: oom"),)


async def test_a_failed_reset_keeps_the_events_until_a_later_reset_drops_them() -> None:
    session, _, lifecycle = make()
    await session.accept_event(prompt(5))
    lifecycle.reset_error = RuntimeError("rpc down")
    with pytest.raises(RuntimeError):
        await session.reset()
    assert session.pending_event_count == 1
    assert session.dropped_events == ()
    lifecycle.reset_error = None
    await session.reset()
    assert session.take_dropped() == (DroppedEvents((5,), DropReason.FAILED, "reset failed: RuntimeError: rpc down"),)


# -- the duplicate window -----------------------------------------------------------------------------------------


async def test_duplicates_are_answered_without_replacing_the_pending_event() -> None:
    session, consumer, _ = make(max_pending=2)
    await session.accept_event(prompt(1, "original"))
    answer = await session.accept_event(prompt(1, "changed"))
    assert answer.status is EventAcceptanceStatus.DUPLICATE
    assert answer.pending_event_count == 1
    assert answer.session_id == "w"
    assert answer.event_id == 1
    await session.accept_event(prompt(2))
    # a full queue still answers duplicates (they take no room)
    assert (await session.accept_event(prompt(2))).status is EventAcceptanceStatus.DUPLICATE
    await session.next_chunk()
    assert consumer.ticks[0].prompt == "p"
    assert session.prompt == "p"
    assert consumer.ticks[0].applied_event_ids == (1, 2)


async def test_duplicate_window_holds_the_last_max_pending_ids() -> None:
    session, _, _ = make(max_pending=2)
    for event_id in (1, 2, 3):
        await session.accept_event(prompt(event_id))
        await session.next_chunk()
    # 1 left the window (it holds 2 and 3): a re-send of 1 is stale, of 2 or 3 a duplicate
    with pytest.raises(StaleEventError, match="event_id 1 is stale; the session event floor is 3"):
        await session.accept_event(prompt(1))
    for event_id in (2, 3):
        assert (await session.accept_event(prompt(event_id))).status is EventAcceptanceStatus.DUPLICATE
    stats = session.stats
    assert (stats.accepted, stats.duplicate, stats.stale, stats.applied, stats.chunks) == (3, 2, 1, 3, 3)


# -- the validator hook ---------------------------------------------------------------------------------------------


class Validator:
    def __init__(self) -> None:
        self.seen: list[tuple[ControlInput, ...]] = []

    def validate_controls(self, controls: Sequence[ControlInput]) -> None:
        self.seen.append(tuple(controls))
        for item in controls:
            if item.data.get("speed", 0) > 10:
                raise ValueError(f"control {item.track!r} ({item.schema}): speed {item.data['speed']} exceeds 10")


async def test_validator_refuses_at_acceptance_and_is_counted() -> None:
    validator = Validator()
    session, consumer, _ = make(control_validator=validator)
    bad = SessionEvent(1, prompt="x", controls=(control("move", speed=99), control("cam", x=0)))
    with pytest.raises(
        InvalidEventError, match=r"event 1 refused: control 'move' \(test.move.v1\): speed 99"
    ) as caught:
        await session.accept_event(bad)
    assert caught.value.code == "invalid_control"
    assert isinstance(caught.value.__cause__, ValueError)
    assert session.pending_event_count == 0
    assert session.stats.invalid == 1
    assert session.stats.accepted == 0
    # refused whole: neither its prompt nor its other control is kept, and its id is free for a fixed event
    fixed = SessionEvent(1, controls=(control("move", speed=3),))
    assert (await session.accept_event(fixed)).status is EventAcceptanceStatus.ACCEPTED
    await session.accept_event(prompt(2))  # no controls: the validator is not asked
    assert validator.seen == [bad.controls, fixed.controls]
    await session.next_chunk()
    assert consumer.ticks[0].applied_event_ids == (1, 2)
    assert consumer.ticks[0].prompt == "p"


async def test_validator_errors_other_than_value_errors_propagate_uncounted() -> None:
    class Broken:
        def validate_controls(self, controls: Sequence[ControlInput]) -> None:
            raise KeyError("bug in the validator")

    session, _, _ = make(control_validator=Broken())
    with pytest.raises(KeyError):
        await session.accept_event(SessionEvent(1, controls=(control("cam", x=0),)))
    assert session.stats.invalid == 0
    assert session.pending_event_count == 0


# -- stats -----------------------------------------------------------------------------------------------------------


async def test_stats_count_every_answer_and_measure_latency() -> None:
    session, consumer, _ = make(max_pending=2)
    assert session.stats == SessionStats()
    await session.accept_event(prompt(1))
    await session.accept_event(prompt(1))
    await session.accept_event(prompt(2))
    with pytest.raises(EventQueueFullError):
        await session.accept_event(prompt(3))
    await session.next_chunk()
    with pytest.raises(StaleEventError):
        await session.accept_event(prompt(0))
    await session.accept_event(prompt(5))
    await fail_with(session, consumer, RuntimeError("x"))
    await session.reset()
    await session.accept_event(prompt(6))
    await session.next_chunk()
    stats = session.stats
    assert stats.accepted == 4
    assert stats.duplicate == 1
    assert stats.stale == 1
    assert stats.invalid == 0
    assert stats.rejected_full == 1
    assert stats.applied == 3
    assert stats.dropped == 1
    assert stats.chunks == 2
    assert stats.failures == 1
    assert stats.resets == 1
    assert stats.applied_latency.count == 3
    assert sum(stats.applied_latency.counts) == 3
    assert 0 <= stats.applied_latency.total < 5
    # a snapshot does not move with the session
    await session.accept_event(prompt(7))
    assert stats.accepted == 4
    assert session.stats.accepted == 5


async def test_stats_duplicate_and_stale_counts() -> None:
    session, _, _ = make(max_pending=1)
    await session.accept_event(prompt(1))
    await session.next_chunk()
    await session.accept_event(prompt(2))
    await session.next_chunk()
    assert (await session.accept_event(prompt(2))).status is EventAcceptanceStatus.DUPLICATE
    with pytest.raises(StaleEventError):
        await session.accept_event(prompt(1))
    assert (session.stats.duplicate, session.stats.stale) == (1, 1)


# -- reducer -------------------------------------------------------------------------------------------------------


class Reducer:
    def __init__(self) -> None:
        self.prepared: list[tuple[Mapping[str, ControlInput], tuple[int, ...], int]] = []
        self.committed: list[PreparedControls] = []
        self.resets = 0
        self.commit_error: BaseException | None = None
        self.on_commit: Any = None
        self.result: Any = None

    def prepare(
        self, *, current_controls: Mapping[str, ControlInput], events: Sequence[SessionEvent], chunk_index: int
    ) -> PreparedControls:
        self.prepared.append((dict(current_controls), tuple(e.event_id for e in events), chunk_index))
        if self.result is not None:
            return self.result  # type: ignore[no-any-return]
        latest: dict[str, ControlInput] = dict(current_controls)
        for event in events:
            for item in event.controls:
                latest[item.track] = item
        return PreparedControls(tuple(latest.values()), private_state=len(self.prepared))

    def commit(self, prepared: PreparedControls) -> None:
        if self.on_commit is not None:
            self.on_commit()
        if self.commit_error is not None:
            raise self.commit_error
        self.committed.append(prepared)

    def reset(self) -> None:
        self.resets += 1


async def test_reducer_prepares_from_committed_controls_and_commits_with_the_chunk() -> None:
    reducer = Reducer()
    session, consumer, _ = make(control_reducer=reducer)
    zoom, cam = control("zoom", z=2), control("cam", x=1)
    await session.accept_event(SessionEvent(2, controls=(zoom,)))
    await session.accept_event(SessionEvent(1, controls=(cam,)))
    await session.next_chunk()
    assert reducer.prepared == [({}, (1, 2), 0)]
    assert [c.track for c in consumer.ticks[0].controls] == ["cam", "zoom"]
    assert reducer.committed[0].private_state == 1
    await session.next_chunk()
    assert reducer.prepared[1] == ({"cam": cam, "zoom": zoom}, (), 1)
    await session.reset()
    assert reducer.resets == 1


@pytest.mark.parametrize(
    ("result", "error", "message"),
    [
        ("not prepared", TypeError, "must return PreparedControls"),
        (PreparedControls(({"track": "x"},)), TypeError, "must contain ControlInput values"),  # type: ignore[arg-type]
        (PreparedControls((control("a", v=1), control("a", v=2))), ValueError, "at most one value per track"),
    ],
)
async def test_a_bad_reducer_snapshot_is_refused_before_the_tick(result: Any, error: type, message: str) -> None:
    reducer = Reducer()
    reducer.result = result
    session, consumer, lifecycle = make(control_reducer=reducer)
    await session.accept_event(prompt(1))
    with pytest.raises(error, match=message):
        await session.next_chunk()
    # as in the seed: nothing ran, nothing failed, the event waits
    assert consumer.ticks == []
    assert lifecycle.calls == []
    assert session.status is SessionStatus.ACTIVE
    assert session.event_floor == -1
    assert session.pending_event_count == 1


# -- the manager -----------------------------------------------------------------------------------------------------


def make_manager(**kwargs: Any) -> tuple[SessionManager[Any], Consumer, Lifecycle]:
    consumer, lifecycle = Consumer(), Lifecycle()
    ids = iter(f"gen-{n}" for n in range(100))
    manager: SessionManager[Any] = SessionManager(
        tick_consumer=consumer,
        lifecycle=lifecycle,
        max_pending_events=2,
        session_id_factory=lambda: next(ids),
        **kwargs,
    )
    return manager, consumer, lifecycle


async def test_manager_creates_finds_and_lists_sessions() -> None:
    manager, _, lifecycle = make_manager()
    generated = await manager.create_session()
    named = await manager.create_session("named")
    assert generated.session_id == "gen-0"
    assert await manager.get_session("named") is named
    assert len(manager) == 2
    assert list(manager) == [generated, named]
    assert named.max_pending_events == 2
    with pytest.raises(SessionStateError, match="'named' already exists"):
        await manager.create_session("named")
    with pytest.raises(SessionStateError, match="'ghost' does not exist"):
        await manager.get_session("ghost")
    with pytest.raises(SessionStateError, match="'ghost' does not exist"):
        await manager.reset_session("ghost")
    with pytest.raises(SessionStateError, match="'ghost' does not exist"):
        await manager.close_session("ghost")
    with pytest.raises(SessionStateError, match="'ghost' does not exist"):
        await manager.disconnect("ghost")
    assert lifecycle.calls == []
    with pytest.raises(ValueError, match="max_pending_events must be a positive integer"):
        SessionManager(tick_consumer=Consumer(), lifecycle=Lifecycle(), max_pending_events=0)


async def test_manager_passes_the_validator_and_a_reducer_per_session() -> None:
    reducers: list[Reducer] = []

    def reducer_factory() -> Reducer:
        reducers.append(Reducer())
        return reducers[-1]

    manager, _, lifecycle = make_manager(control_validator=Validator(), control_reducer_factory=reducer_factory)
    first = await manager.create_session("a")
    second = await manager.create_session("b")
    lifecycle.session = first
    assert len(reducers) == 2
    with pytest.raises(InvalidEventError):
        await second.accept_event(SessionEvent(1, controls=(control("move", speed=11),)))
    await first.accept_event(SessionEvent(1, controls=(control("move", speed=1),)))
    await first.next_chunk()
    assert len(reducers[0].committed) == 1
    assert reducers[1].committed == []


async def test_manager_stats_include_closed_sessions() -> None:
    manager, _, lifecycle = make_manager()
    first = await manager.create_session("a")
    second = await manager.create_session("b")
    lifecycle.session = first
    await first.accept_event(prompt(1))
    await first.next_chunk()
    await first.accept_event(prompt(2))
    await second.accept_event(prompt(1))
    with pytest.raises(StaleEventError):
        await first.accept_event(prompt(1 - 1))
    await manager.close_session("a")
    assert len(manager) == 1
    with pytest.raises(SessionStateError, match="does not exist"):
        await manager.get_session("a")
    total = manager.stats()
    assert total == first.stats + second.stats
    assert (total.accepted, total.applied, total.dropped, total.stale, total.chunks) == (3, 1, 1, 1, 1)
    # closing again through a session object the manager forgot changes nothing
    await first.close()
    assert manager.stats() == total
    # a recreated id is a new session whose counts add on
    lifecycle.session = await manager.create_session("a")
    await lifecycle.session.accept_event(prompt(1))
    assert manager.stats().accepted == 4


async def test_manager_reset_and_disconnect_reach_the_session() -> None:
    manager, _, lifecycle = make_manager()
    session = await manager.create_session("a")
    lifecycle.session = session
    await session.accept_event(prompt(1))
    await manager.reset_session("a")
    assert session.take_dropped() == (DroppedEvents((1,), DropReason.RESET, "session reset"),)
    lifecycle.close_error = RuntimeError("busy")
    with pytest.raises(RuntimeError):
        await manager.disconnect("a")
    assert await manager.get_session("a") is session  # still registered: its cleanup is owed
    assert manager.stats() == session.stats
    lifecycle.close_error = None
    await manager.disconnect("a")
    assert len(manager) == 0
    assert session.status is SessionStatus.CLOSED
    assert manager.stats() == session.stats


async def test_concurrent_closes_retire_a_session_once() -> None:
    manager, consumer, lifecycle = make_manager()
    session = await manager.create_session("a")
    lifecycle.session = session
    consumer.gate = asyncio.Event()
    await session.accept_event(prompt(1))
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    closes = [asyncio.create_task(manager.close_session("a")) for _ in range(2)]
    await asyncio.sleep(0)
    consumer.gate.set()
    await tick
    await asyncio.gather(*closes)
    assert [call[0] for call in lifecycle.calls] == ["close"]
    assert manager.stats() == session.stats
    assert manager.stats().applied == 1
