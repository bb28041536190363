"""The pacing loop (issue 26, item 5) driven alone: a real session, a recorder of what it asks of the
world, and a clock the test moves; no host, no members, no socket."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from worldserve.models.base import ModelSpec
from worldserve.protocol import ChunkMetadata, ControlInput, TickRequest
from worldserve.runtime.chunk import Chunk
from worldserve.server.metrics import ServerMetrics
from worldserve.server.pacing import Lead, Preempt
from worldserve.server.pacing_loop import PacingLoop
from worldserve.session import Session, SessionEvent, SessionManager

PERIOD = 1.0
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
    """Chunks at once; undoes the last one; a fixed step cost for a preemption."""

    def __init__(self) -> None:
        self.ticks: list[TickRequest] = []
        self.retracted: list[TickRequest] = []
        self.retract_gate: asyncio.Event | None = None  # set: a retract waits for it
        self.retracting = asyncio.Event()

    async def execute_tick(self, tick: TickRequest) -> Chunk:
        self.ticks.append(tick)
        frames = np.zeros((4, 2, 2, 3), np.uint8)
        return Chunk(frames, ChunkMetadata.from_tick(tick), 0, 1, 0.0, 0.0, 0.0)

    def chunk_metadata(self, output: Chunk) -> ChunkMetadata:
        return output.metadata

    async def retract_tick(self, tick: TickRequest) -> None:
        self.retracting.set()
        if self.retract_gate is not None:
            await self.retract_gate.wait()
        self.retracted.append(tick)

    async def reset_session(self, session_id: str) -> None:
        return None

    async def close_session(self, session_id: str) -> None:
        return None

    def tick_due(self, session_id: str, want: float | None, *, eager: bool = False, due: float | None = None) -> float:
        raise AssertionError("the loop is run without the chunk clock here")

    def preempt_cost(self, session_id: str) -> float | None:
        return 0.1


class _World:
    """Records what the loop asks; held back while told so."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, int | None, tuple[int, ...]]] = []  # seq, chunk index, supersedes, ids
        self.undone: list[int] = []
        self.failures = 0
        self.hold = False
        self.replace_ok = True
        self.held: list[int] = []  # chunks held from playing while an undo awaits
        self.released: list[int] = []
        self.early = 0.0  # a chunk is playable this long before its commit (its frames went out in parts)
        self.asked: list[tuple[int, int, float]] = []  # playable(epoch, chunk index, committed) calls

    def held_back(self) -> bool:
        return self.hold

    def plays_at(self, seq: int, paced: float | None) -> float | None:
        return paced

    def replaceable(self) -> bool:
        return self.replace_ok

    def report_failure(self) -> None:
        self.failures += 1

    def parts_out(self) -> bool:
        return False

    def playable(self, epoch: int, chunk_index: int, committed: float) -> float:
        self.asked.append((epoch, chunk_index, committed))
        return committed - self.early

    async def send(self, chunk: Chunk, epoch: int, *, started: float, committed: float, supersedes: int | None) -> int:
        seq = len(self.sent)
        self.sent.append((seq, chunk.metadata.chunk_index, supersedes, chunk.metadata.applied_event_ids))
        return seq

    def undo(self, seq: int) -> None:
        self.undone.append(seq)

    def hold_chunk(self, seq: int) -> None:
        self.held.append(seq)

    def release_chunk(self, seq: int) -> None:
        self.released.append(seq)


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


async def _until(predicate: Any) -> None:
    async with asyncio.timeout(10):
        while not predicate():  # noqa: ASYNC110 - the recorder is plain
            await asyncio.sleep(0.001)


def _loop(backend: _Backend, world: _World, clock: _Clock, *, preempt: bool = True) -> PacingLoop:
    session: Session[Chunk] = Session("s", tick_consumer=backend, lifecycle=backend, max_pending_events=8)
    metrics = ServerMetrics(SessionManager(tick_consumer=backend, lifecycle=backend, max_pending_events=8))
    return PacingLoop(
        session,
        world,
        backend,
        period=PERIOD,
        lead=Lead(1),
        preempt=Preempt(preempt, 0.25),
        metrics=metrics,
        chunk_clock=False,
        clock=clock,
    )


def _keys(*held: str) -> ControlInput:
    return ControlInput("keys", "worldserve.keys.v1", {"held": list(held)})


