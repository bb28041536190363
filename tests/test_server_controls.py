"""Held controls and chunk cancelling over real sockets, against real ``worldserve serve`` processes.

- A held key at 60 events/s for a minute (3600 events, sent as fast as a raised ``--event-rate``
  allows, the time driven by the event count) with acks paused never gets ``queue_full``: newer
  key events supersede queued ones; every event is applied once or reported dropped (superseded).
- ``chunk.cancel`` mid-chunk leaves the session active at its last commit: no chunk index is
  skipped, no event is lost, and every frame after it is the exact world of the applied snapshots,
  as if the cancelled chunk had never started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from runtime_models import Truth
from server_harness import RunningServer, start_server
from worldserve.client import ClientChunk, WorldClient, WorldError, keys
from worldserve.tools.loadtest import format_table, run_bench

pytestmark = pytest.mark.timeout(120)

HELD_EVENTS = 3600  # 60 events/s for a minute


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(
        "--model", "procedural", "--event-rate", "100000", "--event-burst", "100000", "--max-pending-events", "16"
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def slow_server() -> Iterator[RunningServer]:
    """FaultyModel (tests/runtime_models.py): a 'slow' start prompt makes each step take 0.4 s."""
    running = start_server("--model", "runtime_models:FaultyModel", "--model-option", "slow_s=0.4", test_models=True)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def steady_server() -> Iterator[RunningServer]:
    """The procedural world without preemption: a chunk sent stays as it is."""
    running = start_server("--model", "procedural", "--preempt", "off")
    yield running
    running.stop()


async def test_a_key_tapped_between_two_chunks_moves_the_world_for_one_chunk(steady_server: RunningServer) -> None:
    """A key pressed and released between two boundaries is held in the next chunk alone (the seed's snapshot,
    the latest keys, would never show it), and the same holds when the release supersedes the press."""
    for event_id, (tap, release) in enumerate([(keys("D"), keys()), (keys("W", "A"), keys("W"))], start=1):
        async with WorldClient(steady_server.ws, auto_ack=False) as client:
            info = await client.start(prompt="forest", seed=3)
            # Acks withheld: after max_lag_chunks chunks the server makes none until one comes.
            made = [await client.next_chunk(timeout=30) for _ in range(info.max_lag_chunks)]
            await client.send_event(controls=[tap], event_id=2 * event_id)
            await client.send_event(controls=[release], event_id=2 * event_id + 1)
            for chunk in made:
                await client.ack(chunk.seq)
            tapped, after = await client.next_chunk(timeout=30), await client.next_chunk(timeout=30)
        assert [notice.event_ids for notice in client.dropped] == [(2 * event_id,)]  # the release superseded it
        assert tapped.applied_event_ids == (2 * event_id + 1,)
        truth = Truth(3, "forest")
        for chunk in made:
            assert np.array_equal(chunk.frames, truth.next(None, []))
        held = set(tap.data["held"])
        assert np.array_equal(tapped.frames, truth.next(None, [keys(*sorted(held))])), "the tap is not shown"
        assert np.array_equal(after.frames, truth.next(None, [release])), "the tapped key is still held"


async def test_a_held_key_with_acks_paused_never_overflows_the_queue(server: RunningServer) -> None:
    async with WorldClient(server.ws) as client:
        info = await client.start(prompt="forest", seed=1)
        assert info.model["continuous_tracks"] == ["keys", "camera"]
        # Acks paused: nothing reads (and so acknowledges) chunks while the key is held.
        pattern = (("W",), ("W", "D"), ("D",), ())
        for event_id in range(1, HELD_EVENTS + 1):
            acceptance = await client.send_event(controls=[keys(*pattern[event_id % 4])], event_id=event_id)
            assert acceptance.status == "accepted"  # never queue_full
            assert acceptance.pending <= info.max_pending_events
        # Acks resume: read until the last key event is applied.
        applied: list[int] = []
        while HELD_EVENTS not in applied:
            chunk = await client.next_chunk(timeout=30)
            applied.extend(chunk.applied_event_ids)
        await client.close()
    superseded = [event_id for notice in client.dropped for event_id in notice.event_ids]
    assert {notice.reason for notice in client.dropped} == {"superseded"}
    for notice in client.dropped:
        successor = int(notice.detail.removeprefix("superseded by event "))
        assert successor > max(notice.event_ids)
    assert len(applied) == len(set(applied)), "an event applied twice"
    assert len(superseded) == len(set(superseded)), "an event reported twice"
    assert not set(applied) & set(superseded)
    assert set(applied) | set(superseded) == set(range(1, HELD_EVENTS + 1)), "an event neither applied nor reported"
    assert len(superseded) > HELD_EVENTS // 2  # the queue really was full, and coalesced


async def test_bench_books_superseded_events_as_dropped_with_a_reason(server: RunningServer) -> None:
    """Held-key events far faster than chunks: many are superseded, and the books still balance."""
    result = await run_bench(server.ws, clients=2, duration=1.5, event_interval=0.002, settle=5.0)
    assert "of them superseded" in format_table(result)
    for report in result.reports:
        assert "queue_full" not in report.errors, report.errors
        assert report.lost == 0
        assert report.applied_twice == 0
        assert report.applied_once + report.dropped == report.accepted
        assert 0 < report.superseded == report.dropped


async def test_cancel_mid_chunk_over_a_socket_keeps_the_world(slow_server: RunningServer) -> None:
    async with WorldClient(slow_server.ws) as client:
        info = await client.start(prompt="slow", seed=4)
        assert info.model["can_rollback"] is True
        chunks: list[ClientChunk] = [await client.next_chunk(timeout=30)]
        sent = {}
        acceptance = await client.send_event(controls=[keys("D")])
        sent[acceptance.event_id] = keys("D")
        cancelled = None
        refusals: set[str] = set()
        while cancelled is None:  # a chunk is almost always in flight (steps are slower than playback)
            try:
                cancelled = await client.cancel_chunk()
            except WorldError as error:
                refusals.add(error.code)
                await asyncio.sleep(0.05)
        assert refusals <= {"nothing_to_cancel"}
        acceptance = await client.send_event(controls=[keys("W")])
        sent[acceptance.event_id] = keys("W")

        def dropped() -> set[int]:
            return {event_id for notice in client.dropped for event_id in notice.event_ids}

        while len(chunks) < 5 or set(sent) - {e for c in chunks for e in c.applied_event_ids} - dropped():
            chunks.append(await client.next_chunk(timeout=30))
        await client.close()
    # The cancelled chunk's events go back to the queue; one that the newer key event finds there is
    # superseded (held keys), and told so: never lost silently.
    assert all(notice.reason == "superseded" for notice in client.dropped), client.dropped
    assert [chunk.chunk_index for chunk in chunks] == list(range(len(chunks))), "no index skipped or repeated"
    assert [chunk.seq for chunk in chunks] == list(range(len(chunks)))
    assert 1 <= cancelled < len(chunks)
    applied = [event_id for chunk in chunks for event_id in chunk.applied_event_ids]
    assert sorted(applied + list(dropped())) == sorted(sent), "each event applied exactly once, or superseded"
    assert max(sent) in applied  # the newest is never superseded
    # A chunk holds the keys held at its boundary and those pressed since the last one: a superseded
    # event's press is carried by the event that superseded it.
    carried: dict[int, list[int]] = {}
    for notice in client.dropped:
        carried.setdefault(int(notice.detail.removeprefix("superseded by event ")), []).extend(notice.event_ids)
    truth = Truth(4, "slow")
    held: set[str] = set()
    for chunk in chunks:
        pressed: set[str] = set()
        for event_id in chunk.applied_event_ids:
            for step in [*sorted(carried.get(event_id, ())), event_id]:
                now = set(sent[step].data["held"])
                pressed |= now - held
                held = now
        expected = truth.next(None, [keys(*sorted(held), *sorted(pressed - held))])
        assert np.array_equal(chunk.frames, expected), f"chunk {chunk.chunk_index} is not the world"


async def test_transition_chunks_is_refused_by_a_model_without_the_prompt_transition_track(
    server: RunningServer,
) -> None:
    async with WorldClient(server.ws) as client:
        info = await client.start(prompt="forest", seed=1)
        assert "prompt_transition" not in {c["track"] for c in info.model["controls"]}
        with pytest.raises(WorldError) as refused:
            await client.send_event(prompt="desert", transition_chunks=3, event_id=1)
        assert refused.value.code == "invalid_control"
        assert "prompt_transition" in refused.value.message
        with pytest.raises(WorldError) as alone:
            await client.send_event(controls=[keys("W")], transition_chunks=3, event_id=2)
        assert alone.value.code == "invalid_message"
        assert "no prompt" in alone.value.message
        assert (await client.send_event(prompt="desert", event_id=3)).status == "accepted"
        await client.close()
