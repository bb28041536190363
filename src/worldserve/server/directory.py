"""The session directory: which front-end of a service each world lives on.

Several front-ends behind one balancer serve one service (docs/deploy.md). A world lives on the
front-end that started it (its session, its pacing, its members), so a ``session.resume`` or a
share link's ``session.join`` that the balancer hands to another front-end must learn where it
is. Each front-end publishes its worlds under its public URL; any front-end finds a world's
owner there and answers ``session.moved {url}`` (the client goes there itself: the media never
takes a second hop through a front-end that does not own the world).

The same store keeps the service's one waiting line (``cluster_line.py``); :class:`Directory` is
also the front-end's waiting room's way to it (a :class:`~worldserve.server.waiting.SharedLine`).

Owns: :class:`DirectoryTable` (the entries, pure: a front-end's worlds replaced whole by its
refresh, withdrawn one by one, forgotten when the front-end stops refreshing for ``ttl_s``),
:class:`DirectoryStore` (where the table lives, shared by the front-ends: the Ray actor of
``directory_ray.py``), and :class:`Directory` (one front-end's side: it publishes each world as
it starts and withdraws it as it ends, re-publishes all of them every ``refresh_s`` so a table
that was lost (its actor restarted, the head back) fills again, finds a world's owner, and says
whether the store answers, for ``/healthz``).

Must not know: Ray (``directory_ray.py``), sockets, what a world does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from worldserve.server.cluster_line import LineAnswer

__all__ = ["Directory", "DirectoryStore", "DirectoryTable", "world_url"]

_log = logging.getLogger("worldserve.server")


def world_url(public_url: str) -> str:
    """The ``/v1/world`` WebSocket URL of a front-end whose public (HTTP) URL is ``public_url``
    (``http://lb.example/fe/1`` -> ``ws://lb.example/fe/1/v1/world``; https -> wss)."""
    parts = urlsplit(public_url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(
            "public URL must be an http(s) URL with a host and no query (e.g. http://10.0.0.2:8000); "
            f"got {public_url!r}."
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/world"):
        path += "/v1/world"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


@dataclass(slots=True)
class _FrontEnd:
    url: str
    seen: float
    worlds: set[str] = field(default_factory=set)


class DirectoryTable:
    """Where each world lives, by front-end: pure (the caller gives the time), held by the store.

    A front-end is known by its ``/v1/world`` URL. ``refresh`` replaces its worlds whole and says it
    is alive; a front-end silent for ``ttl_s`` is forgotten with its worlds (it died without leaving:
    its worlds died with it). A world claimed by two front-ends (it moved) belongs to the latest claim.
    """

    def __init__(self, ttl_s: float = 5.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive; got {ttl_s!r}.")
        self._ttl_s = ttl_s
        self._front_ends: dict[str, _FrontEnd] = {}
        self._owner: dict[str, str] = {}  # session id -> front-end url

    def refresh(self, url: str, worlds: Collection[str], now: float) -> None:
        """``url``'s worlds are exactly ``worlds`` now."""
        front_end = self._front_ends.get(url)
        if front_end is None:
            front_end = self._front_ends[url] = _FrontEnd(url, now)
        front_end.seen = now
        for gone in front_end.worlds - set(worlds):
            self._drop(url, gone)
        for world in worlds:
            self._claim(front_end, world)

    def publish(self, url: str, world: str, now: float) -> None:
        """``world`` now lives on ``url``."""
        front_end = self._front_ends.get(url)
        if front_end is None:
            front_end = self._front_ends[url] = _FrontEnd(url, now)
        front_end.seen = now
        self._claim(front_end, world)

    def withdraw(self, url: str, world: str, now: float) -> None:
        """``world`` ended on ``url`` (a claim by another front-end stays)."""
        front_end = self._front_ends.get(url)
        if front_end is not None:
            front_end.seen = now
            self._drop(url, world)

    def leave(self, url: str) -> None:
        """``url`` stops: it and its worlds are forgotten."""
        front_end = self._front_ends.pop(url, None)
        if front_end is not None:
            for world in front_end.worlds:
                if self._owner.get(world) == url:
                    del self._owner[world]

    def find(self, world: str, now: float) -> str | None:
        """The ``/v1/world`` URL of the front-end ``world`` lives on; None if unknown or its front-end went silent."""
        self.expire(now)
        return self._owner.get(world)

    def expire(self, now: float) -> None:
        for url, front_end in list(self._front_ends.items()):
            if now - front_end.seen > self._ttl_s:
                self.leave(url)

    def front_ends(self, now: float) -> dict[str, int]:
        """Each live front-end's URL and how many worlds it holds."""
        self.expire(now)
        return {url: len(front_end.worlds) for url, front_end in self._front_ends.items()}

    def _claim(self, front_end: _FrontEnd, world: str) -> None:
        previous = self._owner.get(world)
        if previous is not None and previous != front_end.url and previous in self._front_ends:
            self._front_ends[previous].worlds.discard(world)
        self._owner[world] = front_end.url
        front_end.worlds.add(world)

    def _drop(self, url: str, world: str) -> None:
        front_end = self._front_ends.get(url)
        if front_end is not None:
            front_end.worlds.discard(world)
        if self._owner.get(world) == url:
            del self._owner[world]


class DirectoryStore(Protocol):
    """Where the service's :class:`DirectoryTable` lives, shared by its front-ends.

    ``publish``, ``withdraw``, ``refresh`` and ``leave`` are submitted in the order they are called
    (a world's publish before its withdraw) and their awaitables say whether the store took them;
    ``find`` answers from the table as the store holds it."""

    def publish(self, url: str, world: str) -> Awaitable[Any]: ...

    def withdraw(self, url: str, world: str) -> Awaitable[Any]: ...

    def refresh(self, url: str, worlds: tuple[str, ...]) -> Awaitable[Any]: ...

    def leave(self, url: str) -> Awaitable[Any]: ...

    def find(self, world: str) -> Awaitable[str | None]: ...

    def front_ends(self) -> Awaitable[dict[str, int]]: ...

    async def reconnect(self, timeout: float) -> None:
        """Find the store again (it may have moved while it did not answer); raises if it cannot."""

    async def follow(self, timeout: float) -> None:
        """Use the store all front-ends use now (another one may have found it anew); raises if it cannot."""

    # The service's waiting line (cluster_line.py), kept beside the table.

    def line_join(self, url: str, ticket: str) -> Awaitable[int]: ...

    def line_leave(self, ticket: str) -> Awaitable[Any]: ...

    def line_unplace(self, ticket: str) -> Awaitable[Any]: ...

    def line_placed(self, url: str, ticket: str) -> Awaitable[bool]: ...

    def line_ended(self, length_s: float) -> Awaitable[Any]: ...

    def line_poll(self, url: str, free: int, slots: int | None, tickets: tuple[str, ...]) -> Awaitable[LineAnswer]: ...

    @property
    def where(self) -> str:
        """The store, in words (for logs and ``/healthz``)."""
        ...


class Directory:
    """One front-end's side of the directory: its worlds published under its URL, others' found.

    ``worlds`` says which worlds this front-end holds now (its ``WorldHosts``); every
    ``refresh_s`` they are published whole, so the store recovers from a restart within one
    refresh. The refresh is the heartbeat: one that the store does not take within ``timeout_s``
    makes it *lost* (one slow lookup does not: a busy machine must not flap), and then ``find``
    answers None at once (the front-end goes on alone: a resume or join for a world elsewhere is
    refused as on one front-end) until a refresh is taken again. ``state`` is ``"ok"`` or ``"lost"``.
    """

    def __init__(
        self,
        store: DirectoryStore,
        public_url: str,
        *,
        refresh_s: float = 1.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not refresh_s > 0 or not timeout_s > 0:
            raise ValueError("refresh_s and timeout_s must be positive.")
        self.url = world_url(public_url)
        self._store = store
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._worlds: Callable[[], Collection[str]] = tuple
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.state = "ok"
        self.since = clock()
        self._closed = False

    @property
    def where(self) -> str:
        return self._store.where

    def start(self, worlds: Callable[[], Collection[str]]) -> None:
        """Publish ``worlds()`` every ``refresh_s`` from now on (the first at once)."""
        self._worlds = worlds
        if self._task is None:
            self._task = asyncio.ensure_future(self._refresh_forever())

    def published(self, world: str) -> None:
        """A world started here (the next refresh would say so too; this says it at once)."""
        self._submit(self._store.publish(self.url, world), f"publish {world}")

    def withdrawn(self, world: str) -> None:
        """A world here ended."""
        self._submit(self._store.withdraw(self.url, world), f"withdraw {world}")

    async def find(self, world: str) -> str | None:
        """The ``/v1/world`` URL of the front-end ``world`` lives on, if another one; None when it
        is unknown, lives here, or the store is lost (it does not answer within ``timeout_s``)."""
        if self.state != "ok":
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                url = await self._store.find(world)
        except Exception as error:
            _log.debug("directory: find %s failed: %r", world, error)
            return None
        return None if url == self.url else url

    async def front_ends(self) -> dict[str, int]:
        """The live front-ends and their worlds (empty when the store is lost)."""
        if self.state != "ok":
            return {}
        try:
            async with asyncio.timeout(self._timeout_s):
                return dict(await self._store.front_ends())
        except Exception as error:
            _log.debug("directory: front_ends failed: %r", error)
            return {}

    def health(self) -> dict[str, Any]:
        return {"state": self.state, "since_s": round(self._clock() - self.since, 1), "url": self.url}

    # -- the service's waiting line (waiting.SharedLine) ---------------------------------------

    @property
    def shared(self) -> bool:
        """Whether the service's line answers: while not, the front-end's room is a line of its own."""
        return self.state == "ok" and not self._closed

    async def join(self, ticket: str) -> int | None:
        """Put a waiting start at the back of the service's line: its position there (None while lost)."""
        if not self.shared:
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                return int(await self._store.line_join(self.url, ticket))
        except Exception as error:
            _log.warning("directory: joining the service's line failed (%r): placed when the line is next heard", error)
            return None

    def leave(self, ticket: str) -> None:
        self._submit(self._store.line_leave(ticket), f"leave the line with {ticket}")

    def unplace(self, ticket: str) -> None:
        self._submit(self._store.line_unplace(ticket), f"unplace {ticket}")

    async def placed_here(self, ticket: str) -> bool:
        """Whether the service's line placed ``ticket`` on this front-end (False while lost)."""
        if not self.shared:
            return False
        try:
            async with asyncio.timeout(self._timeout_s):
                return bool(await self._store.line_placed(self.url, ticket))
        except Exception as error:
            _log.debug("directory: asking for a reservation failed: %r", error)
            return False

    def ended(self, length_s: float) -> None:
        self._submit(self._store.line_ended(length_s), "a world ended")

    async def poll(self, free: int, slots: int | None, tickets: tuple[str, ...]) -> LineAnswer | None:
        """The service's line's word for this front-end (None while the store is lost)."""
        if not self.shared:
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._store.line_poll(self.url, free, slots, tickets)
        except Exception as error:
            _log.debug("directory: polling the line failed: %r", error)
            return None

    async def aclose(self) -> None:
        """Stop refreshing and leave the table (this front-end's worlds are gone with it)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for task in list(self._pending):
            task.cancel()
        if self.state == "ok":
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout_s):
                    await self._store.leave(self.url)

    async def _refresh_forever(self) -> None:
        while not self._closed:
            try:
                if self.state != "ok":  # a store that came back may be somewhere else now
                    await self._store.reconnect(self._timeout_s)
                else:
                    await self._store.follow(self._timeout_s)  # another front-end may have started it again
                async with asyncio.timeout(self._timeout_s):
                    await self._store.refresh(self.url, tuple(self._worlds()))
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self._lose(error)
            else:
                if self.state != "ok":
                    _log.warning("the session directory (%s) answers again", self.where)
                    self.state, self.since = "ok", self._clock()
            await asyncio.sleep(self._refresh_s)

    def _lose(self, error: BaseException) -> None:
        if self.state == "lost" or self._closed:
            return
        why = "no answer" if isinstance(error, TimeoutError) else f"{type(error).__name__}: {error}"
        _log.warning(
            "the session directory (%s) is lost (%s): this front-end goes on alone; a resume or join "
            "for a world on another front-end is refused until it answers again",
            self.where,
            why,
        )
        self.state, self.since = "lost", self._clock()

    def _submit(self, call: Awaitable[Any], what: str) -> None:
        async def settle() -> None:
            try:
                async with asyncio.timeout(self._timeout_s):
                    await call
            except asyncio.CancelledError:
                raise
            except Exception as error:
                _log.debug("directory: %s failed: %r", what, error)

        task = asyncio.ensure_future(settle())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
