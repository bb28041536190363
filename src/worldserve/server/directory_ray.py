"""The session directory kept in Ray: one named, detached actor per cluster holding the table.

Owns: :class:`DirectoryActor` (the actor's body: a :class:`~worldserve.server.directory.DirectoryTable`
on the actor's clock), :class:`RayDirectoryStore` (a front-end's handle on it: every call submitted
at once, in call order, so a world's publish reaches the actor before its withdraw), and
:func:`connect_directory` (joining the cluster when the executor has not, then finding the actor
or creating it). The actor is named ``worldserve-directory.<service>.<generation>`` in the ``worldserve``
namespace (``--service``: several services may share a cluster, each with its own worlds and line; the
generation, in the cluster's key-value store, moves on when the actor was lost with a head),
detached (it outlives the front-end that made it), takes no CPU and restarts where Ray can place it
when its node goes: it comes back empty and the front-ends' next refresh fills it.

Must not know: sockets, worlds, the front-end's policy (``directory.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from worldserve.runtime.errors import WorkerStartError
from worldserve.server.cluster_line import ClusterLine, LineAnswer
from worldserve.server.directory import DirectoryTable

__all__ = ["ACTOR_NAME", "NAMESPACE", "DirectoryActor", "RayDirectoryStore", "connect_directory"]

_log = logging.getLogger("worldserve.server")

ACTOR_NAME = "worldserve-directory"
NAMESPACE = "worldserve"
#: How long a directory-only front-end's Ray driver waits for a lost head before Ray ends the process: a year.
_RECONNECT_FOREVER_S = 365 * 24 * 3600


class DirectoryActor:
    """The actor's body: the service's table and its waiting line, timed by the actor's own clock."""

    def __init__(self, ttl_s: float) -> None:
        self._table = DirectoryTable(ttl_s)
        self._line = ClusterLine(front_end_ttl_s=ttl_s)

    def line_join(self, url: str, ticket: str) -> int:
        return self._line.join(url, ticket, time.monotonic())

    def line_leave(self, ticket: str) -> None:
        self._line.leave(ticket)

    def line_unplace(self, ticket: str) -> None:
        self._line.unplace(ticket)

    def line_placed(self, url: str, ticket: str) -> bool:
        return self._line.placed_on(url, ticket)

    def line_ended(self, length_s: float) -> None:
        self._line.ended([length_s], time.monotonic())

    def line_poll(self, url: str, free: int, slots: int | None, tickets: tuple[str, ...]) -> LineAnswer:
        return self._line.poll(url, free, slots, tickets, time.monotonic())

    def publish(self, url: str, world: str) -> None:
        self._table.publish(url, world, time.monotonic())

    def withdraw(self, url: str, world: str) -> None:
        self._table.withdraw(url, world, time.monotonic())

    def refresh(self, url: str, worlds: tuple[str, ...]) -> None:
        self._table.refresh(url, worlds, time.monotonic())

    def leave(self, url: str) -> None:
        self._table.leave(url)

    def find(self, world: str) -> str | None:
        return self._table.find(world, time.monotonic())

    def front_ends(self) -> dict[str, int]:
        return self._table.front_ends(time.monotonic())