async def test_ticks_follow_the_lead_and_wait_while_the_world_is_held_back() -> None:
    backend, world, clock = _Backend(), _World(), _Clock()
    loop = _loop(backend, world, clock)
    loop.start()
    try:
        await _until(lambda: len(world.sent) == 2)  # the first chunk, then the lead chunk at once
        await asyncio.sleep(0.02)
        assert len(world.sent) == 2  # chunk 2 waits for its instant on the (still) clock
        clock.now += PERIOD
        loop.wake()
        await _until(lambda: len(world.sent) == 3)  # chunk 2 at its instant
        world.hold = True  # checked before each wait for an instant
        clock.now += 5 * PERIOD
        loop.wake()
        await asyncio.sleep(0.02)
        assert len(world.sent) <= 4  # the tick it was waiting for at most, then none however late
        held = len(world.sent)
        loop.wake()
        await asyncio.sleep(0.02)
        assert len(world.sent) == held
        world.hold = False
        loop.wake()
        await _until(lambda: len(world.sent) == held + 1)
        assert [index for _, index, _, _ in world.sent] == list(range(held + 1))
    finally:
        await loop.stop(grace=0)


async def test_an_input_has_the_chunk_sent_without_it_undone_and_made_again_once() -> None:
    backend, world, clock = _Backend(), _World(), _Clock()
    loop = _loop(backend, world, clock)
    loop.start()
    try:
        await _until(lambda: len(world.sent) == 2)
        await loop.session.accept_event(SessionEvent(1, controls=(_keys("W"),)))
        await loop.consider_preempt()
        await _until(lambda: len(world.sent) == 3)
        assert world.undone == [1]
        assert world.sent[2] == (2, 1, 1, (1,))  # chunk 1 again, with the input, superseding seq 1
        assert [t.chunk_index for t in backend.retracted] == [1]
        await loop.session.accept_event(SessionEvent(2, controls=(_keys("A"),)))
        await loop.consider_preempt()  # once per chunk (and this one applies an input)
        await asyncio.sleep(0.02)
        assert len(world.sent) == 3
        assert world.undone == [1]
    finally:
        await loop.stop(grace=0)


class _FailingRetract(_Backend):
    async def retract_tick(self, tick: TickRequest) -> None:
        self.retracting.set()
        if self.retract_gate is not None:
            await self.retract_gate.wait()
        raise RuntimeError("the worker lost the state")


@pytest.mark.parametrize("retract", ["ok", "fail"])
async def test_the_chunk_being_undone_is_held_from_playing_until_replaced_or_released(retract: str) -> None:
    """While the retract awaits the worker, a track could begin the chunk (its first frame due): the world holds
    it first. Undone, it stays held (its replacement drops it); an undo that fails lets it go."""
    backend = _Backend() if retract == "ok" else _FailingRetract()
    world, clock = _World(), _Clock()
    backend.retract_gate = gate = asyncio.Event()
    loop = _loop(backend, world, clock)
    loop.start()
    try:
        await _until(lambda: len(world.sent) == 2)
        await loop.session.accept_event(SessionEvent(1, controls=(_keys("W"),)))
        await loop.consider_preempt()
        await backend.retracting.wait()
        assert (world.held, world.released, world.undone) == ([1], [], [])  # held before the worker answers
        gate.set()
        if retract == "ok":
            await _until(lambda: len(world.sent) == 3)
            assert (world.held, world.released, world.undone) == ([1], [], [1])
        else:
            await _until(lambda: world.failures == 1)
            assert (world.held, world.released, world.undone) == ([1], [1], [])
    finally:
        await loop.stop(grace=0)


async def test_no_undo_when_the_world_cannot_replace_a_chunk_or_preemption_is_off() -> None:
    for preempt, replaceable in ((True, False), (False, True)):
        backend, world, clock = _Backend(), _World(), _Clock()
        world.replace_ok = replaceable
        loop = _loop(backend, world, clock, preempt=preempt)
        loop.start()
        try:
            await _until(lambda: len(world.sent) == 2)  # noqa: B023 - awaited within the iteration
            await loop.session.accept_event(SessionEvent(1, controls=(_keys("W"),)))
            await loop.consider_preempt()
            await asyncio.sleep(0.02)
            assert world.undone == []
            assert backend.retracted == []
            clock.now += PERIOD
            loop.wake()
            await _until(lambda: len(world.sent) == 3)  # noqa: B023
            assert world.sent[2] == (2, 2, None, (1,))  # the input in the next chunk, as without preemption
        finally:
            await loop.stop(grace=0)


def _camera(dx: float) -> ControlInput:
    return ControlInput("camera", "worldserve.camera.v1", {"dx": dx, "dy": 0.0})


async def _chunk_with_keys(loop: PacingLoop, world: _World, clock: _Clock) -> None:
    """Chunks 0 and 1 sent, then chunk 2 made at its instant with keys W (event 1): the chunk sent last."""
    await _until(lambda: len(world.sent) == 2)
    await loop.session.accept_event(SessionEvent(1, controls=(_keys("W"),)))
    clock.now += PERIOD
    loop.wake()
    await _until(lambda: len(world.sent) == 3)
    assert world.sent[2] == (2, 2, None, (1,))


