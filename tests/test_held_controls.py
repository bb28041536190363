"""Held controls (issue 13, item 4): a newer event on continuous tracks supersedes queued ones, so a
held control never fills the queue; every accepted event is still applied once or dropped once."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from test_session import Consumer, Lifecycle, make
from worldserve import (
    ControlInput,
    DroppedEvents,
    DropReason,
    EventQueueFullError,
    InvalidEventError,
    SessionEvent,
    SessionManager,
    StaleEventError,
)
from worldserve.models.base import ModelSpec
from worldserve.models.procedural import ProceduralModel
from worldserve.models.world import CONTINUOUS_TRACKS, CONTROL_SCHEMAS, keys_control
from worldserve.runtime import Runtime, RuntimeConfig


def held(event_id: int, *tracks: str, value: int = 0, prompt: str | None = None) -> SessionEvent:
    return SessionEvent(
        event_id, prompt=prompt, controls=tuple(ControlInput(t, f"test.{t}.v1", {"v": value}) for t in tracks)
    )


COALESCE = frozenset({"keys", "camera"})


async def test_the_default_is_the_seeds_queue_full() -> None:
    session, _, _ = make(max_pending=2)
    await session.accept_event(held(1, "keys"))
    await session.accept_event(held(2, "keys"))
    with pytest.raises(EventQueueFullError):
        await session.accept_event(held(3, "keys"))
    assert session.pending_event_ids == (1, 2)
    assert session.coalesce_tracks == frozenset()


async def test_a_newer_held_control_supersedes_queued_ones() -> None:
    session, consumer, _ = make(max_pending=2, coalesce_tracks=COALESCE)
    for event_id in (1, 2, 3, 4):
        acceptance = await session.accept_event(held(event_id, "keys", value=event_id))
        assert acceptance.pending_event_count == 1
    assert session.pending_event_ids == (4,)
    assert session.take_dropped() == tuple(
        DroppedEvents((old,), DropReason.SUPERSEDED, f"superseded by event {old + 1}", old + 1) for old in (1, 2, 3)
    )
    stats = session.stats
    assert (stats.accepted, stats.dropped, stats.superseded, stats.rejected_full) == (4, 3, 3, 0)
    await session.next_chunk()
    assert consumer.ticks[-1].applied_event_ids == (4,)
    assert consumer.ticks[-1].controls == (ControlInput("keys", "test.keys.v1", {"v": 4}),)
    # The floor moved past the superseded ids: a re-sent one is a duplicate or stale, never applied twice.
    assert (await session.accept_event(held(3, "keys"))).status.value == "duplicate"
    with pytest.raises(StaleEventError):
        await session.accept_event(held(1, "keys"))  # out of the duplicate window: below the floor


async def test_what_is_never_superseded() -> None:
    session, _, _ = make(max_pending=5, coalesce_tracks=COALESCE)
    await session.accept_event(held(1, "keys", prompt="snow"))  # carries a prompt
    await session.accept_event(held(2, "keys", "mouse"))  # a track that is not continuous
    await session.accept_event(held(3, "camera"))  # a track the new event does not update
    await session.accept_event(held(4, "keys", "mouse"))
    await session.accept_event(held(9, "keys"))  # a higher id: it wins the snapshot, not the new one
    assert session.take_dropped() == ()
    with pytest.raises(EventQueueFullError):
        await session.accept_event(held(5, "keys"))  # full, and it supersedes none of them
    assert session.pending_event_ids == (1, 2, 3, 4, 9)
    assert session.stats.rejected_full == 1
    await session.accept_event(held(10, "keys", "camera"))
    assert session.pending_event_ids == (1, 2, 4, 10)
    assert session.take_dropped() == (DroppedEvents((3, 9), DropReason.SUPERSEDED, "superseded by event 10", 10),)


async def test_events_of_the_tick_in_flight_are_never_superseded() -> None:
    session, consumer, _ = make(max_pending=3, coalesce_tracks=COALESCE)
    await session.accept_event(held(1, "keys"))
    consumer.gate = asyncio.Event()
    tick = asyncio.create_task(session.next_chunk())
    await consumer.started.wait()
    await session.accept_event(held(2, "keys"))
    await session.accept_event(held(3, "keys"))  # supersedes 2, not 1 (in flight)
    assert session.pending_event_ids == (1, 3)
    assert session.take_dropped() == (DroppedEvents((2,), DropReason.SUPERSEDED, "superseded by event 3", 3),)
    consumer.gate.set()
    await tick
    assert consumer.ticks[0].applied_event_ids == (1,)
    assert session.event_floor == 2  # not lowered by the commit of 1
    await session.next_chunk()
    assert consumer.ticks[1].applied_event_ids == (3,)


async def test_a_refused_event_supersedes_nothing() -> None:
    class Refuse:
        def validate_controls(self, controls: Any) -> None:
            if any(control.data.get("v") == 99 for control in controls):
                raise ValueError("v=99")

    session, _, _ = make(max_pending=1, coalesce_tracks=COALESCE, control_validator=Refuse())
    await session.accept_event(held(1, "keys"))
    with pytest.raises(InvalidEventError):
        await session.accept_event(held(2, "keys", value=99))
    assert session.pending_event_ids == (1,)
    assert session.take_dropped() == ()


async def test_the_manager_passes_coalesce_tracks_on() -> None:
    manager: SessionManager[Any] = SessionManager(
        tick_consumer=Consumer(), lifecycle=Lifecycle(), max_pending_events=1, coalesce_tracks=COALESCE
    )
    session = await manager.create_session("a")
    assert session.coalesce_tracks == COALESCE


def test_models_declare_keys_and_camera_continuous() -> None:
    assert set(CONTINUOUS_TRACKS) == {control.track for control in CONTROL_SCHEMAS} == {"keys", "camera"}
    spec = ProceduralModel().spec
    assert spec.continuous_tracks == CONTINUOUS_TRACKS
    assert spec.to_dict()["continuous_tracks"] == list(CONTINUOUS_TRACKS)
    with pytest.raises(ValueError, match="continuous_tracks"):
        ModelSpec("m", 1, 1.0, 1, 1, CONTROL_SCHEMAS, 1, 0, continuous_tracks=("mouse",))


async def test_the_runtime_coalesces_the_models_continuous_tracks_unless_told_not_to() -> None:
    async with Runtime("procedural", executor="inprocess") as rt:
        session = await rt.create_session()
        assert session.coalesce_tracks == frozenset({"keys", "camera"})
    parser = argparse.ArgumentParser()
    RuntimeConfig.add_cli_arguments(parser)
    config = RuntimeConfig.from_cli_arguments(parser.parse_args(["--no-coalesce-controls", "--executor", "inprocess"]))
    assert config.coalesce_controls is False
    async with Runtime("procedural", config=config) as rt:
        session = await rt.create_session()
        assert session.coalesce_tracks == frozenset()
        for event_id in range(1, rt.config.max_pending_events + 1):
            await session.accept_event(SessionEvent(event_id, controls=(keys_control("W"),)))
        with pytest.raises(EventQueueFullError):
            await session.accept_event(SessionEvent(100, controls=(keys_control("D"),)))
