"""The waiting room without a server: a fake capacity and fake starts, assertions on order and positions.

Each test drives the room the way the server does (``admit`` per start, ``world_ended``
when a world ends) and asserts what each waiter was told and in which order starts got in.
"""

from __future__ import annotations

import asyncio

import pytest

from worldserve.errors import AdmissionRefusedError
from worldserve.runtime.metrics import Capacity
from worldserve.server.waiting import Position, WaitingRoom


class _Slots:
    """A server with ``slots`` slots; a start takes one, a world's end frees one."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.held = 0
        self.made: list[str] = []
        self.released: list[str] = []
        self.calls = 0

    def capacity(self) -> Capacity:
        free = self.slots - self.held
        return Capacity(free=free, workers_alive=1, slots=self.slots, room=free > 0)

    def start(self, name: str) -> asyncio.Future[str]:
        async def create() -> str:
            self.calls += 1
            await asyncio.sleep(0)
            if self.held >= self.slots:
                raise AdmissionRefusedError("full")
            self.held += 1
            self.made.append(name)
            return name

        return create  # type: ignore[return-value]

    async def release(self, name: str) -> None:
        self.released.append(name)
        self.held -= 1

    def end(self, room: WaitingRoom[str], length_s: float = 10.0) -> None:
        self.held -= 1
        room.world_ended(length_s)


def _room(slots: _Slots, clock: list[float] | None = None, **options: float) -> WaitingRoom[str]:
    """A room on ``slots`` whose clock reads ``clock[0]`` (0 when not given: time stands still)."""
    now = clock if clock is not None else [0.0]
    defaults = {"max_waiting": 8, "timeout_s": 60.0, "poll_s": 0.01, "notice_interval_s": 0.0}
    return WaitingRoom(  # type: ignore[misc]
        capacity=slots.capacity, release=slots.release, clock=lambda: now[0], **{**defaults, **options}
    )


async def _until(condition: object, what: str) -> None:
    for _ in range(2000):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError(what)


async def test_first_come_first_served_with_positions_that_count_down() -> None:
    slots = _Slots(1)
    room = _room(slots)
    told: dict[str, list[Position]] = {name: [] for name in "abcd"}
    assert await room.admit(slots.start("a"), told["a"].append) == "a"  # room: in at once, never queued
    waiting = {
        name: asyncio.ensure_future(room.admit(slots.start(name), told[name].append)) for name in ("b", "c", "d")
    }
    await _until(lambda: room.waiting == 3, "three in line")
    assert [told[name][0].position for name in "bcd"] == [1, 2, 3]
    assert [told[name][0].ahead for name in "bcd"] == [0, 1, 2]
    assert told["a"] == []
    assert told["b"][0].eta_s is None  # no world has ended yet: nothing measured
    slots.end(room, length_s=30.0)  # a's world ends: b is next
    assert await waiting["b"] == "b"
    await _until(lambda: told["d"][-1].position == 2, "d moved up")
    assert [p.position for p in told["c"]] == [2, 1]
    assert told["c"][-1].eta_s == pytest.approx(30.0)  # 1 ahead of the slot x 30 s mean / 1 slot
    slots.end(room)  # b's world ends: c is next
    assert await waiting["c"] == "c"
    assert not waiting["d"].done()
    slots.end(room)
    assert await waiting["d"] == "d"
    assert slots.made == ["a", "b", "c", "d"]
    assert room.waiting == 0


async def test_leaving_the_line_frees_the_position_and_a_start_admitted_meanwhile_is_released() -> None:
    slots = _Slots(1)
    room = _room(slots)
    told: dict[str, list[Position]] = {name: [] for name in "bc"}
    await room.admit(slots.start("a"), lambda _: None)
    b = asyncio.ensure_future(room.admit(slots.start("b"), told["b"].append))
    c = asyncio.ensure_future(room.admit(slots.start("c"), told["c"].append))
    await _until(lambda: room.waiting == 2, "two in line")
    b.cancel()  # b's client left (session.close or a dropped socket)
    with pytest.raises(asyncio.CancelledError):
        await b
    await _until(lambda: told["c"][-1].position == 1, "c moved up")
    assert room.waiting == 1
    slots.end(room)
    assert await c == "c"
    assert slots.made == ["a", "c"]
    assert slots.released == []


async def test_a_start_without_queue_never_overtakes_the_line() -> None:
    slots = _Slots(1)
    room = _room(slots)
    await room.admit(slots.start("a"), lambda _: None)
    waiter = asyncio.ensure_future(room.admit(slots.start("b"), lambda _: None))
    await _until(lambda: room.waiting == 1, "b in line")
    with pytest.raises(AdmissionRefusedError, match="waiting in line came first") as refused:
        room.refuse_if_waiting()
    assert refused.value.retry_after_s is not None
    slots.end(room)
    assert await waiter == "b"
    room.refuse_if_waiting()  # nobody waits: a plain start goes ahead


async def test_the_line_is_bounded_and_each_wait_capped() -> None:
    slots = _Slots(1)
    outcomes: list[str] = []
    room = _room(slots, max_waiting=1, timeout_s=0.2)
    room._on_wait = lambda outcome, waited: outcomes.append(outcome)
    await room.admit(slots.start("a"), lambda _: None)
    waiter = asyncio.ensure_future(room.admit(slots.start("b"), lambda _: None))
    await _until(lambda: room.waiting == 1, "b in line")
    with pytest.raises(AdmissionRefusedError, match="waiting line is too"):
        await room.admit(slots.start("c"), lambda _: None)
    with pytest.raises(AdmissionRefusedError, match="in line and the server is still full"):
        await waiter  # nobody ended a world within the cap
    assert outcomes == ["full", "timeout"]
    assert room.waiting == 0
    assert slots.made == ["a"]


async def test_other_errors_of_a_start_reach_only_that_waiter() -> None:
    slots = _Slots(1)
    room = _room(slots)
    await room.admit(slots.start("a"), lambda _: None)

    async def bad() -> str:
        raise ValueError("options the model cannot take")

    first = asyncio.ensure_future(room.admit(slots.start("b"), lambda _: None))
    await _until(lambda: room.waiting == 1, "b in line")
    second = asyncio.ensure_future(room.admit(bad, lambda _: None))
    third = asyncio.ensure_future(room.admit(slots.start("c"), lambda _: None))
    await _until(lambda: room.waiting == 3, "three in line")
    slots.end(room)
    assert await first == "b"
    slots.end(room)
    with pytest.raises(ValueError, match="cannot take"):
        await second
    assert await third == "c"


async def test_position_notices_are_throttled_but_the_last_position_is_always_told() -> None:
    slots = _Slots(1)
    clock_value = [0.0]
    room = WaitingRoom(
        capacity=slots.capacity,
        release=slots.release,
        max_waiting=10,
        timeout_s=60.0,
        poll_s=0.01,
        notice_interval_s=1.0,
        clock=lambda: clock_value[0],
    )
    await room.admit(slots.start("a"), lambda _: None)
    told: list[Position] = []
    ahead = [asyncio.ensure_future(room.admit(slots.start(f"x{i}"), lambda _: None)) for i in range(3)]
    await _until(lambda: room.waiting == 3, "three ahead")
    last = asyncio.ensure_future(room.admit(slots.start("last"), told.append))
    await _until(lambda: room.waiting == 4, "four in line")
    for waiter in ahead:  # three leave within the same second: one notice at most in that second
        waiter.cancel()
    await asyncio.gather(*ahead, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert [p.position for p in told] == [4]  # the first notice is always sent; changes wait out the second
    clock_value[0] = 1.5
    await _until(lambda: told[-1].position == 1, "the position after the throttle")
    assert [p.position for p in told] == [4, 1]
    slots.end(room)
    assert await last == "last"


async def test_the_estimate_counts_down_while_one_waits_and_updates_carry_it() -> None:
    """Item 9 of issue 30: the line's ``eta_s`` used to stay what it was at the last position change. Now each
    waiter's estimate counts the time it has waited since then (or since the last world ended) off the
    next world's expected end, and updates carry the fresh estimate (at most once per notice interval)."""
    slots = _Slots(1)
    clock = [100.0]
    room = _room(slots, clock, notice_interval_s=1.0)
    await room.admit(slots.start("a"), lambda _: None)
    slots.end(room, length_s=30.0)  # the mean world: 30 s; one slot, so one ends every 30 s
    await room.admit(slots.start("b"), lambda _: None)
    told: dict[str, list[Position]] = {"c": [], "d": []}
    c = asyncio.ensure_future(room.admit(slots.start("c"), told["c"].append))
    d = asyncio.ensure_future(room.admit(slots.start("d"), told["d"].append))
    await _until(lambda: room.waiting == 2, "two in line")
    assert [(p.position, p.eta_s) for p in told["c"]] == [(1, 30.0)]
    assert [(p.position, p.eta_s) for p in told["d"]] == [(2, 60.0)]
    clock[0] = 110.0  # ten seconds in line, nobody moved
    await _until(lambda: len(told["d"]) == 2, "d told its fresh estimate")
    await _until(lambda: len(told["c"]) == 2, "c told its fresh estimate")
    assert (told["c"][-1].position, told["c"][-1].eta_s) == (1, 20.0)
    assert (told["d"][-1].position, told["d"][-1].eta_s) == (2, 50.0)
    clock[0] = 110.5  # within the notice interval: nothing more, though the estimate moved
    await asyncio.sleep(0.05)
    assert (len(told["c"]), len(told["d"])) == (2, 2)
    clock[0] = 140.0  # past the expected end: the next world ends any moment, the one after it in 30 s
    await _until(lambda: told["c"][-1].eta_s == 0.0, "c is next any moment")
    await _until(lambda: told["d"][-1].eta_s == 30.0, "d waits one world more")
    clock[0] = 150.0  # overdue: the estimate stays where it is, and so nothing more is told
    await asyncio.sleep(0.05)
    assert (len(told["c"]), len(told["d"])) == (3, 3)
    slots.end(room, length_s=30.0)  # b ends: c starts, d is next, a full world from now
    assert await c == "c"
    await _until(lambda: told["d"][-1].position == 1, "d moved up")
    assert told["d"][-1].eta_s == 30.0
    clock[0] = 162.0
    await _until(lambda: told["d"][-1].eta_s == 18.0, "d counts down again")
    assert [p.position for p in told["d"]] == [2, 2, 2, 1, 1]
    slots.end(room)
    assert await d == "d"


async def test_a_room_that_stops_admitting_refuses_those_in_line_and_every_later_start() -> None:
    """A drain: those waiting are refused at once with the reason and a retry hint (through a balancer the
    retry lands on another front-end), a start with or without queue too, and nothing is made."""
    slots = _Slots(1)
    room = _room(slots)
    assert await room.admit(slots.start("a"), lambda _: None) == "a"
    waiting = [asyncio.ensure_future(room.admit(slots.start(name), lambda _: None)) for name in "bc"]
    await _until(lambda: room.waiting == 2, "two in line")
    assert room.admitting
    room.stop_admitting("draining", retry_after_s=2.0)
    assert not room.admitting
    for refused in await asyncio.gather(*waiting, return_exceptions=True):
        assert isinstance(refused, AdmissionRefusedError)
        assert str(refused) == "draining"
        assert refused.retry_after_s == 2.0
    slots.end(room)  # room again: nobody is admitted any more
    with pytest.raises(AdmissionRefusedError, match="draining"):
        await room.admit(slots.start("d"), lambda _: None)
    with pytest.raises(AdmissionRefusedError, match="draining"):
        room.refuse_if_waiting()
    assert slots.made == ["a"]
    assert room.waiting == 0
