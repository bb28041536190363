"""One waiting line for a whole service: first come, first served across its front-ends.

A ``session.start {queue: true}`` that meets a full front-end waits in its front-end's
:class:`~worldserve.server.waiting.WaitingRoom`; with several front-ends the room also holds a
*ticket* in this line, kept by the session directory's actor (``directory_ray.py``), so the order
is the service's: the head of the line starts on whichever front-end has room first. That may be
another front-end than the one its client waits on: the ticket is then *placed* there (a
reservation the target counts against its room), its own front-end tells the client
``session.moved {url, reservation}``, and the client's start, sent there with the reservation, is
admitted at once. A reservation not taken within ``reservation_ttl_s`` lapses.

Each front-end polls (``poll``) every fraction of a second with its free slots and the tickets it
still holds (which also restores the line after the actor restarted, at the back), and hears what
to admit here, which of its tickets were placed elsewhere, what to expect from elsewhere, and each
of its tickets' place in the whole line and an estimate from the whole service's world lengths.

Owns: :class:`ClusterLine` (pure: the caller gives the time) and :class:`LineAnswer`.
Must not know: Ray, sockets, sessions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ClusterLine", "LineAnswer"]

_LENGTHS_KEPT = 32


@dataclass(slots=True)
class _Ticket:
    ticket: str
    owner: str  # the front-end its client waits on
    joined: float
    placed: str | None = None  # the front-end it starts on, once the line placed it
    placed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class LineAnswer:
    """What one front-end hears from a poll."""

    #: Its tickets to start here now (the head of the whole line, and this front-end has room).
    admit: tuple[str, ...] = ()
    #: Its tickets placed on another front-end: ticket -> that front-end's ``/v1/world`` URL.
    moved: dict[str, str] = field(default_factory=dict)
    #: Other front-ends' tickets placed here: their starts arrive with these reservations.
    expect: tuple[str, ...] = ()
    #: Its waiting tickets' places in the whole line: ticket -> (position, ahead, eta_s or None).
    places: dict[str, tuple[int, int, float | None]] = field(default_factory=dict)
    #: Tickets in the whole line (placed ones until they start).
    waiting: int = 0


class ClusterLine:
    """The service's line, one FIFO of tickets over its front-ends (each known by its ``/v1/world`` URL)."""

    def __init__(self, reservation_ttl_s: float = 10.0, front_end_ttl_s: float = 5.0) -> None:
        self._reservation_ttl_s = reservation_ttl_s
        self._front_end_ttl_s = front_end_ttl_s
        self._line: list[_Ticket] = []
        self._seen: dict[str, float] = {}  # front-end -> its last poll
        self._slots: dict[str, int] = {}  # front-end -> its session slots (for the estimate)
        self._lengths: deque[float] = deque(maxlen=_LENGTHS_KEPT)
        self._last_end: float | None = None

    def join(self, owner: str, ticket: str, now: float) -> int:
        """A start waits on ``owner`` from now on, at the back of the line: its position (1: next)."""
        if not any(item.ticket == ticket for item in self._line):
            self._line.append(_Ticket(ticket, owner, now))
        self._seen[owner] = now
        return next(index for index, item in enumerate(self._line, 1) if item.ticket == ticket)

    def leave(self, ticket: str) -> None:
        """The ticket's start left the line: it started, or its client left or gave up."""
        self._line = [item for item in self._line if item.ticket != ticket]

    def placed_on(self, front_end: str, ticket: str) -> bool:
        """Whether ``ticket`` is placed on ``front_end`` now (its client may arrive there before the
        front-end's next poll says so)."""
        return any(item.ticket == ticket and item.placed == front_end for item in self._line)

    def unplace(self, ticket: str) -> None:
        """The front-end a ticket was placed on could not start it after all: back to its place in line."""
        for item in self._line:
            if item.ticket == ticket:
                item.placed = None

    def ended(self, lengths: Sequence[float], now: float) -> None:
        """Worlds of these lengths (seconds) ended somewhere in the service."""
        for length in lengths:
            if length >= 0:
                self._lengths.append(length)
                self._last_end = now

    def poll(self, front_end: str, free: int, slots: int | None, tickets: Sequence[str], now: float) -> LineAnswer:
        """``front_end`` has ``free`` session slots now (``slots`` in all, None when unknown) and still holds
        ``tickets`` (any the line lost are put back at its end; any it holds no more leave): what now?"""
        self._seen[front_end] = now
        if slots is not None:
            self._slots[front_end] = slots
        self._expire(now)
        held = set(tickets)
        # Its tickets it no longer holds left (started, or their clients left), but for those placed
        # elsewhere, which their clients are on their way to (they leave when started there, or lapse).
        self._line = [
            item
            for item in self._line
            if item.owner != front_end or item.ticket in held or item.placed not in (None, front_end)
        ]
        known = {item.ticket for item in self._line}
        self._line.extend(_Ticket(ticket, front_end, now) for ticket in tickets if ticket not in known)
        room = free - sum(1 for item in self._line if item.placed == front_end)  # starts on their way here
        for item in self._line:
            if room <= 0:
                break
            if item.placed is None:
                item.placed, item.placed_at = front_end, now
                room -= 1
        admit = tuple(item.ticket for item in self._line if item.owner == front_end and item.placed == front_end)
        moved = {
            item.ticket: item.placed
            for item in self._line
            if item.owner == front_end and item.placed is not None and item.placed != front_end
        }
        expect = tuple(item.ticket for item in self._line if item.placed == front_end and item.owner != front_end)
        places = {}
        for index, item in enumerate(self._line):
            if item.owner == front_end and item.placed is None:
                places[item.ticket] = (index + 1, index, self._eta(index + 1, item.joined, now))
        return LineAnswer(admit, moved, expect, places, len(self._line))

    def _eta(self, position: int, joined: float, now: float) -> float | None:
        """As one front-end's room estimates it (``WaitingRoom.eta_s``), over the whole service's slots
        and the worlds that ended anywhere in it."""
        slots = sum(self._slots.values())
        if not self._lengths or not slots:
            return None
        every = sum(self._lengths) / len(self._lengths) / slots
        since = joined if self._last_end is None else max(joined, self._last_end)
        first = max(0.0, every - (now - since))
        return round(first + (position - 1) * every, 1)

    def _expire(self, now: float) -> None:
        """A front-end silent for ``front_end_ttl_s`` left with its tickets (their clients went with it), and
        what was placed on it goes back to its place in line; a ticket placed on another front-end than
        its own whose client did not start there within ``reservation_ttl_s`` leaves the line (the client
        went away, or starts again at the back)."""
        gone = {url for url, seen in self._seen.items() if now - seen > self._front_end_ttl_s}
        for url in gone:
            del self._seen[url]
            self._slots.pop(url, None)
        kept = []
        for item in self._line:
            if item.owner in gone and item.placed in (None, item.owner):
                continue  # its client was connected to the front-end that went (one on its way elsewhere stays)
            if item.placed in gone:
                item.placed = None
            elif item.placed not in (None, item.owner) and now - item.placed_at > self._reservation_ttl_s:
                continue
            kept.append(item)
        self._line = kept
