"""A key tapped between two chunk boundaries reaches the model (the session's held-keys rule).

A ``keys`` event is held-key state, and a tick applies the latest state: a key pressed and released
between two boundaries would never be seen. The session holds, in a tick, the keys held at its boundary
and those pressed since the last one (ABot-World's "activated" keys); a superseding event carries the
presses of those it superseded. Released keys are released at once: only presses are carried.
The real server's side is ``test_server_controls.py`` (a tap over a socket, frames checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from test_session import control, make
from worldserve import ControlInput, SessionEvent
from worldserve.protocol import HELD_KEYS_SCHEMA_NAME, held_keys

KEYS = ("W", "A", "S", "D")


def keys(*held: str, track: str = "keys") -> ControlInput:
    return ControlInput(track, HELD_KEYS_SCHEMA_NAME, {"held": list(held)})


def shown(tick_controls: Sequence[ControlInput], track: str = "keys") -> frozenset[str] | None:
    return next((held_keys(c) for c in tick_controls if c.track == track), None)


async def test_a_tap_between_two_boundaries_is_held_for_one_chunk() -> None:
    session, consumer, _ = make(max_pending=8)
    await session.accept_event(SessionEvent(1, controls=(keys("D"),)))
    await session.accept_event(SessionEvent(2, controls=(keys(),)))
    await session.next_chunk()
    await session.next_chunk()
    assert [shown(tick.controls) for tick in consumer.ticks] == [{"D"}, set()]
    assert consumer.ticks[0].applied_event_ids == (1, 2)
    assert session.controls == (keys(),)  # the state: D is not held
    assert consumer.ticks[0].controls == (keys("D"),)  # the press as sent: no key added, none reordered


async def test_a_release_is_not_delayed_and_a_held_keys_repeats_are_not_presses() -> None:
    session, consumer, _ = make(max_pending=8, coalesce_tracks=frozenset({"keys"}))
    await session.accept_event(SessionEvent(1, controls=(keys("W"),)))
    await session.next_chunk()
    for event_id in (2, 3):  # W held, said again (superseded), then released
        await session.accept_event(SessionEvent(event_id, controls=(keys("W"),)))
    await session.accept_event(SessionEvent(4, controls=(keys("A"),)))
    await session.accept_event(SessionEvent(5, controls=(keys(),)))
    await session.next_chunk()
    assert consumer.ticks[-1].applied_event_ids == (5,)
    assert consumer.ticks[-1].controls == (keys("A"),)  # A tapped; W's release not held back
    assert session.stats.superseded == 3


async def test_the_tapped_keys_follow_the_held_ones_in_key_order_and_other_data_is_kept() -> None:
    session, consumer, _ = make(max_pending=8)
    held = ControlInput("keys", HELD_KEYS_SCHEMA_NAME, {"held": ["S"], "source": "pad"})
    await session.accept_event(SessionEvent(1, controls=(keys("D", "A"),)))
    await session.accept_event(SessionEvent(2, controls=(keys("D", "A", "S"), control("cam", x=1))))
    await session.accept_event(SessionEvent(3, controls=(held,)))
    await session.next_chunk()
    [cam, tick_keys] = consumer.ticks[-1].controls
    assert cam == control("cam", x=1)
    assert tick_keys == ControlInput("keys", HELD_KEYS_SCHEMA_NAME, {"held": ["S", "A", "D"], "source": "pad"})


async def test_a_model_that_refuses_the_keys_together_gets_the_state_alone() -> None:
    class OneKey:
        def validate_controls(self, controls: Sequence[ControlInput]) -> None:
            for c in controls:
                if len(held_keys(c) or ()) > 1:
                    raise ValueError("one key at a time")

    session, consumer, _ = make(max_pending=8, control_validator=OneKey())
    await session.accept_event(SessionEvent(1, controls=(keys("W"),)))
    await session.next_chunk()
    await session.accept_event(SessionEvent(2, controls=(keys("D"),)))
    await session.accept_event(SessionEvent(3, controls=(keys(),)))
    await session.next_chunk()
    assert consumer.ticks[-1].controls == (keys("D"),)  # W released, D tapped: one key, allowed
    await session.accept_event(SessionEvent(4, controls=(keys("A"),)))
    await session.accept_event(SessionEvent(5, controls=(keys("S"),)))
    await session.next_chunk()
    assert consumer.ticks[-1].controls == (keys("S"),)  # A and S together would be refused: S, the state


async def test_other_schemas_keep_the_seeds_snapshot() -> None:
    session, consumer, _ = make(max_pending=8)
    await session.accept_event(SessionEvent(1, controls=(ControlInput("keys", "other.v1", {"held": ["D"]}),)))
    await session.accept_event(SessionEvent(2, controls=(ControlInput("keys", "other.v1", {"held": []}),)))
    await session.next_chunk()
    assert consumer.ticks[-1].controls == (ControlInput("keys", "other.v1", {"held": []}),)


_op = st.one_of(
    st.tuples(st.just("event"), st.frozensets(st.sampled_from(KEYS)), st.booleans()),
    st.tuples(st.just("tick"), st.just(frozenset()), st.just(False)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=40), coalesce=st.booleans(), limit=st.sampled_from([None, 2]))
async def test_every_press_shows_in_the_next_tick_and_nothing_else_is_added(
    ops: list[tuple[str, frozenset[str], bool]], coalesce: bool, limit: int | None
) -> None:
    """Against a model of the rule: a tick holds the keys held at its boundary and every key pressed since the
    last one (unless the model refuses them together: then the state alone); every event is applied once or
    superseded once."""

    class Limit:
        def validate_controls(self, controls: Sequence[ControlInput]) -> None:
            if limit is not None and any(len(held_keys(c) or ()) > limit for c in controls):
                raise ValueError("too many keys")

    options: dict[str, Any] = {"coalesce_tracks": frozenset({"keys", "cam"})} if coalesce else {}
    session, consumer, _ = make(max_pending=64, control_validator=Limit(), **options)
    state: frozenset[str] = frozenset()  # the keys held after the last event
    before = state  # ... at the last boundary
    pressed: set[str] = set()
    accepted: list[int] = []
    for event_id, (op, held, with_camera) in enumerate(ops):
        if op == "event":
            if limit is not None and len(held) > limit:
                continue  # refused at acceptance, as the model would
            controls = (keys(*sorted(held)), control("cam", x=event_id)) if with_camera else (keys(*sorted(held)),)
            await session.accept_event(SessionEvent(event_id, controls=controls))
            accepted.append(event_id)
            pressed |= held - state
            state = held
            continue
        await session.next_chunk()
        tick = consumer.ticks[-1]
        want = state | pressed
        if limit is not None and len(want) > limit:
            want = state
        assert shown(tick.controls) == (want if accepted else None), (before, pressed, state)
        assert [c for c in session.controls if c.track == "keys"] == ([keys(*sorted(state))] if accepted else [])
        before, pressed = state, set()
    applied = [event_id for tick in consumer.ticks for event_id in tick.applied_event_ids]
    superseded = [event_id for drop in session.take_dropped() for event_id in drop.event_ids]
    assert sorted(applied + superseded + list(session.pending_event_ids)) == accepted
