"""The session directory kept in Ray: one named, detached actor per cluster holding the table.

Owns: :class:`DirectoryActor` (the actor's body: a :class:`~worldserve.server.directory.DirectoryTable`
on the actor's clock), :class:`RayDirectoryStore` (a front-end's handle on it: every call submitted
at once, in call order, so a world's publish reaches the actor before its withdraw), and
:func:`connect_directory` (joining the cluster when the executor has not, then finding the actor
or creating it). The actor is named ``worldserve-directory.<service>`` in the ``worldserve`` namespace
(``--service``: several services may share a cluster, each with its own worlds and line),
detached (it outlives the front-end that made it), takes no CPU and restarts where Ray can place it
when its node goes: it comes back empty and the front-ends' next refresh fills it.

Must not know: sockets, worlds, the front-end's policy (``directory.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable
from types import ModuleType
from typing import Any

from worldserve.runtime.errors import WorkerStartError
from worldserve.server.cluster_line import ClusterLine, LineAnswer
from worldserve.server.directory import DirectoryTable

__all__ = ["ACTOR_NAME", "NAMESPACE", "DirectoryActor", "RayDirectoryStore", "connect_directory"]

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
    """A front-end's handle on the cluster's :class:`DirectoryActor` (a ``DirectoryStore``)."""

    def __init__(self, handle: Any, where: str) -> None:
        self._handle = handle
        self._where = where

    @property
    def where(self) -> str:
        return self._where

    def _call(self, method: str, *args: Any) -> Awaitable[Any]:
        ref = getattr(self._handle, method).remote(*args)  # submitted now: the actor runs them in this order
        return asyncio.wrap_future(ref.future())

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
    name = f"{ACTOR_NAME}.{service}"
    remote = ray.remote(DirectoryActor).options(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,  # back, empty, wherever Ray can place it; the front-ends refill it
        max_task_retries=0,
    )
    try:
        handle = await _off_loop(lambda: remote.remote(ttl_s), connect_timeout)
    except TimeoutError:
        raise WorkerStartError(f"the session directory's actor did not answer within {connect_timeout:g} s.") from None
    gcs = "?"
    with contextlib.suppress(Exception):  # a Ray Client connection has none to show
        gcs = str(ray.get_runtime_context().gcs_address)
    return RayDirectoryStore(handle, f"Ray actor {NAMESPACE}/{name} on the cluster at {gcs}")
