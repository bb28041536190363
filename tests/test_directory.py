"""The session directory's table (pure, in simulated time) and a front-end's side of it.

The store here is an in-test table behind awaitables, to drive a lost and a recovered store
without Ray; the Ray actor itself is exercised by ``test_front_ends.py`` through real servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldserve.server.directory import Directory, DirectoryTable, world_url

A = "ws://lb.example/fe/1/v1/world"
B = "ws://lb.example/fe/2/v1/world"


def test_world_url_is_the_front_ends_websocket_route() -> None:
    assert world_url("http://10.0.0.2:8000") == "ws://10.0.0.2:8000/v1/world"
    assert world_url("https://lb.example/fe/1/") == "wss://lb.example/fe/1/v1/world"
    assert world_url("ws://lb.example/fe/1/v1/world") == "ws://lb.example/fe/1/v1/world"
    for bad in ("lb.example:8000", "ftp://x/", "http://", "http://x/?a=1"):
        with pytest.raises(ValueError, match="public URL"):
            world_url(bad)


def test_a_world_is_found_on_the_front_end_that_published_it_until_it_is_withdrawn() -> None:
    table = DirectoryTable(ttl_s=5.0)
    table.publish(A, "w1", now=0.0)
    table.refresh(B, ["w2", "w3"], now=0.0)
    assert (table.find("w1", 1.0), table.find("w2", 1.0), table.find("nope", 1.0)) == (A, B, None)
    table.withdraw(A, "w1", now=2.0)
    assert table.find("w1", 2.0) is None
    table.refresh(B, ["w3"], now=3.0)  # a refresh says the whole set: w2 ended
    assert (table.find("w2", 3.0), table.find("w3", 3.0)) == (None, B)
    assert table.front_ends(3.0) == {A: 0, B: 1}


def test_a_silent_front_end_is_forgotten_with_its_worlds() -> None:
    table = DirectoryTable(ttl_s=5.0)
    table.refresh(A, ["w1"], now=0.0)
    table.refresh(B, ["w2"], now=0.0)
    table.refresh(B, ["w2"], now=4.0)
    assert table.find("w1", 5.0) == A  # ttl not passed yet
    assert table.find("w1", 5.5) is None  # A died without leaving: its worlds died with it
    assert table.find("w2", 5.5) == B
    assert table.front_ends(5.5) == {B: 1}


def test_a_world_that_moved_belongs_to_its_latest_claim_and_the_old_withdraw_leaves_it() -> None:
    table = DirectoryTable(ttl_s=5.0)
    table.publish(A, "w", now=0.0)
    table.publish(B, "w", now=1.0)
    assert table.find("w", 1.0) == B
    table.withdraw(A, "w", now=1.5)  # A's late withdraw does not undo B's claim
    assert table.find("w", 1.5) == B
    table.leave(A)
    assert table.find("w", 1.5) == B
    table.leave(B)
    assert table.find("w", 1.5) is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["publish", "withdraw", "refresh", "leave"]),
            st.sampled_from([A, B]),
            st.sets(st.sampled_from(["w1", "w2", "w3"]), max_size=3),
        ),
        max_size=30,
    )
)
def test_the_table_agrees_with_a_model_of_who_claimed_what_last(steps: list[tuple[str, str, set[str]]]) -> None:
    """Against a plain model (no time passes): a world is found on the front-end whose claim on it came
    last and was neither withdrawn, replaced by its refresh nor ended by its leave."""
    table = DirectoryTable(ttl_s=5.0)
    owner: dict[str, str] = {}
    for verb, url, worlds in steps:
        if verb == "publish":
            for world in sorted(worlds):
                table.publish(url, world, 0.0)
                owner[world] = url
        elif verb == "withdraw":
            for world in sorted(worlds):
                table.withdraw(url, world, 0.0)
                if owner.get(world) == url:
                    del owner[world]
        elif verb == "refresh":
            table.refresh(url, sorted(worlds), 0.0)
            for world in [w for w, u in owner.items() if u == url and w not in worlds]:
                del owner[world]
            owner.update(dict.fromkeys(worlds, url))
        else:
            table.leave(url)
            for world in [w for w, u in owner.items() if u == url]:
                del owner[world]
        for world in ("w1", "w2", "w3"):
            assert table.find(world, 0.0) == owner.get(world), (verb, url, worlds)


class _Store:
    """A table behind awaitables; while ``up`` is clear every call hangs (a lost head)."""

    where = "the test's table"

    def __init__(self) -> None:
        self.table = DirectoryTable(ttl_s=60.0)
        self.up = asyncio.Event()
        self.up.set()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _call(self, name: str, *args: Any) -> Awaitable[Any]:
        self.calls.append((name, args))
        timed = name in ("publish", "withdraw", "refresh", "find", "front_ends")
        result = getattr(self.table, name)(*args, *((0.0,) if timed else ()))

        async def answer() -> Any:
            await self.up.wait()
            return result

        return answer()

    def publish(self, url: str, world: str) -> Awaitable[Any]:
        return self._call("publish", url, world)

    def withdraw(self, url: str, world: str) -> Awaitable[Any]:
        return self._call("withdraw", url, world)

    def refresh(self, url: str, worlds: tuple[str, ...]) -> Awaitable[Any]:
        return self._call("refresh", url, worlds)

    def leave(self, url: str) -> Awaitable[Any]:
        return self._call("leave", url)

    def find(self, world: str) -> Awaitable[str | None]:
        return self._call("find", world)

    def front_ends(self) -> Awaitable[dict[str, int]]:
        return self._call("front_ends")

    async def follow(self, timeout: float) -> None:
        await asyncio.wait_for(self.up.wait(), timeout)

    async def reconnect(self, timeout: float) -> None:
        self.calls.append(("reconnect", ()))
        await asyncio.wait_for(self.up.wait(), timeout)  # found again once it is up


async def test_a_front_end_publishes_its_worlds_finds_others_and_goes_on_alone_while_the_store_is_lost() -> None:
    store = _Store()
    worlds = {"mine"}
    a = Directory(store, "http://lb.example/fe/1", refresh_s=0.05, timeout_s=0.2)
    b = Directory(store, "http://lb.example/fe/2", refresh_s=0.05, timeout_s=0.2)
    a.start(lambda: tuple(worlds))
    b.start(tuple)
    try:
        await asyncio.sleep(0.1)
        assert await b.find("mine") == A
        assert await a.find("mine") is None  # it lives here: nothing to tell
        worlds.add("new")  # as WorldHosts does: held, then published at once
        a.published("new")
        await asyncio.sleep(0)
        assert await b.find("new") == A
        worlds.discard("new")
        a.withdrawn("new")
        await asyncio.sleep(0)
        assert await b.find("new") is None
        assert a.health()["state"] == "ok"

        store.up.clear()  # the head is gone: calls hang
        assert await b.find("mine") is None  # within timeout_s: refused as on one front-end
        await asyncio.sleep(0.3)  # a lookup alone does not say lost (a busy machine): the refresh does
        assert (a.health()["state"], b.health()["state"]) == ("lost", "lost")
        assert await b.find("mine") is None  # no call while lost: answered at once

        store.up.set()
        store.table = DirectoryTable(ttl_s=60.0)  # a new head: an empty table
        await asyncio.sleep(0.3)
        assert (a.health()["state"], b.health()["state"]) == ("ok", "ok")  # their refreshes answer again
        assert await b.find("mine") == A  # refilled by a's refresh
    finally:
        await a.aclose()
        await b.aclose()
    assert ("leave", (A,)) in store.calls
    assert store.table.front_ends(0.0) == {}  # both left
