"""Preemption on input (issue 26, item 3): a chunk made without an input is made again with it.

Three layers, each driven as it is used:

- the control plane (``Session.retract_chunk``): the ledger stays exact (the undone chunk's
  events are pending again and applied once more, never lost or applied twice), and it fails
  closed when the backend cannot undo;
- the world (``WorldHost``) without sockets, on a clock the test moves: when an event
  preempts (the chunk made has not begun to play and can be made again in time, its worker
  has the headroom, once per chunk, ``--preempt off``), what the members are told
  (``supersedes``) and what is counted;
- real runtimes and a real server: the chunk made again equals the chunk a session that had
  the input in time makes (bit for bit), and under several sessions with random input the
  shown chunks apply every accepted event exactly once and replay from the journal exactly.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets
from pydantic import BaseModel

from server_harness import start_server
from worldserve.errors import CancelUnsupportedError, NothingToCancelError
from worldserve.media import FrameEncoding
from worldserve.models.base import ModelSpec
from worldserve.protocol import ChunkMetadata, ControlInput, TickRequest
from worldserve.runtime import Runtime
from worldserve.runtime.chunk import Chunk
from worldserve.runtime.journal import read_journal
from worldserve.runtime.metrics import Capacity
from worldserve.server.config import ServerConfig
from worldserve.server.host import Role, WorldHost, WorldHosts
from worldserve.server.messages import ChunkMessage
from worldserve.server.metrics import ServerMetrics
from worldserve.server.pacing import Lead, Pacer, Preempt
from worldserve.session import (
    EventQueueFullError,
    PreparedControls,
    Session,
    SessionEvent,
    SessionManager,
    SessionStatus,
)
from worldserve.tools.replay import replay


def _keys(*held: str) -> ControlInput:
    return ControlInput("keys", "worldserve.keys.v1", {"held": list(held)})


# -- the control plane ---------------------------------------------------------------------


class _Consumer:
    """Makes chunks at once; undoes the last one when asked (or refuses, or fails, as told)."""

    def __init__(self, retract: str = "ok") -> None:
        self.ticks: list[TickRequest] = []
        self.retracted: list[TickRequest] = []
        self.closed: list[str] = []
        self.retract = retract

    async def execute_tick(self, tick: TickRequest) -> ChunkMetadata:
        self.ticks.append(tick)
        return ChunkMetadata.from_tick(tick)

    def chunk_metadata(self, output: ChunkMetadata) -> ChunkMetadata:
        return output

    async def retract_tick(self, tick: TickRequest) -> None:
        if self.retract == "refuse":
            raise CancelUnsupportedError("cannot")
        if self.retract == "fail":
            raise RuntimeError("the worker lost the state")
        self.retracted.append(tick)

    async def reset_session(self, session_id: str) -> None:
        return None

    async def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)


def _session(consumer: _Consumer, **options: Any) -> Session[ChunkMetadata]:
    return Session("s", tick_consumer=consumer, lifecycle=consumer, max_pending_events=16, **options)


async def test_a_retracted_chunk_gives_its_events_back_and_the_next_chunk_applies_them_once_more() -> None:
    consumer = _Consumer()
    session = _session(consumer, coalesce_tracks=frozenset({"keys"}))
    await session.accept_event(SessionEvent(1, prompt="forest", controls=(_keys("W"),)))
    await session.next_chunk()  # chunk 0 applies 1
    await session.accept_event(SessionEvent(2, controls=(_keys("A"),)))
    made = await session.next_chunk()  # chunk 1 applies 2
    assert made.applied_event_ids == (2,)
    assert session.chunk_retractable == 1
    await session.accept_event(SessionEvent(3, controls=(_keys("D"),)))  # the input that preempts

    undone = await session.retract_chunk()
    assert undone.chunk_index == 1
    assert consumer.retracted == [undone]
    assert session.chunk_index == 1  # back before chunk 1
    assert session.pending_event_ids == (2, 3)  # its event is pending again, before the new one
    assert session.controls == (_keys("W"),)
    assert session.prompt == "forest"
    assert session.chunk_retractable is None  # once: the record is gone
    with pytest.raises(NothingToCancelError):
        await session.retract_chunk()

    again = await session.next_chunk()
    assert (again.chunk_index, again.applied_event_ids) == (1, (2, 3))
    # A, pressed in the undone chunk and released since, is a tap the world never showed: it shows now.
    assert consumer.ticks[-1].controls == (_keys("D", "A"),)
    assert session.controls == (_keys("D"),)  # and is not held after it
    stats = session.stats
    assert (stats.chunks, stats.retracted, stats.applied, stats.unapplied) == (3, 1, 4, 1)
    # The ledger: every accepted event applied exactly once, net of the undone chunk.
    assert stats.accepted == stats.applied - stats.unapplied + stats.dropped + session.pending_event_count
    assert (stats.superseded, stats.dropped) == (0, 0)  # 3 did not supersede 2: 2 was applied, and is again


async def test_a_retract_may_put_the_queue_over_its_bound_and_acceptance_waits_for_a_chunk() -> None:
    """The undone chunk's events come back even past ``max_pending_events`` (they were accepted; dropping one
    would lose it): new events are refused until a chunk applies them, and one chunk applies them all."""
    consumer = _Consumer()
    session = Session("s", tick_consumer=consumer, lifecycle=consumer, max_pending_events=3)
    await session.accept_event(SessionEvent(0, prompt="a"))
    await session.next_chunk()
    for event_id in (1, 2, 3):
        await session.accept_event(SessionEvent(event_id, prompt="b"))
    await session.retract_chunk()
    assert session.pending_event_ids == (0, 1, 2, 3)  # one over the bound
    with pytest.raises(EventQueueFullError):
        await session.accept_event(SessionEvent(4, prompt="c"))
    made = await session.next_chunk()
    assert made.applied_event_ids == (0, 1, 2, 3)
    await session.accept_event(SessionEvent(5, prompt="c"))


async def test_a_retract_is_refused_without_a_commit_to_undo_and_changes_nothing() -> None:
    consumer = _Consumer()
    session = _session(consumer)
    with pytest.raises(NothingToCancelError):
        await session.retract_chunk()  # nothing committed yet
    await session.next_chunk()
    await session.reset()
    with pytest.raises(NothingToCancelError):
        await session.retract_chunk()  # a reset forgets the last commit

    refusing = _Consumer("refuse")
    session = _session(refusing)
    await session.accept_event(SessionEvent(1, controls=(_keys("W"),)))
    await session.next_chunk()
    with pytest.raises(CancelUnsupportedError):
        await session.retract_chunk()
    assert (session.chunk_index, session.pending_event_ids, session.status) == (1, (), SessionStatus.ACTIVE)
    assert session.chunk_retractable == 0  # still possible once the backend can

    class _NoRetract:
        async def execute_tick(self, tick: TickRequest) -> ChunkMetadata:
            return ChunkMetadata.from_tick(tick)

        def chunk_metadata(self, output: ChunkMetadata) -> ChunkMetadata:
            return output

    plain = _NoRetract()
    session = Session("p", tick_consumer=plain, lifecycle=consumer, max_pending_events=4)
    await session.next_chunk()
    with pytest.raises(CancelUnsupportedError):
        await session.retract_chunk()


async def test_a_session_with_a_control_reducer_never_retracts() -> None:
    class _Reducer:
        def prepare(self, *, current_controls: Any, events: Any, chunk_index: int) -> PreparedControls:
            return PreparedControls(())

        def commit(self, prepared: PreparedControls) -> None:
            return None

        def reset(self) -> None:
            return None

    consumer = _Consumer()
    session = _session(consumer, control_reducer=_Reducer())
    await session.next_chunk()
    assert session.chunk_retractable is None
    with pytest.raises(NothingToCancelError):
        await session.retract_chunk()


async def test_a_failed_undo_fails_the_session_closed() -> None:
    consumer = _Consumer("fail")
    session = _session(consumer)
    await session.accept_event(SessionEvent(1, controls=(_keys("W"),)))
    await session.next_chunk()
    with pytest.raises(RuntimeError):
        await session.retract_chunk()
    assert session.status is SessionStatus.FAILED
    assert consumer.closed == ["s"]
    await session.reset()
    assert session.dropped_events == () or all(d.reason in ("failed", "reset") for d in session.dropped_events)


# -- the world, on a clock the test moves ------------------------------------------------------------

PERIOD = 1.0  # 4 frames at 4 fps: a chunk a second, so the clock decides everything
SPEC = ModelSpec(
    name="fake",
    frames_per_chunk=4,
    fps=4.0,
    height=2,
    width=2,
    controls=(),
    max_batch_size=1,
    state_bytes=1,
    can_rollback=True,
)


class _Backend:
    """Tick consumer, lifecycle and world backend: chunks at once (or held, when told), undo, a step cost."""

    spec = SPEC

    def __init__(self, cost: float | None = 0.1) -> None:
        self.cost = cost
        self.ticks: list[TickRequest] = []
        self.retracted: list[TickRequest] = []
        self.cancelled: list[TickRequest] = []
        self.hold: asyncio.Event | None = None  # set: the next tick waits for it (a step in flight)
        self.holding = asyncio.Event()
        self._waiting: asyncio.Future[Chunk] | None = None

    async def execute_tick(self, tick: TickRequest) -> Chunk:
        self.ticks.append(tick)
        if self.hold is not None:
            hold, self.hold = self.hold, None
            self._waiting = asyncio.get_running_loop().create_future()
            self.holding.set()
            waiter = asyncio.ensure_future(hold.wait())
            done, _ = await asyncio.wait({waiter, self._waiting}, return_when=asyncio.FIRST_COMPLETED)
            if self._waiting in done:
                waiter.cancel()
                self._waiting.result()  # raises the cancellation
        frames = np.full((4, 2, 2, 3), tick.chunk_index % 256, np.uint8)
        return Chunk(frames, ChunkMetadata.from_tick(tick), 0, 1, 0.0, 0.0, 0.0)

    def chunk_metadata(self, output: Chunk) -> ChunkMetadata:
        return output.metadata

    def cancel_tick(self, tick: TickRequest) -> None:
        from worldserve.errors import ChunkCancelledError

        if self._waiting is None or self._waiting.done():
            raise NothingToCancelError("not in flight")
        self.cancelled.append(tick)
        self._waiting.set_exception(ChunkCancelledError("cancelled"))

    async def retract_tick(self, tick: TickRequest) -> None:
        self.retracted.append(tick)

    def preempt_cost(self, session_id: str) -> float | None:
        return self.cost

    async def reset_session(self, session_id: str) -> None:
        return None

    async def close_session(self, session_id: str) -> None:
        return None

    async def create_session(
        self, *, prompt: str | None, seed: int, image: bytes | None, encoding: FrameEncoding | None = None
    ) -> Session[Chunk]:
        raise AssertionError

    def mark_in_use(self, session_id: str, seconds: float) -> None:
        return None

    def capacity(self) -> Capacity:
        return Capacity(free=None, workers_alive=1)


class _Outlet:
    def __init__(self) -> None:
        self.posted: list[BaseModel] = []

    def post(self, messages: tuple[BaseModel, ...], binary: tuple[bytes, ...] = ()) -> None:
        self.posted.extend(messages)

    def detach(self) -> None:
        return None

    def unsent(self) -> list[tuple[BaseModel, ...]]:
        return []

    @property
    def backlog(self) -> int:
        return 0

    def chunks(self) -> list[ChunkMessage]:
        return [m for m in self.posted if isinstance(m, ChunkMessage)]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _until(predicate: Any, what: str) -> None:
    async with asyncio.timeout(10):
        while not predicate():  # noqa: ASYNC110 - the outlet is a plain recorder
            await asyncio.sleep(0.001)


def _world(backend: _Backend, **config: Any) -> tuple[WorldHost, _Outlet, _Outlet, _Clock, ServerMetrics]:
    session: Session[Chunk] = Session("s1", tick_consumer=backend, lifecycle=backend, max_pending_events=8)
    metrics = ServerMetrics(SessionManager(tick_consumer=backend, lifecycle=backend, max_pending_events=8))
    clock = _Clock()
    host = WorldHost(
        session,
        backend=backend,
        # A chunk ahead: the lead that leaves a chunk made and not yet playing to preempt.
        config=ServerConfig(**{"chunk_clock": False, "max_lag_chunks": 8, "lead_chunks": 1, **config}),
        metrics=metrics,
        registry=WorldHosts(),
        media="raw",
        share_viewers=True,
        clock=clock,
    )
    me, viewer = _Outlet(), _Outlet()
    host.attach_host(me)
    assert host.viewer_token is not None
    host.join(host.viewer_token, Role.VIEWER, viewer)
    return host, me, viewer, clock, metrics


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _count(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


async def test_an_input_before_the_lead_chunk_plays_has_it_made_again_and_members_are_told() -> None:
    backend = _Backend()
    host, me, viewer, clock, metrics = _world(backend)
    host.start()
    try:
        # Chunk 0 plays on arrival; chunk 1 (the lead) is made at once and plays a period later. The
        # clock stands still, so generation waits for chunk 2's instant: chunk 1 has not begun to play.
        await _until(lambda: len(me.chunks()) == 2, "the lead chunk")
        member = host.members[0]
        await host.accept(member, SessionEvent(1, controls=(_keys("W"),)))
        await _until(lambda: len(me.chunks()) == 3, "the replacement")
        _first, lead, replacement = me.chunks()
        assert (lead.chunk_index, lead.applied_event_ids, lead.supersedes) == (1, [], None)
        assert (replacement.seq, replacement.chunk_index, replacement.supersedes) == (lead.seq + 1, 1, lead.seq)
        assert replacement.applied_event_ids == [1]  # the member's own id, in the chunk made again
        assert [c.supersedes for c in viewer.chunks()] == [None, None, lead.seq]  # viewers are told too
        assert [t.chunk_index for t in backend.retracted] == [1]
        assert host.session.stats.retracted == 1
        assert _count(metrics, "worldserve_preempted_chunks_total", how="undone") == 1
        assert all(made.seq != lead.seq for made in host._replay)  # a resume never re-sends the undone one

        # Once per chunk: a second input for the same chunk waits for the next one.
        await host.accept(member, SessionEvent(2, controls=(_keys("A"),)))
        await asyncio.sleep(0.05)
        assert len(me.chunks()) == 3
        assert len(backend.retracted) == 1
        clock.now += PERIOD  # chunk 2's instant
        await _until(lambda: len(me.chunks()) == 4, "chunk 2")
        assert (me.chunks()[3].chunk_index, me.chunks()[3].applied_event_ids) == (2, [2])
    finally:
        await host.shutdown("test over")


async def test_members_that_send_frames_themselves_hold_the_chunk_being_undone() -> None:
    """While the undo awaits the worker, a WebRTC track could begin the chunk: the world has each member whose
    outlet sends frames on its own time hold it (by the member's wire seq), and does not release it once undone
    (the replacement's header drops it there)."""

    class TrackOutlet(_Outlet):
        def __init__(self) -> None:
            super().__init__()
            self.held: list[int] = []
            self.released: list[int] = []

        def hold_chunk(self, seq: int) -> None:
            self.held.append(seq)

        def release_chunk(self, seq: int) -> None:
            self.released.append(seq)

    backend = _Backend()
    host, me, _, _, _ = _world(backend)
    watcher = TrackOutlet()
    host.join(host.viewer_token or "", Role.VIEWER, watcher, seq_base=100)
    host.start()
    try:
        await _until(lambda: len(me.chunks()) == 2 and len(watcher.chunks()) == 2, "the lead chunk")
        lead = me.chunks()[1]
        await host.accept(host.members[0], SessionEvent(1, controls=(_keys("W"),)))
        await _until(lambda: len(watcher.chunks()) == 3, "the replacement")
        assert (watcher.held, watcher.released) == ([lead.seq + 100], [])
        assert watcher.chunks()[2].supersedes == lead.seq + 100
    finally:
        await host.shutdown("test over")


async def test_a_chunk_whose_first_frame_went_out_on_a_video_track_is_never_made_again() -> None:
    """A WebRTC track's frames cannot be called back (its receiver shows what it got): once the track sent the lead
    chunk's first frame, an input waits for the next chunk, though the member's ack (as it is shown) is yet to come."""
    backend = _Backend()
    host, me, _, clock, metrics = _world(backend)
    host.start()
    try:
        await _until(lambda: len(me.chunks()) == 2, "the lead chunk")
        member = host.members[0]
        host.started(member, me.chunks()[1].seq)  # what DataChannelSocket's track tells its connection
        assert member.acked_seq < me.chunks()[1].seq  # not acked: only sent
        await host.accept(member, SessionEvent(1, controls=(_keys("W"),)))
        await asyncio.sleep(0.05)
        assert backend.retracted == []
        assert _count(metrics, "worldserve_preempted_chunks_total", how="undone") == 0
        clock.now += PERIOD
        await _until(lambda: len(me.chunks()) == 3, "chunk 2")
        assert (me.chunks()[2].chunk_index, me.chunks()[2].applied_event_ids, me.chunks()[2].supersedes) == (
            2,
            [1],
            None,
        )
    finally:
        await host.shutdown("test over")


async def test_no_preemption_when_too_late_without_headroom_or_switched_off() -> None:
    # Too late: the chunk made plays in 0.2 s; made again it would be ready in 0.1 s + a frame (0.25 s).
    backend = _Backend(cost=0.1)
    host, me, _, clock, metrics = _world(backend)
    host.start()
    try:
        await _until(lambda: len(me.chunks()) == 2, "the lead chunk")
        clock.now += PERIOD - 0.2
        await host.accept(host.members[0], SessionEvent(1, controls=(_keys("W"),)))
        await asyncio.sleep(0.05)
        assert backend.retracted == []
        assert _count(metrics, "worldserve_preempted_chunks_total", how="undone") == 0
    finally:
        await host.shutdown("test over")
    for backend, config in ((_Backend(cost=None), {}), (_Backend(), {"preempt": "off"})):
        await _no_preemption(backend, config)


async def _no_preemption(backend: _Backend, config: dict[str, Any]) -> None:
    """No preemption: the input waits for the next chunk."""
    host, me, _, clock, _ = _world(backend, **config)
    host.start()
    try:
        await _until(lambda: len(me.chunks()) == 2, "the lead chunk")
        await host.accept(host.members[0], SessionEvent(1, controls=(_keys("W"),)))
        await asyncio.sleep(0.05)
        assert backend.retracted == []
        assert len(me.chunks()) == 2
        clock.now += PERIOD
        await _until(lambda: len(me.chunks()) == 3, "chunk 2")
        assert (me.chunks()[2].chunk_index, me.chunks()[2].applied_event_ids) == (2, [1])
    finally:
        await host.shutdown("test over")


async def test_an_input_during_a_step_without_it_cancels_that_step_and_it_is_made_with_it() -> None:
    backend = _Backend()
    host, me, _, clock, metrics = _world(backend)
    host.start()
    try:
        await _until(lambda: len(me.chunks()) == 2, "the lead chunk")
        backend.hold = asyncio.Event()
        clock.now += PERIOD  # chunk 2's instant: its tick goes, and is held in flight
        await _until(backend.holding.is_set, "chunk 2 in flight")
        await host.accept(host.members[0], SessionEvent(1, controls=(_keys("D"),)))
        await _until(lambda: len(me.chunks()) == 3, "chunk 2, made again")
        chunk = me.chunks()[2]
        assert (chunk.chunk_index, chunk.applied_event_ids, chunk.supersedes) == (2, [1], None)  # never sent
        assert [t.chunk_index for t in backend.cancelled] == [2]
        assert [t.chunk_index for t in backend.ticks].count(2) == 2
        assert _count(metrics, "worldserve_preempted_chunks_total", how="cancelled") == 1
    finally:
        await host.shutdown("test over")


async def test_a_chunk_that_applies_inputs_is_never_made_again() -> None:
    """An input keeps the chunk it came in: made again, it would share one with a newer input whose
    controls win (a key tapped and released within a chunk would never show)."""
    backend = _Backend(cost=None)  # no headroom yet: event 1 preempts nothing
    host, me, _, clock, metrics = _world(backend)
    host.start()
    try:
        await _until(lambda: len(me.chunks()) == 2, "the lead chunk")
        member = host.members[0]
        await host.accept(member, SessionEvent(1, controls=(_keys("W"),)))
        gate = backend.hold = asyncio.Event()
        clock.now += PERIOD  # chunk 2's tick goes with event 1, and is held in flight
        await _until(backend.holding.is_set, "chunk 2 in flight")
        backend.cost = 0.1  # headroom now: only the rule keeps chunk 2
        await host.accept(member, SessionEvent(2, controls=(_keys("A"),)))
        assert backend.cancelled == []
        gate.set()
        await _until(lambda: len(me.chunks()) == 3, "chunk 2")
        assert (me.chunks()[2].chunk_index, me.chunks()[2].applied_event_ids) == (2, [1])
        await host.accept(member, SessionEvent(3, controls=(_keys("D"),)))  # chunk 2, sent, applied event 1
        await asyncio.sleep(0.05)
        assert backend.retracted == []
        assert _count(metrics, "worldserve_preempted_chunks_total", how="undone") == 0
        clock.now += PERIOD
        await _until(lambda: len(me.chunks()) == 4, "chunk 3")
        assert (me.chunks()[3].chunk_index, me.chunks()[3].applied_event_ids) == (3, [2, 3])
    finally:
        await host.shutdown("test over")


def test_the_policy_and_the_pacer_in_simulated_time() -> None:
    rule = Preempt(True, margin_s=0.05)
    assert rule.worth(0.0, 1.0, 0.9)
    assert not rule.worth(0.0, 1.0, 0.96)
    assert not rule.worth(0.0, None, 0.1)
    assert not rule.worth(0.0, 1.0, None)
    assert not Preempt(False).worth(0.0, 10.0, 0.0)
    pacer = Pacer(0.25, Lead(1))
    pacer.made(0, 10.0, 10.1)
    pacer.made(0, 10.1, 10.2)
    assert pacer.due_of(1) == pytest.approx(10.35)
    pacer.unmade()  # chunk 1 is to be made again: at its own instant, for its own playout instant
    plan = pacer.plan(10.2)
    assert plan.due == pytest.approx(10.35)
    assert plan.want == pytest.approx(10.1)
    pacer.made(0, 10.2, 10.25)
    with pytest.raises(ValueError, match="after an epoch's first"):
        Pacer(0.25, Lead(1)).unmade()


# -- real runtimes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["procedural", "tinyworld"])
async def test_the_chunk_made_again_equals_the_chunk_made_with_the_input_in_time(model: str, tmp_path: Path) -> None:
    options = {"precision": "float32"} if model == "tinyworld" else {}
    async with Runtime(model, workers=1, model_options=options, record_dir=str(tmp_path)) as runtime:
        late = await runtime.create_session(prompt="desert dunes", seed=3)
        in_time = await runtime.create_session(prompt="desert dunes", seed=3)
        for session in (late, in_time):
            await session.accept_event(SessionEvent(1, controls=(_keys("W"),)))
            await session.next_chunk()
        await late.next_chunk()  # chunk 1 without the input ...
        await late.accept_event(SessionEvent(2, controls=(_keys("D"),)))
        await late.retract_chunk()  # ... undone when it comes
        await in_time.accept_event(SessionEvent(2, controls=(_keys("D"),)))
        for _ in range(2):
            again, expected = await late.next_chunk(), await in_time.next_chunk()
            assert again.metadata.chunk_index == expected.metadata.chunk_index
            assert np.array_equal(again.frames, expected.frames)
        assert runtime.engine.stats().ticks_retracted == 1
        await runtime.close_session(late.session_id)
    journal = read_journal(tmp_path / f"{late.session_id}.jsonl")
    assert journal.retracted == 1
    assert [c.chunk_index for c in journal.chunks] == [0, 1, 2]


# -- a real server, several sessions, random input ------------------------------------------------------

PROCEDURAL_PERIOD = 0.25  # 4 frames at 16 fps


async def _play_randomly(url: str, seed: int, chunks: int) -> dict[str, Any]:
    """One scripted player: random keys at random instants; what it was shown and where its events went."""
    rng = random.Random(seed)
    shown: list[tuple[dict[str, Any], list[bytes]]] = []
    accepted: set[int] = set()
    dropped: set[int] = set()
    superseded = 0
    loop = asyncio.get_running_loop()
    slots: list[float] = []  # when each chunk kept begins to play
    acks: list[asyncio.TimerHandle] = []
    async with websockets.connect(url, max_size=None) as ws:
        sending: set[asyncio.Task[None]] = set()

        def send_ack(seq: int) -> None:
            task = loop.create_task(ws.send(json.dumps({"type": "chunk.ack", "seq": seq})))
            sending.add(task)
            task.add_done_callback(sending.discard)

        await ws.send(json.dumps({"type": "session.start", "seed": seed, "options": {"media": "raw"}}))
        session_id = ""
        event_id = 0
        received = 0

        async def press() -> None:
            nonlocal event_id
            while True:
                await asyncio.sleep(rng.uniform(0.02, 0.3))
                event_id += 1
                held = rng.choice([["W"], ["A"], ["D"], ["S"], ["W", "A"], []])
                event = {"type": "input.event", "event_id": event_id, "controls": [_keys(*held).to_dict()]}
                await ws.send(json.dumps(event))

        presser: asyncio.Task[None] | None = None
        try:
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                kind = message["type"]
                if kind == "session.started":
                    session_id = message["session_id"]
                    presser = asyncio.create_task(press())
                elif kind == "input.accepted" and message["status"] == "accepted":
                    accepted.add(message["event_id"])
                elif kind == "input.dropped":
                    dropped.update(message["event_ids"])
                elif kind == "chunk":
                    if message.get("supersedes") is not None:
                        assert shown
                        assert shown[-1][0]["seq"] == message["supersedes"]
                        assert shown[-1][0]["chunk_index"] == message["chunk_index"]
                        assert set(shown[-1][0]["applied_event_ids"]) <= set(message["applied_event_ids"])
                        shown.pop()
                        superseded += 1
                    frames = [await asyncio.wait_for(ws.recv(), 60) for _ in range(message["frames"]["count"])]
                    shown.append((message, frames))  # type: ignore[arg-type]
                    # It acks a chunk as it would begin to play it (a period after the one before),
                    # as a player does: the server preempts only a chunk nobody began to play.
                    now = loop.time()
                    if message.get("supersedes") is not None and acks:
                        acks.pop().cancel()  # the replaced chunk never plays: its replacement takes its slot
                        play_at = slots.pop()
                    else:
                        play_at = now if not slots else max(now, slots[-1] + PROCEDURAL_PERIOD)
                    slots.append(play_at)
                    acks.append(loop.call_later(play_at - now, send_ack, message["seq"]))
                    received += 1
                    if received == chunks and presser is not None:
                        presser.cancel()
                        await asyncio.sleep(0.3)  # the last events reach a chunk (or are dropped at close)
                        await ws.send(json.dumps({"type": "session.close"}))
                elif kind == "session.closed":
                    break
                elif kind == "error":
                    raise AssertionError(message)
        finally:
            if presser is not None:
                presser.cancel()
            for handle in acks:
                handle.cancel()
    return {
        "session_id": session_id,
        "shown": shown,
        "accepted": accepted,
        "dropped": dropped,
        "superseded": superseded,
    }


@pytest.mark.timeout(300)
async def test_eight_sessions_with_random_input_lose_nothing_apply_nothing_twice_and_replay_exactly(
    tmp_path: Path,
) -> None:
    journals = tmp_path / "journals"
    running = start_server("--model", "procedural", "--record-dir", str(journals), "--lead", "2")
    try:
        players = await asyncio.gather(*(_play_randomly(running.ws, seed, 16) for seed in range(8)))
        metrics = await asyncio.to_thread(_get, running.http + "/metrics")
    finally:
        running.stop()
    total_superseded = 0
    for player in players:
        applied = Counter(event for header, _ in player["shown"] for event in header["applied_event_ids"])
        assert all(count == 1 for count in applied.values()), applied  # none applied twice in what was shown
        lost = player["accepted"] - set(applied) - player["dropped"]
        assert not lost  # every accepted event is applied or reported dropped
        path = journals / f"{player['session_id']}.jsonl"
        journal = read_journal(path)
        assert journal.retracted == player["superseded"]
        assert [c.chunk_index for c in journal.chunks] == [h["chunk_index"] for h, _ in player["shown"]]
        replayed = await replay(path, executor="inprocess")
        live = np.stack([np.frombuffer(f, np.uint8) for _, frames in player["shown"] for f in frames])
        assert np.array_equal(replayed.frames.reshape(live.shape), live)  # replay equals what was shown
        total_superseded += player["superseded"]
    assert total_superseded > 0  # input came before chunks played, and they were made again
    assert 'worldserve_preempted_chunks_total{how="undone"}' in metrics


async def test_the_engine_grants_an_extra_step_only_from_its_headroom_and_asking_costs_nothing() -> None:
    async with Runtime("procedural", workers=1) as runtime:
        session = await runtime.create_session(prompt="islands", seed=1)
        for _ in range(2):
            await session.next_chunk()
        steps = runtime.engine._workers[0].gathering.steps
        for _ in range(5):  # a step of 0.1 s in a 0.25 s period (budget 0.9): room for one more, not two
            steps.observe(1, 0.1)
        assert runtime.preempt_cost(session.session_id) == pytest.approx(0.1)
        assert runtime.preempt_cost(session.session_id) == pytest.approx(0.1)  # a query: asking grants nothing
        await session.retract_chunk()  # a step made twice: the period's headroom is spent
        assert runtime.preempt_cost(session.session_id) is None
        await runtime.close_session(session.session_id)
