"""The waiting room: newcomers who asked to queue wait in line while the server is full.

Owns: one line of waiting starts for this front-end (first come, first served across all
of its workers), admitting its head whenever room may have appeared (a world ended, or
the runtime says a worker would take a session now: a slot freed by a failure, an
in-use mark that lapsed, a worker back from a restart -- looked at every ``poll_s``),
each waiter's position notices (at once, then whenever its position or its estimate
changed, at most once per ``notice_interval_s``), the bound (``max_waiting``: beyond it a start is
refused) and the wait cap (``timeout_s``: then refused), the lengths of the worlds that
ended here and when the last one ended (the wait estimate's only inputs), and the queue's
metrics.

A start that does not ask to queue never overtakes the line: while anyone waits, it is
refused at once.

One of several front-ends of a service (a :class:`SharedLine`: the session directory), the line
is the service's (``cluster_line.py``): each waiter also holds a ticket there; every ``poll_s`` the
room tells the service its free slots and hears which of its waiters to start here (the head of
the whole line, wherever it waits, starts on the front-end with room first), which were placed on
another front-end (the waiter's start raises :class:`StartMoved`: its client is sent there with a
reservation, which that front-end admits at once) and each waiter's place in the whole line.
While the service does not answer, the room is its front-end's own line again.

Must not know: sockets, message parsing, how admission decides (the runtime's), Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from worldserve.errors import AdmissionRefusedError
from worldserve.runtime.chunk import Chunk
from worldserve.runtime.metrics import Capacity
from worldserve.server.cluster_line import LineAnswer
from worldserve.server.config import ServerConfig
from worldserve.server.host import WorldBackend, WorldHosts
from worldserve.server.metrics import ServerMetrics
from worldserve.session import Session

__all__ = ["Position", "SharedLine", "StartMoved", "WaitingRoom", "waiting_room"]

T = TypeVar("T")

_log = logging.getLogger("worldserve.server")

#: How many ended worlds' lengths the wait estimate averages.
_LENGTHS_KEPT = 100
#: A waiter is told a fresh estimate when it moved this much (seconds) from the one it was told.
_ETA_STEP_S = 1.0


@dataclass(frozen=True, slots=True)
class Position:
    """Where a waiter stands: ``position`` 1 is next; ``eta_s`` (0.1 s steps) None until a world has ended here."""

    position: int
    ahead: int
    eta_s: float | None


class StartMoved(Exception):
    """A waiting start was placed on another front-end of the service: its client starts there, at ``url``,
    with ``reservation`` (that front-end admits it at once)."""

    def __init__(self, url: str, reservation: str) -> None:
        super().__init__(f"start at {url} with reservation {reservation}")
        self.url = url
        self.reservation = reservation


class SharedLine(Protocol):
    """The service's line as one front-end's room reaches it (:class:`~worldserve.server.directory.Directory`).

    ``leave``, ``unplace`` and ``ended`` are sent in call order and not awaited; ``join`` answers the
    start's position in the service's line, ``poll`` the service's word, each None while the service
    does not answer (the room is then its front-end's own line)."""

    @property
    def shared(self) -> bool: ...

    async def join(self, ticket: str) -> int | None: ...

    def leave(self, ticket: str) -> None: ...

    def unplace(self, ticket: str) -> None: ...

    async def placed_here(self, ticket: str) -> bool: ...

    def ended(self, length_s: float) -> None: ...

    async def poll(self, free: int, slots: int | None, tickets: tuple[str, ...]) -> LineAnswer | None: ...


class _Waiter(Generic[T]):
    __slots__ = ("create", "enqueued", "future", "last_notice", "notify", "place", "ticket", "told", "told_eta")

    def __init__(
        self,
        create: Callable[[], Awaitable[T]],
        notify: Callable[[Position], None],
        now: float,
        future: asyncio.Future[T],
    ) -> None:
        self.create = create
        self.notify = notify
        self.enqueued = now
        self.future = future
        self.told: int | None = None  # the position last sent
        self.told_eta: float | None = None  # and the estimate
        self.last_notice = float("-inf")
        self.ticket = secrets.token_urlsafe(12)  # its place in the service's line (a shared room)
        self.place: Position | None = None  # where the service's line has it, when it answers


class WaitingRoom(Generic[T]):
    """A first-come-first-served line of starts waiting for room (``T``: what a start makes)."""

    def __init__(
        self,
        *,
        capacity: Callable[[], Capacity],
        release: Callable[[T], Awaitable[None]],
        max_waiting: int | None,
        timeout_s: float,
        poll_s: float = 0.25,
        notice_interval_s: float = 1.0,
        on_wait: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedLine | None = None,
    ) -> None:
        if (max_waiting is not None and max_waiting < 0) or not timeout_s > 0 or not poll_s > 0:
            raise ValueError("max_waiting must be >= 0 or None, timeout_s and poll_s positive.")
        self._capacity = capacity
        self._release = release
        self._max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._poll_s = poll_s
        self._notice_interval_s = notice_interval_s
        self._on_wait = on_wait
        self._clock = clock
        self._line: deque[_Waiter[T]] = deque()
        self._lengths: deque[float] = deque(maxlen=_LENGTHS_KEPT)
        self._last_end: float | None = None  # when the last world ended here (the clock's time)
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._releasing: set[asyncio.Future[None]] = set()
        self._refusing: str | None = None  # why no start is admitted any more (a drain), once stopped
        self._retry_refused_s = 1.0
        self._shared = shared
        self._expected: set[str] = set()  # reservations of starts the service placed here
        self._service_waiting = 0  # the service's line, as last heard
        self._sharing: asyncio.Task[None] | None = None

    # -- what the server asks ----------------------------------------------------------

    @property
    def max_waiting(self) -> int:
        """The longest the line may grow: as configured, else four times the session slots
        (at least 8; 64 when the runtime has no slot count)."""
        if self._max_waiting is not None:
            return self._max_waiting
        slots = self._capacity().slots
        return 64 if slots is None else max(8, 4 * slots)

    @property
    def waiting(self) -> int:
        """How many starts wait in line now."""
        return len(self._line)

    @property
    def admitting(self) -> bool:
        """False once :meth:`stop_admitting` was called."""
        return self._refusing is None

    def stop_admitting(self, why: str, retry_after_s: float = 1.0) -> None:
        """From now on every start is refused with ``why`` (``admission_refused``, a retry hint: through a
        balancer the retry lands on another front-end), those waiting in line first."""
        self._refusing = why
        self._retry_refused_s = retry_after_s
        while self._line:  # a start being admitted meanwhile finds its future done and is released
            waiter = self._line.popleft()
            if self._shared is not None:
                self._shared.leave(waiter.ticket)
            if not waiter.future.done():
                waiter.future.set_exception(AdmissionRefusedError(why, retry_after_s=retry_after_s))
        self._wake.set()

    @property
    def shared(self) -> bool:
        """Whether the line is the service's now: a shared room whose service answers."""
        return self._shared is not None and self._shared.shared

    def start_sharing(self) -> None:
        """A shared room: take part in the service's line from now on (its poll runs every ``poll_s``,
        also while nobody waits here: this front-end's room may be what the head of the line needs)."""
        if self._shared is not None and self._sharing is None:
            self._sharing = asyncio.ensure_future(self._share_forever())

    def refuse_if_waiting(self) -> None:
        """A start that did not ask to queue: refused at once while others wait (they came first: here,
        or anywhere in a shared line), or when the front-end admits no more (:meth:`stop_admitting`)."""
        if self._refusing is not None:
            raise AdmissionRefusedError(self._refusing, retry_after_s=self._retry_refused_s)
        waiting = max(len(self._line), self._service_waiting if self.shared else 0)
        if waiting:
            raise AdmissionRefusedError(
                f"the server is full and {waiting} waiting in line came first; "
                'send session.start with "queue": true to wait in line.',
                retry_after_s=self._poll_s * 4,
            )

    async def admit(
        self, create: Callable[[], Awaitable[T]], notify: Callable[[Position], None], reservation: str | None = None
    ) -> T:
        """``create()`` now if nobody waits and it is admitted, else wait in line for it.

        ``notify`` gets this start's position at once when it joins the line and again
        whenever it or its estimate changes. Raises :class:`AdmissionRefusedError` when the line is full or
        the wait ran past ``timeout_s``, :class:`StartMoved` when the service's line placed it on another
        front-end; other errors of ``create`` as they are. Cancelled (the client left), it leaves the
        line; a start admitted meanwhile is released. ``reservation``: the service's line placed this
        start here (its client was told ``session.moved``): created at once, ahead of this front-end's
        own line (an unknown or lapsed one is a start like any other).
        """
        if self._refusing is not None:
            raise AdmissionRefusedError(self._refusing, retry_after_s=self._retry_refused_s)
        held = reservation is not None and reservation in self._expected
        if reservation is not None and not held and self._shared is not None:
            held = await self._shared.placed_here(reservation)  # it may come before this room's next poll
        if reservation is not None and held:
            self._expected.discard(reservation)
            try:
                reserved = await create()
            finally:
                if self._shared is not None:
                    self._shared.leave(reservation)  # started here, or refused: either way out of the line
            self._count("admitted", 0.0)
            return reserved
        if not self._line and not (self.shared and self._service_waiting > 0):
            with contextlib.suppress(AdmissionRefusedError):
                return await create()
        limit = self.max_waiting
        if len(self._line) >= limit:
            self._count("full", 0.0)
            raise AdmissionRefusedError(
                f"the server is full and its waiting line is too ({limit} waiting); try again later.",
                retry_after_s=self._retry_hint(),
            )
        waiter = _Waiter(create, notify, self._clock(), asyncio.get_running_loop().create_future())
        self._line.append(waiter)
        try:
            async with asyncio.timeout(self.timeout_s):
                if self._shared is not None:
                    position = await self._shared.join(waiter.ticket)  # at the back of the service's line
                    if position is not None:
                        self._service_waiting = max(self._service_waiting, position)
                        waiter.place = Position(position, position - 1, None)  # the estimate: with the next poll
                if not waiter.future.done():
                    self._tell(waiter, force=True)
                self._start_pump()
                result: T = await asyncio.shield(waiter.future)
        except TimeoutError:
            self._leave(waiter)
            self._count("timeout", self._clock() - waiter.enqueued)
            raise AdmissionRefusedError(
                f"waited {self.timeout_s:g} s in line and the server is still full; try again later.",
                retry_after_s=self._retry_hint(),
            ) from None
        except asyncio.CancelledError:
            self._leave(waiter)
            self._count("left", self._clock() - waiter.enqueued)
            raise
        except StartMoved:
            self._count("moved", self._clock() - waiter.enqueued)
            raise
        self._count("admitted", self._clock() - waiter.enqueued)
        return result

    def nudge(self) -> None:
        """Room may have appeared (a world ended): look at once."""
        self._wake.set()

    def world_ended(self, length_s: float) -> None:
        """A world that ran ``length_s`` seconds ended here: its length feeds the estimate."""
        if length_s >= 0:
            self._lengths.append(length_s)
            self._last_end = self._clock()
            if self._shared is not None:
                self._shared.ended(length_s)
        self.nudge()

    def eta_s(self, position: int, waiting_since: float | None = None) -> float | None:
        """About how long the start at ``position`` waits, in 0.1 s steps: ``position`` worlds must
        end first, and with every slot held one ends every ``mean length / slots`` seconds (the mean
        of the last worlds that ended here). A start already waiting since ``waiting_since`` (the
        clock's time) has waited part of the first of those: the time since it joined, or since the
        last world ended when that came later, counts off it (down to 0: that world is overdue, it
        ends any moment). None before any world ended, or without a slot count."""
        slots = self._capacity().slots
        if not self._lengths or not slots:
            return None
        every = sum(self._lengths) / len(self._lengths) / slots
        first = every
        if waiting_since is not None:
            since = waiting_since if self._last_end is None else max(waiting_since, self._last_end)
            first = max(0.0, every - (self._clock() - since))
        return round(first + (position - 1) * every, 1)

    async def aclose(self) -> None:
        """The server stops: nobody waits any more (each waiter gets a refusal)."""
        for task in (self._pump, self._sharing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        while self._line:
            waiter = self._line.popleft()
            if self._shared is not None:
                self._shared.leave(waiter.ticket)
            if not waiter.future.done():
                waiter.future.set_exception(AdmissionRefusedError("the server is shutting down."))

    # -- the line ----------------------------------------------------------------------

    def _leave(self, waiter: _Waiter[T]) -> None:
        if self._shared is not None:
            self._shared.leave(waiter.ticket)
        if waiter in self._line:
            self._line.remove(waiter)
            self._tell_all()
        if not waiter.future.done():
            waiter.future.cancel()  # an admission in progress for it sees this and releases its start
        elif not waiter.future.cancelled() and waiter.future.exception() is None:
            started = waiter.future.result()  # admitted while it was leaving: nobody takes it
            task = asyncio.ensure_future(self._release(started))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    def _start_pump(self) -> None:
        if self._shared is not None:
            self.nudge()  # the sharing loop admits, here or through the service, and tells positions
            return
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name="waiting-room")

    async def _run(self) -> None:
        """Admit the head of the line whenever the runtime has room; tell positions as they change."""
        while self._line:
            if await self._local_round():
                continue
            await self._pause()

    async def _local_round(self) -> bool:
        """Admit the head of this front-end's line if the runtime has room: True if it got in (look again
        at once), else positions told and False."""
        waiter = self._line[0]
        if self._capacity().room:
            try:
                result = await waiter.create()
            except AdmissionRefusedError:
                pass  # the look said room, the workers said no: look again later
            except Exception as error:  # this start's own error (e.g. options the model cannot take)
                self._pop(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(error)
                return True
            else:
                self._pop(waiter)
                if waiter.future.done():  # it left (or timed out) while being admitted
                    await self._release(result)
                else:
                    waiter.future.set_result(result)
                return True
        self._tell_all()
        return False

    async def _pause(self, seconds: float | None = None) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._poll_s if seconds is None else seconds):
                await self._wake.wait()

    # -- the service's line (a shared room) ------------------------------------------------

    def _free(self) -> int:
        """Session slots this front-end would fill now (1 for room when it counts none)."""
        if self._refusing is not None:
            return 0
        capacity = self._capacity()
        if not capacity.room:
            return 0
        return capacity.free if capacity.slots is not None and capacity.free is not None else 1

    async def _share_forever(self) -> None:
        assert self._shared is not None
        while True:
            answer = None
            try:  # never let the loop die: the next round asks again
                if self._shared.shared:
                    slots = self._capacity().slots
                    tickets = tuple(waiter.ticket for waiter in self._line)
                    answer = await self._shared.poll(self._free(), slots, tickets)
                if answer is not None:
                    await self._apply(answer)
                elif self._line and await self._local_round():  # the service is lost: this front-end's own line
                    continue
            except Exception:
                _log.exception("a round of the service's waiting line failed")
            # While a start waits here, the service may place it elsewhere at any moment: ask more often.
            await self._pause(self._poll_s / 5 if self._line and answer is not None else self._poll_s)

    async def _apply(self, answer: LineAnswer) -> None:
        """The service's word: start these here, send those elsewhere, tell everyone their place."""
        assert self._shared is not None
        self._expected = set(answer.expect)
        self._service_waiting = answer.waiting
        for waiter in list(self._line):
            url = answer.moved.get(waiter.ticket)
            if url is not None:
                self._pop(waiter, leave=False)  # in the service's line until its client starts there
                if not waiter.future.done():
                    waiter.future.set_exception(StartMoved(url, waiter.ticket))
        for waiter in [waiter for waiter in self._line if waiter.ticket in answer.admit]:
            try:
                result = await waiter.create()
            except AdmissionRefusedError:
                self._shared.unplace(waiter.ticket)  # the service's look said room, the workers said no
                continue
            except Exception as error:  # this start's own error
                self._pop(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(error)
                continue
            self._pop(waiter)
            if waiter.future.done():
                await self._release(result)
            else:
                waiter.future.set_result(result)
        for waiter in self._line:
            place = answer.places.get(waiter.ticket)
            if place is not None:
                waiter.place = Position(*place)
        self._tell_all()

    def _pop(self, waiter: _Waiter[T], *, leave: bool = True) -> None:
        if leave and self._shared is not None:
            self._shared.leave(waiter.ticket)
        if self._line and self._line[0] is waiter:
            self._line.popleft()
        elif waiter in self._line:
            self._line.remove(waiter)
        self._tell_all()

    def _tell_all(self) -> None:
        for waiter in self._line:
            self._tell(waiter)

    def _tell(self, waiter: _Waiter[T], *, force: bool = False) -> None:
        """Send ``waiter`` its position and fresh estimate if either changed (the estimate by a second
        or more; at most once per notice interval, unless forced)."""
        now = self._clock()
        if not force and now - waiter.last_notice < self._notice_interval_s:
            return
        if self.shared and waiter.place is not None:  # its place in the service's line
            position, eta = waiter.place.position, waiter.place.eta_s
        elif self.shared and not force:
            return  # not placed in the service's line yet (its join is on its way): told once it is
        else:
            position = self._line.index(waiter) + 1
            eta = self.eta_s(position, waiting_since=waiter.enqueued)
        if position == waiter.told and not _moved(waiter.told_eta, eta):
            return
        waiter.told, waiter.told_eta = position, eta
        waiter.last_notice = now
        waiter.notify(Position(position=position, ahead=position - 1, eta_s=eta))

    def _retry_hint(self) -> float:
        eta = self.eta_s(len(self._line) + 1)
        return max(1.0, eta) if eta is not None else 5.0

    def _count(self, outcome: str, waited_s: float) -> None:
        if self._on_wait is not None:
            self._on_wait(outcome, waited_s)


def _moved(told: float | None, eta: float | None) -> bool:
    """Whether the estimate ``eta`` is news to a waiter told ``told``: measured at last, or a second off."""
    if eta is None or told is None:
        return (eta is None) != (told is None)
    return abs(eta - told) >= _ETA_STEP_S


def waiting_room(
    backend: WorldBackend, config: ServerConfig, hosts: WorldHosts, metrics: ServerMetrics | None = None
) -> WaitingRoom[Session[Chunk]]:
    """The server's room: starts are sessions of ``backend``; the worlds in ``hosts`` that end
    give their lengths; ``metrics`` count the outcomes and waits."""

    async def release(session: Session[Chunk]) -> None:
        await backend.close_session(session.session_id)

    room: WaitingRoom[Session[Chunk]] = WaitingRoom(
        capacity=backend.capacity,
        release=release,
        max_waiting=config.queue_max,
        timeout_s=config.queue_timeout_s,
        on_wait=None if metrics is None else metrics.queue_wait,
        shared=hosts.directory,  # one of several front-ends: the service's line
    )
    hosts.on_end = room.world_ended
    if metrics is not None:
        metrics.queue_waiting = lambda: room.waiting
    return room
