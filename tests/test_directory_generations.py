"""Two front-ends' :class:`RayDirectoryStore` after a lost head, on an in-test cluster (no Ray).

The cluster here is a key-value store and named actors whose calls answer only once the actor has
started (a set time after it was made) and never once it is killed or lost with a head: what the
stores see of Ray. The real Ray path is ``test_front_ends_head_return.py``, through real servers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from worldserve.server.directory_ray import RayDirectoryStore

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.1  # the stores' wait for an answer
START_S = 0.4  # a new actor's start: longer than the wait, as a new worker process on a busy machine


class _Actor:
    def __init__(self, start_s: float) -> None:
        self.up_at = time.monotonic() + start_s
        self.gone = False  # killed, or lost with the head: calls to it go unanswered

    def _ask(self) -> Any:
        answer: Future[Any] = Future()
        if not self.gone:
            wait = max(0.0, self.up_at - time.monotonic())
            threading.Timer(wait, self._answer, (answer,)).start()
        return _Ref(answer)

    def _answer(self, answer: Future[Any]) -> None:
        if not self.gone and answer.set_running_or_notify_cancel():  # not given up on by the caller
            answer.set_result({})

    def __getattr__(self, method: str) -> Any:
        return _Method(self)


class _Method:
    def __init__(self, actor: _Actor) -> None:
        self.actor = actor

    def remote(self, *args: Any) -> Any:
        return self.actor._ask()


class _Ref:
    def __init__(self, answer: Future[Any]) -> None:
        self.answer = answer

    def future(self) -> Future[Any]:
        return self.answer


class _Cluster:
    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.generation = 0
        self.actors: dict[int, _Actor] = {}
        self.made = 0
        self.lock = threading.Lock()

    def actor(self, generation: int) -> _Actor:
        with self.lock:  # get_if_exists: one actor a name
            if generation not in self.actors:
                self.actors[generation] = _Actor(self.start_s)
                self.made += 1
            return self.actors[generation]


class _Store(RayDirectoryStore):
    def __init__(self, cluster: _Cluster, *, grace_s: float) -> None:
        super().__init__("svc", 5.0, "in-test cluster", grace_s=grace_s)
        self.cluster = cluster

    def _actor(self, generation: int) -> Any:
        return self.cluster.actor(generation)

    def _read_generation(self) -> int:
        return self.cluster.generation

    def _write_generation(self, generation: int) -> None:
        self.cluster.generation = generation

    def _kill(self, handle: Any) -> None:
        handle.gone = True


async def _until_answered(store: _Store, deadline: float) -> int:
    """``Directory``'s refresh loop while lost: reconnect, then refresh, until the refresh is answered; how many
    tries it took."""
    tries = 0
    while time.monotonic() < deadline:
        tries += 1
        try:
            await store.reconnect(TIMEOUT)
            async with asyncio.timeout(TIMEOUT):
                await store.refresh("ws://fe/v1/world", ())
            return tries
        except Exception:
            await asyncio.sleep(0.02)
    raise TimeoutError(f"still at generation {store.generation} after {tries} tries")


async def _two_after_a_lost_head(grace_s: float) -> tuple[_Cluster, list[_Store]]:
    cluster = _Cluster(start_s=0.0)
    stores = [_Store(cluster, grace_s=grace_s) for _ in range(2)]
    for store in stores:  # both on generation 0, which answered them
        await store.follow(TIMEOUT)
        await store.front_ends()
    cluster.start_s = START_S
    cluster.actors[0].gone = True  # the head went and came back: no driver reaches the old actor
    return cluster, stores


async def test_two_front_ends_agree_on_one_new_generation_while_its_actor_starts() -> None:
    cluster, stores = await _two_after_a_lost_head(grace_s=30.0)
    deadline = time.monotonic() + 10.0
    await asyncio.gather(*(_until_answered(store, deadline) for store in stores))
    # One front-end started generation 1; the other waited for it rather than killing it for a 2nd.
    assert [store.generation for store in stores] == [1, 1]
    assert (cluster.generation, cluster.made) == (1, 2)
    assert not cluster.actors[1].gone


async def test_without_the_grace_a_starting_actor_is_killed_again_and_again() -> None:
    """What the grace prevents: each front-end replaces the other's new, still starting, actor."""
    cluster, stores = await _two_after_a_lost_head(grace_s=0.0)
    with pytest.raises(TimeoutError, match="still at generation"):
        await asyncio.gather(*(_until_answered(store, time.monotonic() + 2.0) for store in stores))
    assert cluster.generation > 3


async def test_a_new_generation_that_never_answers_is_replaced_after_the_grace() -> None:
    cluster, stores = await _two_after_a_lost_head(grace_s=0.5)
    store = stores[0]
    cluster.start_s = 3600.0  # generation 1's actor never comes up (its node is gone)
    with pytest.raises(TimeoutError, match="still at generation 1"):
        await _until_answered(store, time.monotonic() + 0.3)
    cluster.start_s = 0.0
    await _until_answered(store, time.monotonic() + 10.0)
    assert (store.generation, cluster.actors[1].gone) == (2, True)


async def test_an_actor_that_answered_and_then_stops_is_replaced_at_once() -> None:
    cluster, stores = await _two_after_a_lost_head(grace_s=3600.0)
    store = stores[0]
    cluster.start_s = 0.0
    assert await _until_answered(store, time.monotonic() + 10.0) == 1  # generation 0 had answered: no grace
    assert store.generation == 1
