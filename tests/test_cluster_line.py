"""The service's waiting line: pure (simulated time), then two front-ends' waiting rooms sharing one.

The rooms here share a :class:`ClusterLine` through an in-test :class:`SharedLine` (no Ray); the
real actor, real front-ends and a real balancer are ``test_front_ends.py``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldserve.errors import AdmissionRefusedError
from worldserve.runtime.metrics import Capacity
from worldserve.server.cluster_line import ClusterLine, LineAnswer
from worldserve.server.waiting import Position, StartMoved, WaitingRoom

A, B = "ws://a/v1/world", "ws://b/v1/world"


def test_the_head_of_the_line_goes_to_the_first_front_end_with_room_wherever_it_waits() -> None:
    line = ClusterLine()
    for ticket, owner in (("t1", A), ("t2", B), ("t3", A)):
        line.join(owner, ticket, 0.0)
    full = line.poll(A, free=0, slots=1, tickets=("t1", "t3"), now=0.1)
    assert full.places == {"t1": (1, 0, None), "t3": (3, 2, None)}
    assert (full.admit, full.moved, full.expect, full.waiting) == ((), {}, (), 3)
    room = line.poll(B, free=1, slots=1, tickets=("t2",), now=0.2)  # b has room first: t1 is placed there
    assert (room.admit, room.expect, room.places) == ((), ("t1",), {"t2": (2, 1, None)})
    told = line.poll(A, free=0, slots=1, tickets=("t3",), now=0.3)  # a no longer holds t1: its client moves
    assert told.moved == {"t1": B}
    assert told.places == {"t3": (3, 2, None)}  # t1 counts ahead until it started
    again = line.poll(B, free=1, slots=1, tickets=("t2",), now=0.4)  # its reservation holds b's slot
    assert (again.admit, again.expect) == ((), ("t1",))
    line.leave("t1")  # t1's client started on b
    mine = line.poll(B, free=1, slots=1, tickets=("t2",), now=0.5)
    assert (mine.admit, mine.expect, mine.waiting) == (("t2",), (), 2)


def test_a_reservation_not_taken_lapses_and_a_silent_front_end_leaves_with_its_tickets() -> None:
    line = ClusterLine(reservation_ttl_s=2.0, front_end_ttl_s=5.0)
    line.join(A, "t1", 0.0)
    line.join(A, "t2", 0.0)
    assert line.poll(B, free=1, slots=1, tickets=(), now=0.0).expect == ("t1",)
    assert line.poll(A, free=0, slots=1, tickets=("t2",), now=1.0).moved == {"t1": B}
    assert line.poll(B, free=1, slots=1, tickets=(), now=3.0).expect == ("t2",)  # t1 lapsed: t2 is next
    assert line.poll(A, free=0, slots=1, tickets=(), now=3.5).waiting == 1
    # a falls silent: its waiting tickets go with it (their clients were connected to it), and what was
    # placed on it goes back to its place in line.
    line.join(A, "t3", 4.0)
    line.join(B, "t4", 4.0)
    placed = line.poll(A, free=2, slots=2, tickets=("t3",), now=4.0)
    assert (placed.admit, placed.expect) == (("t3",), ("t4",))
    later = line.poll(B, free=0, slots=1, tickets=("t4",), now=10.0)
    assert (later.waiting, later.places, later.moved) == (1, {"t4": (1, 0, None)}, {})


def test_the_estimate_is_the_whole_services() -> None:
    line = ClusterLine()
    line.join(A, "t1", 0.0)
    line.join(B, "t2", 0.0)
    line.poll(A, free=0, slots=2, tickets=("t1",), now=0.0)
    line.ended([40.0, 20.0], now=1.0)  # worlds of 30 s on average; 4 slots in the service
    answer = line.poll(B, free=0, slots=2, tickets=("t2",), now=3.0)
    assert answer.places["t2"] == (2, 1, round(7.5 - 2.0 + 7.5, 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([A, B]), st.integers(min_value=0, max_value=2), st.booleans()), max_size=40))
def test_starts_happen_in_arrival_order_whichever_front_end_has_room(polls: list[tuple[str, int, bool]]) -> None:
    """Tickets joined in order across both front-ends; any sequence of polls with any room: the tickets
    that get a place (to admit or to move to) get it in arrival order, and no front-end is given more
    places than the room it said it had."""
    line = ClusterLine()
    order = [f"t{i}" for i in range(10)]
    held = {A: [t for i, t in enumerate(order) if i % 2 == 0], B: [t for i, t in enumerate(order) if i % 2]}
    for i, ticket in enumerate(order):
        line.join(A if i % 2 == 0 else B, ticket, 0.0)
    placed: list[str] = []
    pending: dict[str, list[str]] = {A: [], B: []}  # placed here, not started yet
    for now, (front_end, free, start) in enumerate(polls, 1):
        before = len(pending[front_end])
        answer = line.poll(front_end, free, 4, tuple(held[front_end]), float(now) * 0.01)
        new = [t for t in (*answer.admit, *answer.expect) if t not in placed]
        assert len(new) <= max(0, free - before), "more places than the room it said it had"
        placed.extend(sorted(new, key=order.index))
        pending[front_end] = [*answer.admit, *answer.expect]
        for ticket in answer.moved:  # told again each poll until its client started there
            if ticket in held[front_end]:
                held[front_end].remove(ticket)
        if start:  # the front-end starts what was placed on it
            for ticket in pending[front_end]:
                line.leave(ticket)
                for tickets in held.values():
                    if ticket in tickets:
                        tickets.remove(ticket)
            pending[front_end] = []
    assert placed == order[: len(placed)]


class _Service:
    """Two rooms' shared line: a ClusterLine behind the SharedLine a room needs (the clock: 0)."""

    def __init__(self) -> None:
        self.line = ClusterLine()
        self.up = True

    def door(self, url: str) -> _Door:
        return _Door(self, url)