async def test_a_chunk_with_a_key_is_made_again_for_a_camera_move_which_hides_nothing() -> None:
    backend, world, clock = _Backend(), _World(), _Clock()
    loop = _loop(backend, world, clock)
    loop.start()
    try:
        await _chunk_with_keys(loop, world, clock)
        await loop.session.accept_event(SessionEvent(2, controls=(_camera(1.5),)))
        await loop.consider_preempt()
        await _until(lambda: len(world.sent) == 4)
        assert world.undone == [2]
        assert world.sent[3] == (3, 2, 2, (1, 2))  # chunk 2 again: the key and the camera, superseding seq 2
        remade = backend.ticks[-1]
        assert {c.track: dict(c.data) for c in remade.controls} == {
            "keys": {"held": ("W",)},
            "camera": {"dx": 1.5, "dy": 0.0},
        }
    finally:
        await loop.stop(grace=0)


async def test_a_chunk_with_a_key_is_not_made_again_for_another_key_which_would_hide_it() -> None:
    for hiding in (SessionEvent(2, controls=(_keys(),)), SessionEvent(2, prompt="x", controls=(_keys("A"),))):
        backend, world, clock = _Backend(), _World(), _Clock()
        loop = _loop(backend, world, clock)
        loop.start()
        try:
            await _chunk_with_keys(loop, world, clock)
            await loop.session.accept_event(hiding)
            await loop.consider_preempt()
            await asyncio.sleep(0.02)
            assert world.undone == []  # the release keeps out of the chunk that holds the press
            clock.now += PERIOD
            loop.wake()
            await _until(lambda: len(world.sent) == 4)  # noqa: B023 - awaited within the iteration
            assert world.sent[3] == (3, 3, None, (2,))
        finally:
            await loop.stop(grace=0)


async def test_a_key_that_comes_while_a_chunk_is_undone_waits_for_the_next_chunk() -> None:
    """The chunk made again takes the events its decision saw: a release that comes while the chunk
    with the press is being undone cannot join it (it would hide the press)."""
    backend, world, clock = _Backend(), _World(), _Clock()
    backend.retract_gate = asyncio.Event()
    loop = _loop(backend, world, clock)
    loop.start()
    try:
        await _chunk_with_keys(loop, world, clock)
        await loop.session.accept_event(SessionEvent(2, controls=(_camera(-1.0),)))
        await loop.consider_preempt()
        await asyncio.wait_for(backend.retracting.wait(), 5)
        await loop.session.accept_event(SessionEvent(3, controls=(_keys(),)))  # released meanwhile
        backend.retract_gate.set()
        await _until(lambda: len(world.sent) == 4)
        assert world.sent[3] == (3, 2, 2, (1, 2))  # the press and the camera; not the release
        clock.now += PERIOD
        loop.wake()
        await _until(lambda: len(world.sent) == 5)
        assert world.sent[4] == (4, 3, None, (3,))  # the release, in the next chunk
    finally:
        await loop.stop(grace=0)


async def test_a_controllers_ack_tells_the_pacer_when_playback_is() -> None:
    """Just in time: an ack of a sent chunk, earlier than the pacer's own instant for it, brings the
    playout anchor back (the host passes each controller's ack on); an ack of an unknown seq does nothing."""
    backend, world, clock = _Backend(), _World(), _Clock()
    loop = _loop(backend, world, clock)
    loop.pacer.lead = Lead(0, 0.05)
    loop.start()
    try:
        await _until(lambda: len(world.sent) == 1)
        clock.now += PERIOD
        loop.wake()
        await _until(lambda: len(world.sent) == 2)
        before = loop.pacer.due_of(1)
        assert before is not None
        loop.played(99, 0.0)  # not a chunk it sent
        assert loop.pacer.due_of(1) == before
        loop.played(1, before - 0.03)  # chunk 1 showed 30 ms before the pacer's instant for it
        assert loop.pacer.due_of(1) == pytest.approx(before - 0.03)
        loop.played(1, before + 1.0)  # a late ack moves nothing
        assert loop.pacer.due_of(1) == pytest.approx(before - 0.03)
    finally:
        await loop.stop(grace=0)


async def test_a_chunk_playable_before_its_commit_anchors_playback_there() -> None:
    """Just in time: a chunk whose frames went out in parts is ready when it is playable (the world says when),
    not at its commit: playback is anchored that much sooner, and a later chunk is late only after that."""
    backend, world, clock = _Backend(), _World(), _Clock()
    world.early = 0.2
    loop = _loop(backend, world, clock)
    loop.pacer.lead = Lead(0, 0.05)
    loop.start()
    try:
        await _until(lambda: len(world.sent) == 1)
        assert world.asked == [(0, 0, clock.now)]
        assert loop.pacer.due_of(0) == pytest.approx(clock.now - 0.2 + 0.05)
        clock.now += PERIOD
        loop.wake()
        await _until(lambda: len(world.sent) == 2)
        assert loop.pacer.late == 0  # committed 0.15 s after its instant, playable 0.05 s before it
    finally:
        await loop.stop(grace=0)