class RayDirectoryStore:
    """A front-end's handle on the cluster's :class:`DirectoryActor` (a ``DirectoryStore``).

    The actor has a *generation*, kept in the cluster's key-value store (the GCS's: with Ray's GCS
    fault tolerance it survives a head's restart, and so does a driver's link to it), and is named
    after it. After a lost head a driver cannot reach an actor it knew (it pushes to the actor's old
    address, waiting for news of it from a GCS that restarted without its subscription), so a
    front-end that finds its actor gone starts the next generation, killing the old one, and every
    front-end follows the newest generation at its next refresh: all of them on one actor again,
    empty, refilled by their refreshes.

    A generation whose actor has never answered this front-end is not replaced until ``grace_s`` after
    this front-end took it up: the actor may still be starting (a new worker process, slow on a busy
    machine), and replacing it would kill the actor another front-end just made, which would then replace
    this one's in turn, without end. One that has answered and stops is replaced at once."""

    def __init__(
        self,
        service: str,
        ttl_s: float,
        where: str,
        *,
        grace_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._ttl_s = ttl_s
        self._where = where
        self.grace_s = grace_s
        self._clock = clock
        self._handle: Any = None
        self.generation = -1
        self._taken_up = -math.inf  # when this front-end took up ``generation``: never, yet
        self._answered = -1  # the newest generation whose actor has answered this front-end

    @property
    def _key(self) -> bytes:
        return f"{ACTOR_NAME}.{self._service}.generation".encode()

    def _actor(self, generation: int) -> Any:
        """The actor of ``generation``, found or created (blocking: run off the loop)."""
        ray = _ray()
        return (
            ray.remote(DirectoryActor)
            .options(
                name=f"{ACTOR_NAME}.{self._service}.{generation}",
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_restarts=-1,  # back, empty, wherever Ray can place it; the front-ends refill it
                max_task_retries=0,
            )
            .remote(self._ttl_s)
        )

    def _read_generation(self) -> int:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(self._key, namespace=NAMESPACE.encode())
        return int(value) if value else 0

    def _kill(self, handle: Any) -> None:
        _ray().kill(handle, no_restart=True)  # through the GCS, wherever the actor is

    def _write_generation(self, generation: int) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self._key, str(generation).encode(), overwrite=True, namespace=NAMESPACE.encode())

    async def follow(self, timeout: float) -> None:
        """Use the newest generation's actor (another front-end may have started one)."""
        from worldserve.runtime.executor.ray_actor import _off_loop

        generation = await _off_loop(self._read_generation, timeout)
        if generation != self.generation or self._handle is None:
            self._handle = await _off_loop(lambda: self._actor(generation), timeout)
            if generation != self.generation:
                self._taken_up = self._clock()
            self.generation = generation

    async def reconnect(self, timeout: float) -> None:
        """The actor did not answer: follow the newest generation, and if its actor does not answer either
        (this driver lost it with a head), start the next generation; raises while the cluster does not answer,
        and while a generation taken up less than ``grace_s`` ago does not answer yet."""
        from worldserve.runtime.executor.ray_actor import _off_loop

        await self.follow(timeout)
        try:
            async with asyncio.timeout(timeout):
                await self.front_ends()
            return
        except Exception as error:  # unreachable from here: a new generation, unless this one may be starting
            if self._answered != self.generation and self._clock() - self._taken_up < self.grace_s:
                raise TimeoutError(f"generation {self.generation} of the session directory is not up yet") from error
        old, generation = self._handle, self.generation + 1
        await _off_loop(lambda: self._write_generation(generation), timeout)
        with contextlib.suppress(Exception):
            await _off_loop(lambda: self._kill(old), timeout)
        self._handle = await _off_loop(lambda: self._actor(generation), timeout)
        self.generation, self._taken_up = generation, self._clock()
        _log.warning("the session directory starts again as generation %d (%s)", generation, self._where)

    @property
    def where(self) -> str:
        return self._where

    def _call(self, method: str, *args: Any) -> Awaitable[Any]:
        ref = getattr(self._handle, method).remote(*args)  # submitted now: the actor runs them in this order
        answer = asyncio.wrap_future(ref.future())
        generation = self.generation

        def answered(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._answered = max(self._answered, generation)

        answer.add_done_callback(answered)
        return answer

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

    def line_join(self, url: str, ticket: str) -> Awaitable[int]:
        return self._call("line_join", url, ticket)

    def line_leave(self, ticket: str) -> Awaitable[Any]:
        return self._call("line_leave", ticket)

    def line_unplace(self, ticket: str) -> Awaitable[Any]:
        return self._call("line_unplace", ticket)

    def line_placed(self, url: str, ticket: str) -> Awaitable[bool]:
        return self._call("line_placed", url, ticket)

    def line_ended(self, length_s: float) -> Awaitable[Any]:
        return self._call("line_ended", length_s)

    def line_poll(self, url: str, free: int, slots: int | None, tickets: tuple[str, ...]) -> Awaitable[LineAnswer]:
        return self._call("line_poll", url, free, slots, tickets)


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as error:  # pragma: no cover - depends on the extra
        raise WorkerStartError("--directory ray needs Ray: pip install 'worldserve[ray]'.") from error
    return ray


async def connect_directory(
    address: str | None, *, service: str = "default", connect_timeout: float = 20.0, ttl_s: float = 5.0
) -> RayDirectoryStore:
    """The directory of ``service`` (its worlds and its line: several services may share one cluster) on the
    Ray cluster this process is connected to (the Ray executor's), else the one ``address`` names, else
    ``RAY_ADDRESS``, else this machine's last ``ray start``; created by the first front-end that asks. A
    front-end with no cluster to share has no use for one: refused."""
    from worldserve.runtime.executor.ray_actor import _off_loop, _reclaim_signals

    ray = _ray()
    if not ray.is_initialized():
        # This process joins the cluster for the directory alone (its workers are its own): without a head it
        # goes on serving its worlds, so Ray must not end it when the head is gone for a minute (its default
        # gcs_rpc_server_reconnect_timeout_s); a head that comes back with its state (GCS fault tolerance)
        # is joined again, and the directory refills within a refresh.
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(_RECONNECT_FOREVER_S))
        target = address or os.environ.get("RAY_ADDRESS") or None
        if target is None:
            from ray._private.services import find_bootstrap_address

            if find_bootstrap_address(None) is None:
                raise WorkerStartError(
                    "--directory ray needs the Ray cluster the front-ends share: give --ray-address "
                    "(or RAY_ADDRESS), or join it with `ray start --address HEAD:6379` first."
                )
            target = "auto"
        try:
            await _off_loop(lambda: ray.init(address=target, log_to_driver=False), connect_timeout)
        except TimeoutError:
            raise WorkerStartError(
                f"no Ray cluster answered at {target} within {connect_timeout:g} s for the session directory."
            ) from None
        finally:
            _reclaim_signals()
    gcs = "?"
    with contextlib.suppress(Exception):  # a Ray Client connection has none to show
        gcs = str(ray.get_runtime_context().gcs_address)
    store = RayDirectoryStore(service, ttl_s, f"Ray actor {NAMESPACE}/{ACTOR_NAME}.{service} on the cluster at {gcs}")
    # Its actor may be a new Ray worker process, slow to start on a busy machine: it gets the grace a generation
    # never answered gets (a front-end that gave up sooner failed to start, at 4x oversubscription here).
    first_answer_s = max(connect_timeout, store.grace_s)
    try:
        await store.follow(connect_timeout)
        async with asyncio.timeout(first_answer_s):
            await store.front_ends()
    except TimeoutError:
        raise WorkerStartError(f"the session directory's actor did not answer within {first_answer_s:g} s.") from None
    except Exception:  # an actor this cluster lost: the next generation
        await store.reconnect(connect_timeout)
    return store