class _Door:
    def __init__(self, service: _Service, url: str) -> None:
        self.service = service
        self.url = url

    @property
    def shared(self) -> bool:
        return self.service.up

    async def join(self, ticket: str) -> int | None:
        return self.service.line.join(self.url, ticket, 0.0) if self.service.up else None

    def leave(self, ticket: str) -> None:
        self.service.line.leave(ticket)

    def unplace(self, ticket: str) -> None:
        self.service.line.unplace(ticket)

    async def placed_here(self, ticket: str) -> bool:
        return self.service.up and self.service.line.placed_on(self.url, ticket)

    def ended(self, length_s: float) -> None:
        self.service.line.ended([length_s], 0.0)

    async def poll(self, free: int, slots: int | None, tickets: tuple[str, ...]) -> LineAnswer | None:
        return self.service.line.poll(self.url, free, slots, tickets, 0.0) if self.service.up else None


class _Slots:
    def __init__(self, slots: int) -> None:
        self.slots, self.held, self.made = slots, 0, []

    def capacity(self) -> Capacity:
        free = self.slots - self.held
        return Capacity(free=free, workers_alive=1, slots=self.slots, room=free > 0)

    def start(self, name: str) -> Callable[[], Awaitable[str]]:
        async def create() -> str:
            if self.held >= self.slots:
                raise AdmissionRefusedError("full")
            self.held += 1
            self.made.append(name)
            return name

        return create

    async def release(self, name: str) -> None:
        self.held -= 1


def _room(slots: _Slots, door: _Door) -> WaitingRoom[str]:
    return WaitingRoom(
        capacity=slots.capacity,
        release=slots.release,
        max_waiting=16,
        timeout_s=60.0,
        poll_s=0.01,
        notice_interval_s=0.0,
        shared=door,
    )


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(what)


async def test_two_rooms_sharing_a_line_start_in_arrival_order_and_move_a_start_to_the_room_that_has_room() -> None:
    service = _Service()
    slots = {A: _Slots(1), B: _Slots(1)}
    rooms = {url: _room(slots[url], service.door(url)) for url in (A, B)}
    for room in rooms.values():
        room.start_sharing()
    told: dict[str, list[Position]] = {}
    waits: dict[str, asyncio.Future[Any]] = {}
    try:
        assert await rooms[A].admit(slots[A].start("a0"), lambda _: None) == "a0"
        assert await rooms[B].admit(slots[B].start("b0"), lambda _: None) == "b0"
        for i, url in enumerate((A, B, A, B)):  # q0 on a, q1 on b, ...
            name = f"q{i}"
            told[name] = []
            waits[name] = asyncio.ensure_future(rooms[url].admit(slots[url].start(name), told[name].append))
            await _until(lambda name=name: bool(told[name]), f"{name} told its place")
        assert [told[f"q{i}"][0].position for i in range(4)] == [1, 2, 3, 4]  # places in the service's line
        with pytest.raises(AdmissionRefusedError, match="came first"):
            rooms[B].refuse_if_waiting()  # an unqueued start never overtakes the service's line

        slots[B].held -= 1  # a world ends on b: q0, waiting on a, is placed on b
        with pytest.raises(StartMoved) as moved:
            await waits["q0"]
        assert moved.value.url == B
        started = await rooms[B].admit(slots[B].start("q0"), lambda _: None, moved.value.reservation)
        assert started == "q0"  # its reservation: admitted at once on b
        await _until(lambda: all(told[f"q{i}"][-1].position == i for i in (1, 2, 3)), "places counted down")

        slots[A].held -= 1  # then one on a: q1 (waiting on b) moves to a
        with pytest.raises(StartMoved) as moved:
            await waits["q1"]
        assert moved.value.url == A
        assert await rooms[A].admit(slots[A].start("q1"), lambda _: None, moved.value.reservation) == "q1"
        slots[A].held -= 1  # and again on a: q2 waits there, so it starts there
        assert await waits["q2"] == "q2"
        assert slots[A].made == ["a0", "q1", "q2"]
        assert slots[B].made == ["b0", "q0"]

        service.up = False  # the service is lost: each room is its own line again
        slots[B].held -= 1
        assert await waits["q3"] == "q3"
    finally:
        for room in rooms.values():
            await room.aclose()
        await asyncio.gather(*waits.values(), return_exceptions=True)


async def test_a_reserved_start_that_comes_before_its_rooms_next_poll_is_admitted_at_once() -> None:
    """The line placed a start on b and its client came to b before b's room heard so: b asks the line."""
    service = _Service()
    slots = _Slots(1)
    room = _room(slots, service.door(B))  # not sharing: its poll never runs here
    service.line.join(A, "t1", 0.0)
    assert service.line.poll(B, free=1, slots=1, tickets=(), now=0.0).expect == ("t1",)  # placed on b
    assert await room.admit(slots.start("moved"), lambda _: None, "t1") == "moved"
    assert service.line.poll(B, free=0, slots=1, tickets=(), now=0.1).waiting == 0  # it left the line
    with pytest.raises(TimeoutError):  # an unknown reservation is a start like any other: it waits in line
        await asyncio.wait_for(room.admit(slots.start("other"), lambda _: None, "no-such"), 0.2)
    assert slots.made == ["moved"]
    await room.aclose()
