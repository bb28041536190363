"""A hypothesis state machine over the whole control plane, on a real asyncio loop.

Rules interleave accept / next_chunk / cancel_chunk / reset / close on sessions and create / get /
reset / close / disconnect on their manager, with injected faults: the consumer raises (with and
without a code), returns mismatched metadata, is cancelled while a tick is in flight, refuses to
cancel a chunk; the lifecycle's reset or close fails. A second machine runs the same rules with
coalescing on for two of the three tracks, so newer events supersede queued held controls.
Ticks can be held in flight at a gate across rules, so accepts, other sessions' ticks and
queued resets/closes (real tasks waiting on the session's lock) interleave with them.

A model of each session predicts every answer. Invariants, checked after every rule and once more
after closing everything at the end:
- every accepted event is applied in exactly one committed chunk or reported in ``dropped_events``,
  never both, and (once its session is closed) never neither;
- the chunk indexes of ticks run 0, 1, 2, ... within each epoch;
- no tick holds an event at or below the floor before it;
- pending never exceeds the bound;
- statuses move only along ``TRANSITIONS`` (observed at every lifecycle call and tick, too);
- each session's counters, and the manager's aggregate, agree with what was observed.

Model updates happen inside the loop, in the order the operations really complete, so queued
operations are checked against the state they actually ran in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from worldserve import (
    TRANSITIONS,
    CancelUnsupportedError,
    ChunkCancelledError,
    ChunkMetadata,
    ChunkMetadataError,
    ControlInput,
    DroppedEvents,
    DropReason,
    EventAcceptance,
    EventAcceptanceStatus,
    EventQueueFullError,
    InvalidEventError,
    NothingToCancelError,
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

MAX_PENDING = 3
SESSION_IDS = ("w0", "w1", "w2")
TRACKS = ("cam", "keys", "mouse")
REFUSED_VALUE = 3  # the validator refuses a control whose data["v"] is this
OUTCOMES = ("ok",) * 6 + ("raise", "coded", "mismatch")
FAILURE_CODES = {
    "raise": "tick_failed",
    "coded": "model_oom",
    "mismatch": "metadata_mismatch",
    "cancelled": "cancelled",
}
FAILURES = {
    "raise": "RuntimeError: tick failed",
    "coded": "ModelOOM: out of memory",
    "mismatch": "ChunkMetadataError: Tick consumer metadata does not match the submitted tick",
    "cancelled": "CancelledError: ",
}
sometimes = st.sampled_from((False, False, False, True))


class ModelOOM(RuntimeError):
    code = "model_oom"


@dataclass
class LifecycleCall:
    method: str
    status: SessionStatus
    failed: bool


@dataclass
class Model:
    """What one session must be, predicted from the operations that completed on it."""

    session: Session[Any]
    sid: str
    status: SessionStatus = SessionStatus.ACTIVE
    pending: dict[int, SessionEvent] = field(default_factory=dict)
    accepted: set[int] = field(default_factory=set)
    applied: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)
    window: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_PENDING))
    floor: int = -1
    settled: int = -1  # the floor as commits, resets and closes move it (superseding moves only ``floor``)
    inflight: TickRequest | None = None
    through: int | None = None  # the next tick takes the pending events up to this id (None: all)
    #: The most events that may be pending: the bound, or more right after a retract put an undone
    #: chunk's events back (acceptance then refuses until chunks apply them; nothing else adds).
    most_pending: int = MAX_PENDING
    outcome: str | None = None
    next_index: int = 0
    epoch: int = 0
    committed_indexes: list[list[int]] = field(default_factory=lambda: [[]])
    prompt: str | None = None
    controls: dict[str, ControlInput] = field(default_factory=dict)
    failure_code: str | None = None
    failure: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    statuses: list[SessionStatus] = field(default_factory=lambda: [SessionStatus.ACTIVE])
    calls: list[LifecycleCall] = field(default_factory=list)
    gate: asyncio.Future[str] | None = None
    tick_task: asyncio.Task[None] | None = None
    #: The last commit while retract_chunk may undo it: its tick, its events, and what it replaced
    #: (prompt, controls, settled floor); None once a tick starts, or after a reset, close or failure.
    last: tuple[TickRequest, dict[int, SessionEvent], str | None, dict[str, ControlInput], int] | None = None

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    @property
    def effective_floor(self) -> int:
        if self.inflight is not None and self.inflight.applied_event_ids:
            return max(self.floor, self.inflight.applied_event_ids[-1])
        return self.floor

    def see(self, status: SessionStatus) -> None:
        if status is not self.statuses[-1]:
            self.statuses.append(status)

    def take_calls(self) -> list[LifecycleCall]:
        calls, self.calls = self.calls, []
        return calls

    def drop_pending(self, reason: DropReason, detail: str) -> tuple[DroppedEvents, ...]:
        """Apply a successful reset's or close's drop; return the record the session must have made."""
        if not self.pending:
            return ()
        ids = tuple(sorted(self.pending))
        assert not self.dropped & set(ids)
        self.dropped.update(ids)
        self.count("dropped", len(ids))
        self.floor = max(self.floor, ids[-1])
        self.settled = max(self.settled, ids[-1])
        self.pending.clear()
        return (DroppedEvents(ids, reason, detail),)


class Consumer:
    """The tick consumer all sessions share; it reports every tick to the machine before running it."""

    def __init__(self, machine: ControlPlaneMachine) -> None:
        self.machine = machine
        self.plan: dict[str, str] = {}  # session id -> "gate" or an outcome, for its next tick

    async def execute_tick(self, tick: TickRequest) -> ChunkMetadata:
        model = self.machine.on_tick(tick)
        plan = self.plan.pop(tick.session_id)
        if plan == "gate":
            model.gate = asyncio.get_running_loop().create_future()
            try:
                plan = await model.gate
            except asyncio.CancelledError:
                model.outcome = "cancelled"
                raise
            finally:
                model.gate = None
        model.outcome = plan
        if plan == "cancel_chunk":
            raise ChunkCancelledError(f"chunk {tick.chunk_index} cancelled")
        if plan == "raise":
            raise RuntimeError("tick failed")
        if plan == "coded":
            raise ModelOOM("out of memory")
        metadata = ChunkMetadata.from_tick(tick)
        if plan == "mismatch":
            return replace(metadata, chunk_index=metadata.chunk_index + 1)
        return metadata

    def chunk_metadata(self, output: ChunkMetadata) -> ChunkMetadata:
        return output

    async def retract_tick(self, tick: TickRequest) -> None:
        if self.refuse_cancel:
            raise CancelUnsupportedError("cannot roll back")

    def cancel_tick(self, tick: TickRequest) -> None:
        model = self.machine.current[tick.session_id]
        if model.gate is None or model.gate.done():
            raise NothingToCancelError("not in flight")
        if self.refuse_cancel:
            raise CancelUnsupportedError("cannot roll back")
        model.gate.set_result("cancel_chunk")

    refuse_cancel = False


class Lifecycle:
    def __init__(self, machine: ControlPlaneMachine) -> None:
        self.machine = machine
        self.fail_reset: dict[str, bool] = {}
        self.fail_close: dict[str, bool] = {}

    async def reset_session(self, session_id: str) -> None:
        if self.machine.on_lifecycle("reset", session_id, self.fail_reset.get(session_id, False)):
            raise RuntimeError("reset rpc failed")

    async def close_session(self, session_id: str) -> None:
        if self.machine.on_lifecycle("close", session_id, self.fail_close.get(session_id, False)):
            raise RuntimeError("close rpc failed")


class Validator:
    def validate_controls(self, controls: Sequence[ControlInput]) -> None:
        for control in controls:
            if control.data.get("v") == REFUSED_VALUE:
                raise ValueError(f"control {control.track!r}: v={REFUSED_VALUE} is not allowed")


class ControlPlaneMachine(RuleBasedStateMachine):
    #: The tracks on which a newer event supersedes queued ones in a full queue (none: the seed's behaviour).
    COALESCE: frozenset[str] = frozenset()

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.consumer = Consumer(self)
        self.lifecycle = Lifecycle(self)
        self.manager: SessionManager[ChunkMetadata] = SessionManager(
            tick_consumer=self.consumer,
            lifecycle=self.lifecycle,
            max_pending_events=MAX_PENDING,
            control_validator=Validator(),
            coalesce_tracks=self.COALESCE,
        )
        self.current: dict[str, Model] = {}  # the latest session created under each id
        self.registered: dict[str, Model] = {}  # what the manager must hold
        self.models: list[Model] = []  # every session ever created
        self.tasks: list[asyncio.Task[None]] = []
        self.task_models: dict[asyncio.Task[None], Model] = {}

    # -- running things on the loop ----------------------------------------------------------------------------

    def spawn(self, model: Model, operation: Coroutine[Any, Any, Any], done: Any) -> asyncio.Task[None]:
        """Run ``operation`` on ``model``'s session as a task; ``done(result, error)`` checks it as it ends."""

        async def run() -> None:
            try:
                result = await operation
            except BaseException as error:  # every outcome, cancellation included, is checked
                done(None, error)
            else:
                done(result, None)

        task = self.loop.create_task(run())
        self.tasks.append(task)
        self.task_models[task] = model
        return task

    def pump(self) -> None:
        """Run the loop until every task is done or waits behind a tick held at its gate."""
        for _ in range(500):
            self.loop.run_until_complete(asyncio.sleep(0))
            if all(task.done() for task in self.tasks if not self._held(task)):
                break
        else:
            raise AssertionError("the control plane stopped making progress")
        for task in [task for task in self.tasks if task.done()]:
            self.tasks.remove(task)
            del self.task_models[task]
            task.result()  # a failed check inside a task surfaces here

    def _held(self, task: asyncio.Task[None]) -> bool:
        """Whether ``task`` is its session's tick waiting at its gate, or an operation queued behind it."""
        gate = self.task_models[task].gate
        return gate is not None and not gate.done()

    def run_now(self, operation: Coroutine[Any, Any, Any]) -> tuple[Any, BaseException | None]:
        """Run an operation that must answer at once (accept, create, get)."""
        try:
            return self.loop.run_until_complete(operation), None
        except Exception as error:  # checked by the caller
            return None, error

    # -- callbacks from inside the loop --------------------------------------------------------------------------

    def on_tick(self, tick: TickRequest) -> Model:
        model = self.current[tick.session_id]
        session = model.session
        assert session.status is SessionStatus.ACTIVE
        model.see(SessionStatus.ACTIVE)
        assert model.inflight is None, "two ticks of one session at once"
        assert tick.chunk_index == model.next_index, (tick.chunk_index, model.next_index)
        ids = tick.applied_event_ids
        through = model.through
        taken = tuple(sorted(i for i in model.pending if through is None or i <= through))
        assert ids == taken, "a tick must take every pending event (up to `through`), in id order"
        if ids:
            # Superseding moves the floor past the ids it drops, while lower ids may stay pending.
            assert ids[0] > model.settled, f"tick holds {ids[0]} at or below the floor {model.settled}"
        prompt, controls = model.prompt, dict(model.controls)
        for event_id in ids:
            event = model.pending[event_id]
            if event.prompt is not None:
                prompt = event.prompt
            for control in event.controls:
                controls[control.track] = control
        assert tick.prompt == prompt
        assert len(tick.controls) == len(controls)
        for got, track in zip(tick.controls, sorted(controls), strict=True):
            assert got is controls[track], "controls are shared, last one per track, ordered by track"
        model.inflight = tick
        model.last = None  # this step replaces the worker's undo record
        return model

    def on_lifecycle(self, method: str, session_id: str, fail: bool) -> bool:
        model = self.current[session_id]
        status = model.session.status
        model.see(status)
        model.calls.append(LifecycleCall(method, status, fail))
        return fail

    # -- completions ----------------------------------------------------------------------------------------------

    def tick_done(self, model: Model, result: Any, error: BaseException | None) -> None:
        tick, model.inflight = model.inflight, None
        model.tick_task = None
        if tick is None:  # refused before it ran
            assert isinstance(error, SessionStateError), error
            assert model.status is not SessionStatus.ACTIVE
            assert model.take_calls() == []
            return
        outcome, model.outcome = model.outcome, None
        calls = model.take_calls()
        if outcome == "cancel_chunk":
            assert type(error) is ChunkCancelledError, error
            assert calls == []
            assert model.session.status is SessionStatus.ACTIVE
            model.count("cancelled")  # nothing committed; its events stay pending
        elif outcome == "ok":
            assert error is None, error
            assert result == ChunkMetadata.from_tick(tick)
            assert calls == []
            events = {event_id: model.pending[event_id] for event_id in tick.applied_event_ids}
            model.last = (tick, events, model.prompt, dict(model.controls), model.settled)
            for event_id in tick.applied_event_ids:
                assert event_id not in model.applied
                assert event_id not in model.dropped
                del model.pending[event_id]
                model.applied.add(event_id)
            if tick.applied_event_ids:
                model.floor = max(model.floor, tick.applied_event_ids[-1])
                model.settled = tick.applied_event_ids[-1]
            model.prompt = tick.prompt
            model.controls = {control.track: control for control in tick.controls}
            model.committed_indexes[-1].append(tick.chunk_index)
            model.most_pending = max(MAX_PENDING, len(model.pending))
            model.next_index += 1
            model.count("chunks")
        else:
            assert outcome is not None
            assert [(call.method, call.status) for call in calls] == [("close", SessionStatus.FAILED)], calls
            if calls[0].failed:
                assert type(error) is SessionError, error
                assert "worker session cleanup also failed" in str(error)
            else:
                expected = {
                    "raise": RuntimeError,
                    "coded": ModelOOM,
                    "mismatch": ChunkMetadataError,
                    "cancelled": asyncio.CancelledError,
                }[outcome]
                assert type(error) is expected, (outcome, error)
            model.status = SessionStatus.FAILED
            model.failure_code = FAILURE_CODES[outcome]
            model.failure = model.session.failure
            assert model.failure is not None
            assert model.failure.startswith(FAILURES[outcome]), (model.failure, outcome)
            model.count("failures")
        model.see(model.session.status)

    def reset_done(self, model: Model, error: BaseException | None) -> None:
        calls = model.take_calls()
        if model.status not in (SessionStatus.ACTIVE, SessionStatus.FAILED):
            assert isinstance(error, SessionStateError), error
            assert calls == []
            return
        assert [(call.method, call.status) for call in calls] == [("reset", SessionStatus.RESETTING)], calls
        if calls[0].failed:
            assert type(error) is RuntimeError, error
            model.status = SessionStatus.FAILED
            model.failure_code = "reset_failed"
            model.failure = "reset failed: RuntimeError: reset rpc failed"
            model.count("failures")
        else:
            assert error is None, error
            if model.failure is not None:
                expected = model.drop_pending(DropReason.FAILED, model.failure)
            else:
                expected = model.drop_pending(DropReason.RESET, "session reset")
            assert model.session.take_dropped() == expected
            model.prompt, model.controls = None, {}
            model.next_index = 0
            model.epoch += 1
            model.last = None
            model.committed_indexes.append([])
            model.failure_code = model.failure = None
            model.status = SessionStatus.ACTIVE
            model.count("resets")
        model.see(model.session.status)

    def close_done(self, model: Model, error: BaseException | None, through_manager: bool) -> None:
        calls = model.take_calls()
        if model.status is SessionStatus.CLOSED:
            assert error is None, error
            assert calls == []
        else:
            assert [(call.method, call.status) for call in calls] == [("close", SessionStatus.CLOSING)], calls
            if calls[0].failed:
                assert type(error) is RuntimeError, error
                model.status = SessionStatus.CLEANUP_FAILED
            else:
                assert error is None, error
                if model.failure is not None:
                    expected = model.drop_pending(DropReason.FAILED, model.failure)
                else:
                    expected = model.drop_pending(DropReason.CLOSED, "session closed")
                assert model.session.take_dropped() == expected
                model.prompt, model.controls = None, {}
                model.status = SessionStatus.CLOSED
                model.last = None
        if through_manager and model.status is SessionStatus.CLOSED and self.registered.get(model.sid) is model:
            del self.registered[model.sid]
        model.see(model.session.status)

    # -- rules ------------------------------------------------------------------------------------------------------

    def _pick(self, data: st.DataObject, candidates: Sequence[Model] | None = None, active: bool = True) -> Model:
        """A session to act on: with ``active``, mostly an active one; else (or sometimes) any, closed included."""
        pool = list(self.current.values()) if candidates is None else list(candidates)
        live = [model for model in pool if model.status is SessionStatus.ACTIVE]
        if active and live and data.draw(st.sampled_from((True, True, True, True, False)), label="active"):
            pool = live
        return data.draw(st.sampled_from(sorted(pool, key=lambda model: model.sid)), label="session")

    @precondition(lambda self: len(self.registered) < len(SESSION_IDS))
    @rule(data=st.data())
    def create(self, data: st.DataObject) -> None:
        """Mostly a free id; sometimes one in use, which the manager must refuse."""
        free = [sid for sid in SESSION_IDS if sid not in self.registered]
        taken = sorted(self.registered)
        pool = free if not taken or data.draw(st.sampled_from((True, True, True, False)), label="free") else taken
        sid = data.draw(st.sampled_from(pool), label="id")
        session, error = self.run_now(self.manager.create_session(sid))
        if sid in self.registered:
            assert isinstance(error, SessionStateError), error
            assert "already exists" in str(error)
            return
        assert error is None, error
        assert session.session_id == sid
        model = Model(session, sid)
        self.current[sid] = self.registered[sid] = model
        self.models.append(model)

    @precondition(lambda self: self.current)
    @rule(
        data=st.data(),
        events=st.lists(
            st.tuples(
                st.sampled_from((-5, -2, -1, 0, 1, 1, 2, 2, 3)),
                st.none() | st.sampled_from(("forest", "desert")),
                st.dictionaries(st.sampled_from(TRACKS), st.integers(0, REFUSED_VALUE), max_size=2),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def accept(self, data: st.DataObject, events: list[tuple[int, str | None, dict[str, int]]]) -> None:
        """A burst of 1-4 events for one session, ids near the newest one, so duplicates and stale ones occur."""
        model = self._pick(data)
        for offset, prompt, controls in events:
            self._accept_one(model, offset, prompt, controls)

    def _accept_one(self, model: Model, offset: int, prompt: str | None, controls: dict[str, int]) -> None:
        event_id = max(0, max([model.floor, *model.accepted]) + offset)
        event = SessionEvent(
            event_id,
            prompt=prompt if prompt is not None or controls else "default",
            controls=tuple(ControlInput(track, f"test.{track}.v1", {"v": v}) for track, v in sorted(controls.items())),
        )
        answer, error = self.run_now(model.session.accept_event(event))
        if model.status is not SessionStatus.ACTIVE:
            assert isinstance(error, SessionStateError), error
        elif event_id in model.pending or event_id in model.window:
            assert answer == EventAcceptance(model.sid, event_id, EventAcceptanceStatus.DUPLICATE, len(model.pending))
            model.count("duplicate")
        elif event_id <= model.effective_floor:
            assert isinstance(error, StaleEventError), error
            assert f"floor is {model.effective_floor}" in str(error)
            model.count("stale")
        elif not (superseded := self._superseded(model, event)) and len(model.pending) >= MAX_PENDING:
            assert isinstance(error, EventQueueFullError), error
            model.count("rejected_full")
        elif REFUSED_VALUE in controls.values():
            assert isinstance(error, InvalidEventError), error
            assert error.code == "invalid_control"
            model.count("invalid")
        else:
            assert error is None, error
            if superseded:
                for old in superseded:
                    del model.pending[old]
                model.dropped.update(superseded)
                model.floor = max(model.floor, superseded[-1])
                model.count("dropped", len(superseded))
                model.count("superseded", len(superseded))
                detail = f"superseded by event {event_id}"
                expected = (DroppedEvents(superseded, DropReason.SUPERSEDED, detail, event_id),)
                assert model.session.take_dropped() == expected
            model.pending[event_id] = event
            model.accepted.add(event_id)
            model.window.append(event_id)
            assert answer == EventAcceptance(model.sid, event_id, EventAcceptanceStatus.ACCEPTED, len(model.pending))

    def _superseded(self, model: Model, event: SessionEvent) -> tuple[int, ...]:
        """The pending events ``event`` would supersede (the model's own reading of the rule)."""
        tracks = {control.track for control in event.controls} & self.COALESCE
        if not tracks:
            return ()
        in_flight = set(model.inflight.applied_event_ids) if model.inflight is not None else set()
        return tuple(
            old_id
            for old_id, old in sorted(model.pending.items())
            if old_id not in in_flight
            and old_id > model.floor  # pending again after a retract: applied again, never superseded
            and old_id < event.event_id
            and old.prompt is None
            and {control.track for control in old.controls} <= tracks
        )

    def _idle(self) -> list[Model]:
        return [model for model in self.current.values() if model.tick_task is None]

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES), cleanup_fails=sometimes)
    def next_chunk(self, data: st.DataObject, outcome: str, cleanup_fails: bool) -> None:
        """One tick, run to its end at once."""
        model = self._pick(data, self._idle())
        self.consumer.plan[model.sid] = outcome
        self.lifecycle.fail_close[model.sid] = cleanup_fails
        self._tick(model, self._through(data, model))
        assert model.tick_task is None

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def start_tick(self, data: st.DataObject) -> None:
        """One tick, held in flight at its gate until finish_tick or cancel_tick."""
        model = self._pick(data, self._idle())
        self.consumer.plan[model.sid] = "gate"
        self._tick(model, self._through(data, model))

    def _through(self, data: st.DataObject, model: Model) -> int | None:
        """Most ticks take every pending event; some only those up to an id (a preemption's chunk made again)."""
        return data.draw(st.one_of(st.none(), st.sampled_from([-1, *sorted(model.pending)])), label="through")

    def _tick(self, model: Model, through: int | None = None) -> None:
        model.through = through
        model.tick_task = self.spawn(
            model,
            model.session.next_chunk(through=through),
            lambda result, error: self.tick_done(model, result, error),
        )
        self.pump()
        self.consumer.plan.pop(model.sid, None)  # unused if the session refused to tick

    def _in_flight(self) -> list[Model]:
        return [model for model in self.current.values() if model.gate is not None and not model.gate.done()]

    @precondition(lambda self: self._in_flight())
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES), cleanup_fails=sometimes)
    def finish_tick(self, data: st.DataObject, outcome: str, cleanup_fails: bool) -> None:
        model = data.draw(st.sampled_from(self._in_flight()), label="in flight")
        self.lifecycle.fail_close[model.sid] = cleanup_fails
        assert model.gate is not None
        model.gate.set_result(outcome)
        self.pump()

    @precondition(lambda self: self._in_flight())
    @rule(data=st.data(), cleanup_fails=sometimes)
    def cancel_tick(self, data: st.DataObject, cleanup_fails: bool) -> None:
        model = data.draw(st.sampled_from(self._in_flight()), label="in flight")
        self.lifecycle.fail_close[model.sid] = cleanup_fails
        assert model.tick_task is not None
        model.tick_task.cancel()
        self.pump()

    @precondition(lambda self: self.current)
    @rule(data=st.data(), refuse=sometimes)
    def cancel_chunk(self, data: st.DataObject, refuse: bool) -> None:
        """chunk.cancel: a chunk in flight is cancelled (or refused, changing nothing); else nothing to cancel."""
        model = self._pick(data, active=False)
        held = model.gate is not None and not model.gate.done()
        in_flight = model.inflight.chunk_index if model.inflight is not None else None
        self.consumer.refuse_cancel = refuse
        index, error = self.run_now(model.session.cancel_chunk())
        self.consumer.refuse_cancel = False
        if model.status is not SessionStatus.ACTIVE:
            assert isinstance(error, SessionStateError), error
        elif not held:
            assert isinstance(error, NothingToCancelError), error
            assert error.code == "nothing_to_cancel"
        elif refuse:
            assert isinstance(error, CancelUnsupportedError), error
            assert error.code == "cancel_unsupported"
            assert model.gate is not None
            assert not model.gate.done()
        else:
            assert error is None, error
            assert index == in_flight is not None
        self.pump()

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), refuse=sometimes)
    def retract_chunk(self, data: st.DataObject, refuse: bool) -> None:
        """A preemption: the last commit undone (or refused, changing nothing); else nothing to undo."""
        model = self._pick(data, self._idle())
        self.consumer.refuse_cancel = refuse
        tick, error = self.run_now(model.session.retract_chunk())
        self.consumer.refuse_cancel = False
        if model.status is not SessionStatus.ACTIVE:
            assert isinstance(error, SessionStateError), error
        elif model.last is None:
            assert isinstance(error, NothingToCancelError), error
        elif refuse:
            assert isinstance(error, CancelUnsupportedError), error
            assert model.session.chunk_retractable == model.last[0].chunk_index  # still possible
        else:
            assert error is None, error
            last, events, prompt, controls, settled = model.last
            assert tick is last
            model.last = None
            for event_id, event in events.items():
                model.applied.remove(event_id)
                model.pending[event_id] = event
            model.prompt, model.controls, model.settled = prompt, controls, settled
            model.most_pending = max(MAX_PENDING, len(model.pending))
            assert model.committed_indexes[-1].pop() == last.chunk_index
            model.next_index -= 1
            model.count("retracted")
            model.count("unapplied", len(events))
        self.pump()

    @precondition(lambda self: self.current)
    @rule(
        data=st.data(),
        operation=st.sampled_from(
            ("reset", "reset", "manager.reset_session", "close", "manager.close_session", "manager.disconnect")
        ),
        fails=sometimes,
    )
    def reset_or_close(self, data: st.DataObject, operation: str, fails: bool) -> None:
        """A reset or a close, on the session or through the manager; queued if a tick is in flight."""
        model = self._pick(data, active=False)
        through_manager = operation.startswith("manager.")
        if through_manager and self.registered.get(model.sid) is not model:
            self._expect_unknown(getattr(self.manager, operation.removeprefix("manager."))(model.sid))
            return
        if operation.endswith("reset") or operation.endswith("reset_session"):
            self.lifecycle.fail_reset[model.sid] = fails
            call = self.manager.reset_session(model.sid) if through_manager else model.session.reset()
            self.spawn(model, call, lambda _, error: self.reset_done(model, error))
        else:
            self.lifecycle.fail_close[model.sid] = fails
            if operation == "close":
                call = model.session.close()
            else:
                call = getattr(self.manager, operation.removeprefix("manager."))(model.sid)
            self.spawn(model, call, lambda _, error: self.close_done(model, error, through_manager))
        self.pump()

    def _expect_unknown(self, operation: Coroutine[Any, Any, Any]) -> None:
        _, error = self.run_now(operation)
        assert isinstance(error, SessionStateError), error
        assert "does not exist" in str(error)

    # -- invariants -------------------------------------------------------------------------------------------------

    @invariant()
    def sessions_match_their_models(self) -> None:
        for model in self.models:
            session = model.session
            assert session.status is model.status, (session.status, model.status)
            assert session.chunk_index == model.next_index
            assert session.epoch == model.epoch
            assert session.pending_event_count == len(model.pending) <= model.most_pending
            assert session.event_floor == model.effective_floor
            assert session.failure_code == model.failure_code
            assert session.failure == model.failure
            assert session.prompt == model.prompt
            assert session.controls == tuple(model.controls[track] for track in sorted(model.controls))
            assert session.dropped_events == (), "a drop the model did not expect"

    @invariant()
    def every_accepted_event_is_applied_or_dropped_exactly_once(self) -> None:
        for model in self.models:
            pending = set(model.pending)
            assert not model.applied & model.dropped
            assert not pending & (model.applied | model.dropped)
            assert model.applied | model.dropped | pending == model.accepted
            if model.status is SessionStatus.CLOSED:
                assert not pending
                assert model.applied | model.dropped == model.accepted

    @invariant()
    def chunk_indexes_run_from_zero_in_each_epoch(self) -> None:
        for model in self.models:
            assert len(model.committed_indexes) == model.epoch + 1
            for indexes in model.committed_indexes:
                assert indexes == list(range(len(indexes)))

    @invariant()
    def statuses_move_only_along_transitions(self) -> None:
        for model in self.models:
            for before, after in zip(model.statuses, model.statuses[1:], strict=False):
                assert after in TRANSITIONS[before], (before, after, model.statuses)

    @invariant()
    def counters_agree_with_what_was_observed(self) -> None:
        total = SessionStats()
        for model in self.models:
            stats = model.session.stats
            observed = {name: model.counts.get(name, 0) for name in ("duplicate", "stale", "rejected_full", "invalid")}
            observed |= {
                name: model.counts.get(name, 0)
                for name in ("dropped", "superseded", "chunks", "cancelled", "failures", "resets")
            }
            observed |= {name: model.counts.get(name, 0) for name in ("retracted", "unapplied")}
            unapplied = model.counts.get("unapplied", 0)  # applied, undone, pending again: counted once more later
            observed |= {"accepted": len(model.accepted), "applied": len(model.applied) + unapplied}
            assert {name: getattr(stats, name) for name in observed} == observed
            assert stats.applied_latency.count == len(model.applied) + unapplied
            total = total + stats
        summed = self.manager.stats()
        # Latency totals are float sums: the manager adds them in another order than this loop.
        assert summed.applied_latency.total == pytest.approx(total.applied_latency.total)
        assert replace(summed, applied_latency=total.applied_latency) == total
        assert {session.session_id for session in self.manager} == set(self.registered)
        assert len(self.manager) == len(self.registered)

    @invariant()
    def the_manager_finds_exactly_the_registered_sessions(self) -> None:
        for sid in SESSION_IDS:
            session, error = self.run_now(self.manager.get_session(sid))
            if sid in self.registered:
                assert session is self.registered[sid].session
            else:
                assert isinstance(error, SessionStateError), error
                assert "does not exist" in str(error)

    # -- the end: everything still running finishes, everything closes ------------------------------------------

    def teardown(self) -> None:
        try:
            self.lifecycle.fail_close.clear()
            self.lifecycle.fail_reset.clear()
            for model in self._in_flight():
                assert model.gate is not None
                model.gate.set_result("ok")
            self.pump()
            assert not self.tasks
            for model in self.models:
                self.spawn(model, model.session.close(), lambda _, error, m=model: self.close_done(m, error, False))
                self.pump()
            for check in (
                self.sessions_match_their_models,
                self.every_accepted_event_is_applied_or_dropped_exactly_once,
                self.statuses_move_only_along_transitions,
                self.counters_agree_with_what_was_observed,
            ):
                check()
            assert all(model.status is SessionStatus.CLOSED for model in self.models)
        finally:
            for task in self.tasks:
                task.cancel()
            if self.tasks:
                self.loop.run_until_complete(asyncio.gather(*self.tasks, return_exceptions=True))
            self.loop.close()


ControlPlaneMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    derandomize=True,  # the same interleavings on every run and in CI
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestControlPlaneMachine = ControlPlaneMachine.TestCase


class CoalescingControlPlaneMachine(ControlPlaneMachine):
    """The same rules with ``cam`` and ``keys`` continuous (``mouse`` is not)."""

    COALESCE = frozenset({"cam", "keys"})


CoalescingControlPlaneMachine.TestCase.settings = ControlPlaneMachine.TestCase.settings
TestCoalescingControlPlaneMachine = CoalescingControlPlaneMachine.TestCase
