"""The session control plane: event ordering, backpressure and chunk-boundary snapshots.

Owns, per realtime world: a bounded, de-duplicated queue of accepted events; the
monotonic event floor; the current prompt and controls; the chunk counter; the
status machine (:data:`TRANSITIONS`); counters; and the record of events it had to
drop. Events are *accepted* at once and *applied* only at the next chunk boundary,
as one sorted, immutable :class:`~worldserve.protocol.TickRequest`; a chunk commits
only if the model's :class:`~worldserve.protocol.ChunkMetadata` equals its tick's.
Any failure fails closed: the worker's state is released and only ``reset()`` or
``close()`` go on. Two additions to the seed, both off unless asked for: a newer event
*supersedes* queued events on continuous tracks (``coalesce_tracks``), so held controls
never fill the queue, and ``cancel_chunk()`` abandons the chunk in flight, leaving the
session active at its last commit with the chunk's events still queued (it needs a tick
consumer with ``cancel_tick``). And one that is always on: a key tapped between two boundaries
reaches the model. On a held-keys control (:data:`~worldserve.protocol.HELD_KEYS_SCHEMA_NAME`) a
tick holds the keys held at its boundary *and* those pressed since the last one (ABot-World's
"activated" keys), and a superseding event carries the presses of those it superseded.

All state changes happen in synchronous code between ``await`` points, so on one
event loop they are atomic without a lock; the one lock serializes the operations
that await a worker (a tick, a reset, a close). Model-defined control payloads stay
opaque here. Its errors are :mod:`worldserve.errors`' control-plane branch, re-exported
here under the seed's names. Standard library only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

from worldserve.errors import (
    CancelUnsupportedError,
    ChunkCancelledError,
    ChunkMetadataError,
    ErrorCode,
    EventQueueFullError,
    InvalidEventError,
    NothingToCancelError,
    SessionError,
    SessionExistsError,
    SessionStateError,
    StaleEventError,
)
from worldserve.protocol import ChunkMetadata, ControlInput, TickRequest, held_keys, thaw_transport_value
from worldserve.stats import SessionCounters, SessionStats

__all__ = [
    "TRANSITIONS",
    "CancelUnsupportedError",
    "ChunkCancelledError",
    "ChunkMetadataError",
    "ControlReducer",
    "ControlValidator",
    "DropReason",
    "DroppedEvents",
    "EventAcceptance",
    "EventAcceptanceStatus",
    "EventQueueFullError",
    "EventReach",
    "InvalidEventError",
    "NothingToCancelError",
    "PreparedControls",
    "Session",
    "SessionError",
    "SessionEvent",
    "SessionExistsError",
    "SessionLifecycle",
    "SessionManager",
    "SessionStateError",
    "SessionStatus",
    "StaleEventError",
    "TickCanceller",
    "TickRetracter",
    "TickConsumer",
]


class EventAcceptanceStatus(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"


class SessionStatus(StrEnum):
    ACTIVE = "active"
    RESETTING = "resetting"
    FAILED = "failed"
    CLOSING = "closing"
    CLEANUP_FAILED = "cleanup_failed"
    CLOSED = "closed"


#: The status machine: each status and the statuses it may move to.
TRANSITIONS: Mapping[SessionStatus, frozenset[SessionStatus]] = MappingProxyType(
    {
        SessionStatus.ACTIVE: frozenset({SessionStatus.FAILED, SessionStatus.RESETTING, SessionStatus.CLOSING}),
        SessionStatus.FAILED: frozenset({SessionStatus.RESETTING, SessionStatus.CLOSING}),
        SessionStatus.RESETTING: frozenset({SessionStatus.ACTIVE, SessionStatus.FAILED}),
        SessionStatus.CLOSING: frozenset({SessionStatus.CLOSED, SessionStatus.CLEANUP_FAILED}),
        SessionStatus.CLEANUP_FAILED: frozenset({SessionStatus.CLOSING}),
        SessionStatus.CLOSED: frozenset(),
    }
)


class DropReason(StrEnum):
    """Why accepted events were discarded without being applied."""

    RESET = "reset"
    CLOSED = "closed"
    FAILED = "failed"
    #: replaced in the queue by a newer event on the same continuous tracks (see ``coalesce_tracks``)
    SUPERSEDED = "superseded"


@dataclass(frozen=True, slots=True)
class DroppedEvents:
    """Accepted events a session discarded, and why; a transport tells its client."""

    event_ids: tuple[int, ...]
    reason: DropReason
    detail: str = ""
    #: With ``SUPERSEDED``: the id of the event that superseded them.
    superseded_by: int | None = None


@dataclass(frozen=True, slots=True)
class EventReach:
    """What some events change: the control tracks they set, and whether one of them sets the prompt.

    Two sets of events *overlap* when both set one track, or both set the prompt: applied in one
    chunk, the later would hide the earlier (the last value per track wins).
    """

    tracks: frozenset[str] = frozenset()
    prompt: bool = False

    def overlaps(self, other: EventReach) -> bool:
        return (self.prompt and other.prompt) or not self.tracks.isdisjoint(other.tracks)


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """One atomically accepted prompt and/or control update.

    ``prompt=None`` leaves the prompt as it is. Controls are keyed by ``track`` when
    the chunk snapshot is assembled; their schema and data are opaque here.
    """

    event_id: int
    prompt: str | None = None
    controls: tuple[ControlInput, ...] = ()

    def __post_init__(self) -> None:
        if type(self.event_id) is not int or self.event_id < 0:
            if isinstance(self.event_id, bool) or not isinstance(self.event_id, int) or self.event_id < 0:
                raise ValueError(f"event_id must be a non-negative integer; got {self.event_id!r}.")
            object.__setattr__(self, "event_id", int(self.event_id))
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a string or None; got {type(self.prompt).__name__}.")
        controls = self.controls if type(self.controls) is tuple else tuple(self.controls)
        tracks: set[str] = set()
        for control in controls:
            if not isinstance(control, ControlInput):
                raise ValueError(f"controls must contain ControlInput values; got {type(control).__name__}.")
            if control.track in tracks:
                raise ValueError(f"A composite event may update each control track at most once ({control.track!r}).")
            tracks.add(control.track)
        if self.prompt is None and not controls:
            raise ValueError("An event must update the prompt, one or more controls, or both.")
        object.__setattr__(self, "controls", controls)


@dataclass(frozen=True, slots=True)
class EventAcceptance:
    """The immediate answer to ``accept_event``; accepted does not mean applied."""

    session_id: str
    event_id: int
    status: EventAcceptanceStatus
    pending_event_count: int


TickOutputT = TypeVar("TickOutputT")


class TickConsumer(Protocol[TickOutputT]):
    """Runs one immutable chunk-boundary tick (the engine, in production).

    A consumer may also offer ``cancel_tick(tick) -> None`` (see :class:`TickCanceller`)
    for :meth:`Session.cancel_chunk`; one without it cannot cancel a chunk.
    """

    async def execute_tick(self, tick: TickRequest) -> TickOutputT: ...

    def chunk_metadata(self, output: TickOutputT) -> ChunkMetadata: ...


class TickCanceller(Protocol):
    """The optional half of a tick consumer that cancels a tick in flight.

    ``cancel_tick(tick)`` either refuses at once, changing nothing (raises
    :class:`NothingToCancelError` when the tick is already done, or
    :class:`CancelUnsupportedError` when its backend cannot roll the session back), or
    promises two things: the pending ``execute_tick(tick)`` raises
    :class:`ChunkCancelledError`, and the backend's state of the session is back at the
    end of chunk ``tick.chunk_index - 1`` before any later tick of it runs.
    """

    def cancel_tick(self, tick: TickRequest) -> None: ...


class TickRetracter(Protocol):
    """The optional half of a tick consumer that undoes the last tick it committed.

    ``await retract_tick(tick)`` (``tick`` the session's last, committed, with no tick of
    the session since) either refuses, changing nothing (raises
    :class:`CancelUnsupportedError`: its backend cannot roll the session back), or returns
    once the backend's state of the session is back at the end of chunk
    ``tick.chunk_index - 1``; any other error means the state may be lost (the session
    fails closed).
    """

    async def retract_tick(self, tick: TickRequest) -> None: ...


class _Queued(NamedTuple):
    """An accepted event while it waits: when it was accepted, and per held-keys track the keys it pressed
    (against the event before it when it came) and those the events it superseded pressed: all of them
    show in the tick that applies it."""

    event: SessionEvent
    accepted_ns: int
    presses: Mapping[str, frozenset[str]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class _Undo:
    """What the last commit changed, kept until the next tick starts (:meth:`Session.retract_chunk`)."""

    tick: TickRequest
    events: tuple[tuple[int, _Queued], ...]
    prompt: str | None
    controls: dict[str, ControlInput]
    snapshot: tuple[ControlInput, ...]


@dataclass(frozen=True, slots=True)
class PreparedControls:
    """One reducer-owned, transactional control snapshot.

    ``private_state`` is opaque here and becomes durable only after the tick that
    used it commits.
    """

    controls: tuple[ControlInput, ...]
    private_state: Any = None


class ControlReducer(Protocol):
    """Optional model adapter for stateful controls sampled per AR block."""

    def prepare(
        self,
        *,
        current_controls: Mapping[str, ControlInput],
        events: Sequence[SessionEvent],
        chunk_index: int,
    ) -> PreparedControls: ...

    def commit(self, prepared: PreparedControls) -> None: ...

    def reset(self) -> None: ...


class ControlValidator(Protocol):
    """The model's check of controls, run when an event is accepted.

    Raises ``ValueError`` naming the track, schema and problem for a control the
    model cannot take.
    """

    def validate_controls(self, controls: Sequence[ControlInput]) -> None: ...


class SessionLifecycle(Protocol):
    """Worker-facing lifecycle operations (see :class:`worldserve.WorkerLifecycle`)."""

    async def reset_session(self, session_id: str) -> None: ...

    async def close_session(self, session_id: str) -> None: ...


def _default_request_id(session_id: str, chunk_index: int) -> str:
    return f"ar-{session_id}-{chunk_index}-{uuid.uuid4().hex}"


def _positive_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive integer; got {value!r}.")
    return value


def _failure_code(error: BaseException, fallback: str) -> str:
    """The stable code a transport reports for the error that failed a session.

    An exception's own string ``code`` wins (every :class:`SessionError` has one, so a
    :class:`ChunkMetadataError` gives ``"metadata_mismatch"``); a cancellation gives
    ``"cancelled"``; anything else ``fallback``. ``SystemExit.code`` is an exit status,
    not a code, so only :class:`Exception` s are asked.
    """
    code = getattr(error, "code", None) if isinstance(error, Exception) else None
    if isinstance(code, str) and code:
        return code
    if isinstance(error, asyncio.CancelledError):
        return ErrorCode.CANCELLED
    return fallback


def _echoes(metadata: object, tick: TickRequest) -> bool:
    """Whether ``metadata`` equals ``ChunkMetadata.from_tick(tick)``, without building it."""
    return (
        type(metadata) is ChunkMetadata
        and metadata.session_id == tick.session_id
        and metadata.request_id == tick.request_id
        and metadata.chunk_index == tick.chunk_index
        and metadata.applied_event_ids == tick.applied_event_ids
    )


_MAX_DROP_RECORDS = 256


class Session(Generic[TickOutputT]):
    """Transactional event queue and chunk snapshot for one realtime world."""

    def __init__(
        self,
        session_id: str,
        *,
        tick_consumer: TickConsumer[TickOutputT],
        lifecycle: SessionLifecycle,
        max_pending_events: int,
        request_id_factory: Callable[[str, int], str] | None = None,
        control_reducer: ControlReducer | None = None,
        control_validator: ControlValidator | None = None,
        coalesce_tracks: frozenset[str] = frozenset(),
    ) -> None:
        if not isinstance(session_id, str) or not session_id.strip():
            raise ValueError("session_id must be a non-empty string.")
        self.session_id = session_id
        self._tick_consumer = tick_consumer
        self._lifecycle = lifecycle
        self._max_pending_events = _positive_int(max_pending_events, "max_pending_events")
        self._request_id_factory = request_id_factory or _default_request_id
        self._control_reducer = control_reducer
        self._control_validator = control_validator
        if not isinstance(coalesce_tracks, frozenset) or not all(isinstance(t, str) for t in coalesce_tracks):
            raise ValueError(f"coalesce_tracks must be a frozenset of track names; got {coalesce_tracks!r}.")
        self._coalesce_tracks = coalesce_tracks

        self._status = SessionStatus.ACTIVE
        self._pending: dict[int, _Queued] = {}
        self._recent_event_ids: OrderedDict[int, None] = OrderedDict()
        self._event_floor = -1
        self._inflight_event_floor: int | None = None
        self._inflight_tick: TickRequest | None = None
        self._cancelled_request: str | None = None  # the request id cancel_chunk() cancelled
        self._undo: _Undo | None = None  # the last commit, while retract_chunk() can still undo it
        self._chunk_index = 0
        self._epoch = 0
        self._prompt: str | None = None
        self._controls: dict[str, ControlInput] = {}
        self._controls_snapshot: tuple[ControlInput, ...] = ()
        self._failure: str | None = None
        self._failure_code: str | None = None
        self._dropped: deque[DroppedEvents] = deque(maxlen=_MAX_DROP_RECORDS)
        self._counters = SessionCounters()
        self._tick_lock = asyncio.Lock()

    # -- read-only views -------------------------------------------------------------

    @property
    def status(self) -> SessionStatus:
        return self._status

    @property
    def chunk_index(self) -> int:
        """Index of the next chunk; 0 after creation and after each reset."""
        return self._chunk_index

    @property
    def epoch(self) -> int:
        """How many successful resets this session has seen."""
        return self._epoch

    @property
    def pending_event_count(self) -> int:
        """Accepted events not yet committed, including those of the tick in flight."""
        return len(self._pending)

    @property
    def pending_event_ids(self) -> tuple[int, ...]:
        """Ids of the accepted events not yet committed, in order (the tick in flight's included)."""
        return tuple(sorted(self._pending))

    def pending_reach(self, *, above: int = -1, through: int | None = None) -> EventReach:
        """What the pending events with ids above ``above`` and at most ``through`` (None: any) change."""
        events = [
            queued.event for event_id, queued in self._pending.items()
            if event_id > above and (through is None or event_id <= through)
        ]  # fmt: skip
        return EventReach(
            frozenset(control.track for event in events for control in event.controls),
            any(event.prompt is not None for event in events),
        )

    @property
    def max_pending_events(self) -> int:
        return self._max_pending_events

    @property
    def coalesce_tracks(self) -> frozenset[str]:
        """The continuous tracks on which a newer event supersedes queued ones (none: the seed's queue)."""
        return self._coalesce_tracks

    @property
    def chunk_in_flight(self) -> int | None:
        """The index of the chunk being generated (``next_chunk()`` awaits it), or ``None``."""
        return None if self._inflight_tick is None else self._inflight_tick.chunk_index

    @property
    def event_floor(self) -> int:
        """Events at or below this id are stale (-1 before any chunk applied one)."""
        floor = self._event_floor
        if self._inflight_event_floor is not None and self._inflight_event_floor > floor:
            return self._inflight_event_floor
        return floor

    @property
    def prompt(self) -> str | None:
        """The committed prompt (that of the last chunk)."""
        return self._prompt

    @property
    def controls(self) -> tuple[ControlInput, ...]:
        """The committed controls, ordered by track."""
        return self._controls_snapshot

    @property
    def failure(self) -> str | None:
        """Why the session last failed (``"ExcType: message"``); ``None`` if it has not.

        Set when a tick or a reset fails, kept through ``close()`` so a transport can
        still report it, cleared by a successful ``reset()``.
        """
        return self._failure

    @property
    def failure_code(self) -> str | None:
        """The stable code of :attr:`failure`, for clients; ``None`` exactly when ``failure`` is.

        The failing exception's string ``code`` if it has one (``"metadata_mismatch"``
        for a :class:`ChunkMetadataError`, ``"invalid_state"``, ...), else
        ``"cancelled"`` for a cancellation, else ``"tick_failed"`` for a failed tick
        (the consumer raised, or the reducer's commit did) and ``"reset_failed"`` for
        a failed reset.
        """
        return self._failure_code

    @property
    def dropped_events(self) -> tuple[DroppedEvents, ...]:
        """Records of discarded events not yet taken by :meth:`take_dropped`."""
        return tuple(self._dropped)

    def take_dropped(self) -> tuple[DroppedEvents, ...]:
        """Return and forget the drop records (a transport forwards them once)."""
        records = tuple(self._dropped)
        self._dropped.clear()
        return records

    @property
    def stats(self) -> SessionStats:
        return self._counters.snapshot()

    # -- state machine helpers -------------------------------------------------------

    def _move(self, status: SessionStatus) -> None:
        if status not in TRANSITIONS[self._status]:
            raise SessionStateError(
                f"session {self.session_id!r} cannot move from {self._status.value} to {status.value}."
            )
        self._status = status

    def _require(self, *allowed: SessionStatus) -> None:
        if self._status not in allowed:
            raise SessionStateError(f"session {self.session_id!r} is {self._status.value}.")

    def _drop_pending(self, reason: DropReason, detail: str) -> None:
        if not self._pending:
            return
        event_ids = tuple(sorted(self._pending))
        self._event_floor = max(self._event_floor, event_ids[-1])
        self._pending.clear()
        self._dropped.append(DroppedEvents(event_ids, reason, detail))
        self._counters.dropped += len(event_ids)

    def _clear_world(self) -> None:
        self._undo = None
        self._prompt = None
        self._controls = {}
        self._controls_snapshot = ()
        self._inflight_event_floor = None

    # -- events ------------------------------------------------------------------------
    def note_transport_refusal(self, status: EventAcceptanceStatus | Literal["stale"]) -> None:
        """Count an event a transport answered ``duplicate`` or refused as stale before it reached
        this queue (a shared world maps each member's own event ids and checks them itself), so
        the session's counters -- and the metrics read from them -- still see every event."""
        if status == "stale":
            self._counters.stale += 1
        elif status is EventAcceptanceStatus.DUPLICATE:
            self._counters.duplicate += 1
        else:
            raise ValueError(f"only duplicate or stale events are counted here; got {status!r}.")

    async def accept_event(self, event: SessionEvent) -> EventAcceptance:
        """Enqueue ``event`` at once, or answer ``DUPLICATE`` for an id already seen.

        Raises :class:`StaleEventError` at or below the event floor (that of the
        tick in flight included), :class:`EventQueueFullError` when the queue is
        full, :class:`InvalidEventError` when the model refuses a control. A
        composite event is admitted whole or not at all. With ``coalesce_tracks``, an
        accepted event supersedes the queued events it makes redundant -- not in the tick
        in flight, a lower id, no prompt, every track they update continuous and updated
        by it -- which are dropped with reason ``superseded`` (so a held control never
        fills the queue).
        """
        if not isinstance(event, SessionEvent):
            raise TypeError("event must be a SessionEvent.")
        self._require(SessionStatus.ACTIVE)
        counters = self._counters
        event_id = event.event_id
        if event_id in self._pending or event_id in self._recent_event_ids:
            counters.duplicate += 1
            return EventAcceptance(self.session_id, event_id, EventAcceptanceStatus.DUPLICATE, len(self._pending))
        floor = self.event_floor
        if event_id <= floor:
            counters.stale += 1
            raise StaleEventError(f"event_id {event_id} is stale; the session event floor is {floor}.")
        superseded = self._superseded_by(event) if self._coalesce_tracks else ()
        if not superseded and len(self._pending) >= self._max_pending_events:
            counters.rejected_full += 1
            raise EventQueueFullError(
                f"session {self.session_id!r} event queue is full ({self._max_pending_events} pending)."
            )
        if self._control_validator is not None and event.controls:
            try:
                self._control_validator.validate_controls(event.controls)
            except ValueError as error:
                counters.invalid += 1
                raise InvalidEventError(f"event {event_id} refused: {error}") from error
        presses = self._presses(event, superseded)
        if superseded:
            for old_id in superseded:
                del self._pending[old_id]
            # The floor moves past them (a re-sent one is stale, never applied after all).
            self._event_floor = max(self._event_floor, superseded[-1])
            self._dropped.append(
                DroppedEvents(superseded, DropReason.SUPERSEDED, f"superseded by event {event_id}", event_id)
            )
            counters.dropped += len(superseded)
            counters.superseded += len(superseded)
        self._pending[event_id] = _Queued(event, time.monotonic_ns(), presses)
        recent = self._recent_event_ids
        recent[event_id] = None
        if len(recent) > self._max_pending_events:
            recent.popitem(last=False)
        counters.accepted += 1
        return EventAcceptance(self.session_id, event_id, EventAcceptanceStatus.ACCEPTED, len(self._pending))

    def _superseded_by(self, event: SessionEvent) -> tuple[int, ...]:
        """The queued events ``event`` supersedes, in id order: not in the tick in flight, a
        lower id, no prompt, and every track they update continuous and updated by ``event``.

        Applying ``event`` after them leaves the same snapshot as applying them all (the
        last control per track wins), so dropping them changes no chunk.
        """
        tracks = self._coalesce_tracks.intersection(control.track for control in event.controls)
        if not tracks:
            return ()
        # Events at or below the floor are pending again after a retract: they are applied again, as they were.
        after = max(self._event_floor, -1 if self._inflight_event_floor is None else self._inflight_event_floor)
        return tuple(
            old_id
            for old_id in sorted(self._pending)
            if after < old_id < event.event_id
            and (old := self._pending[old_id].event).prompt is None
            and all(control.track in tracks for control in old.controls)
        )

    def _held_before(self, track: str) -> frozenset[str]:
        """The keys the committed controls hold on ``track`` (none: no such control yet)."""
        control = self._controls.get(track)
        return (held_keys(control) if control is not None else None) or frozenset()

    def _presses(self, event: SessionEvent, superseded: tuple[int, ...]) -> Mapping[str, frozenset[str]]:
        """Per held-keys track of ``event``, the keys it presses (held by it, not by the event before it) and
        those pressed by the ``superseded`` events, which it carries: a tap survives its release superseding it."""
        tracks = {control.track: held for control in event.controls if (held := held_keys(control)) is not None}
        if not tracks:
            return MappingProxyType({})
        state = {track: self._held_before(track) for track in tracks}
        presses: dict[str, set[str]] = {track: set() for track in tracks}
        for event_id in sorted(self._pending):  # the tick in flight's events first: they come before
            if event_id >= event.event_id:
                break
            queued = self._pending[event_id]
            for control in queued.event.controls:
                held = held_keys(control) if control.track in state else None
                if held is not None:
                    state[control.track] = held
            if event_id in superseded:
                for track, keys in queued.presses.items():
                    presses.setdefault(track, set()).update(keys)
        for track, held in tracks.items():
            presses[track] |= held - state[track]
        return MappingProxyType({track: frozenset(keys) for track, keys in presses.items() if keys})

    def _shown(self, events: Sequence[_Queued], controls: dict[str, ControlInput]) -> tuple[ControlInput, ...] | None:
        """The tick's controls when a key was pressed and released since the last boundary: ``controls`` with
        such keys added to their held-keys control (None: no such key, or the model refuses the keys together,
        as a one-key model does: the state alone then)."""
        pressed: dict[str, set[str]] = {}
        for queued in events:
            for track, keys in queued.presses.items():
                pressed.setdefault(track, set()).update(keys)
        tapped: dict[str, ControlInput] = {}
        for track, keys_pressed in pressed.items():
            final = controls[track]
            held = held_keys(final)
            extra = keys_pressed - held if held is not None else None
            if extra:
                data = thaw_transport_value(final.data)
                data["held"] = [*data["held"], *sorted(extra)]
                tapped[track] = ControlInput(track, final.schema, data)
        if not tapped:
            return None
        if self._control_validator is not None:
            try:
                self._control_validator.validate_controls(tuple(tapped.values()))
            except ValueError:
                return None
        shown = {**controls, **tapped}
        return tuple(shown[track] for track in sorted(shown))

    # -- chunks ------------------------------------------------------------------------

    def _build_tick(
        self, through: int | None = None
    ) -> tuple[TickRequest, dict[str, ControlInput], tuple[ControlInput, ...], PreparedControls | None]:
        """The next tick, the controls after it and their snapshot (the tick's own may add a tapped key), and
        the reducer's prepared controls."""
        event_ids = tuple(sorted(e for e in self._pending if through is None or e <= through))
        queued = [self._pending[event_id] for event_id in event_ids]
        events = [entry.event for entry in queued]
        prompt = self._prompt
        for event in events:
            if event.prompt is not None:
                prompt = event.prompt
        prepared: PreparedControls | None = None
        if self._control_reducer is None:
            if any(event.controls for event in events):
                controls = dict(self._controls)
                for event in events:
                    for control in event.controls:
                        controls[control.track] = control
                state = tuple(controls[track] for track in sorted(controls))
                snapshot = self._shown(queued, controls) or state
            else:
                controls, state = self._controls, self._controls_snapshot
                snapshot = state
        else:
            prepared = self._control_reducer.prepare(
                current_controls=MappingProxyType(self._controls),
                events=tuple(events),
                chunk_index=self._chunk_index,
            )
            if not isinstance(prepared, PreparedControls):
                raise TypeError("control reducer prepare() must return PreparedControls.")
            controls = {}
            for control in prepared.controls:
                if not isinstance(control, ControlInput):
                    raise TypeError("prepared controls must contain ControlInput values.")
                if control.track in controls:
                    raise ValueError("prepared controls must contain at most one value per track.")
                controls[control.track] = control
            snapshot = state = tuple(controls[track] for track in sorted(controls))
        tick = TickRequest(
            session_id=self.session_id,
            request_id=self._request_id_factory(self.session_id, self._chunk_index),
            chunk_index=self._chunk_index,
            applied_event_ids=event_ids,
            prompt=prompt,
            controls=snapshot,
        )
        self._inflight_event_floor = event_ids[-1] if event_ids else None
        return tick, controls, state, prepared

    def _commit_tick(
        self,
        tick: TickRequest,
        controls: dict[str, ControlInput],
        state: tuple[ControlInput, ...],
        prepared: PreparedControls | None,
    ) -> None:
        # Synchronous: no cancellation can land between the first and last line.
        # The reducer's commit is the only fallible step, so it runs first.
        if prepared is not None:
            assert self._control_reducer is not None
            self._control_reducer.commit(prepared)
        counters = self._counters
        now = time.monotonic_ns()
        popped = tuple((event_id, self._pending.pop(event_id)) for event_id in tick.applied_event_ids)
        for _, queued in popped:
            counters.applied_latency.observe((now - queued.accepted_ns) / 1e9)
        # A reducer's commit cannot be undone, so a session with one never retracts a chunk.
        self._undo = (
            None if prepared is not None else _Undo(tick, popped, self._prompt, self._controls, self._controls_snapshot)
        )
        if tick.applied_event_ids:
            # max: events superseded while this tick ran may have moved the floor past its ids
            self._event_floor = max(self._event_floor, tick.applied_event_ids[-1])
            counters.applied += len(tick.applied_event_ids)
        self._prompt = tick.prompt
        self._controls = controls  # the state: a key tapped shows in this tick alone
        self._controls_snapshot = state
        self._chunk_index += 1
        self._inflight_event_floor = None
        counters.chunks += 1

    async def _fail_tick(self, tick_error: BaseException) -> None:
        self._inflight_event_floor = None
        self._undo = None
        self._failure = f"{type(tick_error).__name__}: {tick_error}"
        self._failure_code = _failure_code(tick_error, ErrorCode.TICK_FAILED)
        self._move(SessionStatus.FAILED)
        self._counters.failures += 1
        # The forward may already have released the state; close is idempotent and also
        # covers successful forwards whose metadata or commit failed. A cancellation that
        # lands during the cleanup does not stop it, nor does it let the tick lock go
        # before the close is done: a queued reset must reach the worker after it.
        cleanup = asyncio.ensure_future(self._lifecycle.close_session(self.session_id))
        cancelled = False
        while not cleanup.done():
            try:
                await asyncio.shield(cleanup)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:
                break
        try:
            cleanup.result()
        except Exception as cleanup_error:
            raise SessionError(
                f"tick failed ({self._failure}) and worker session cleanup also failed: {cleanup_error}"
            ) from tick_error
        if cancelled:
            raise asyncio.CancelledError

    async def next_chunk(self, *, through: int | None = None) -> TickOutputT:
        """Snapshot the pending events, run one tick, and commit it atomically.

        ``through``: take only the pending events with ids up to it (None: every one); the others
        stay pending for a later chunk (a caller that decided what this chunk may hold beforehand).

        Raises :class:`ChunkCancelledError` (the session stays active, nothing committed,
        the tick's events still pending) when :meth:`cancel_chunk` cancelled this tick.
        """
        async with self._tick_lock:
            self._require(SessionStatus.ACTIVE)
            self._undo = None  # the backend's undo record is about to be replaced by this step's
            tick, controls, state, prepared = self._build_tick(through)
            self._inflight_tick = tick
            try:
                output = await self._tick_consumer.execute_tick(tick)
                metadata = self._tick_consumer.chunk_metadata(output)
                if not _echoes(metadata, tick):
                    raise ChunkMetadataError(
                        f"Tick consumer metadata does not match the submitted tick: expected "
                        f"{ChunkMetadata.from_tick(tick)!r}, got {metadata!r}."
                    )
                self._commit_tick(tick, controls, state, prepared)
            except ChunkCancelledError:
                self._inflight_tick = None
                if self._cancelled_request != tick.request_id:
                    await self._fail_tick(ChunkCancelledError("the tick consumer cancelled a tick nobody cancelled"))
                    raise
                # Back to the last commit: nothing of the tick is kept, its events stay pending.
                self._cancelled_request = None
                self._inflight_event_floor = None
                self._counters.cancelled += 1
                raise
            except BaseException as error:
                self._inflight_tick = None
                self._cancelled_request = None
                await self._fail_tick(error)
                raise
            self._inflight_tick = None
            self._cancelled_request = None
            return output

    async def cancel_chunk(self) -> int:
        """Cancel the chunk being generated; return its index.

        The pending ``next_chunk()`` raises :class:`ChunkCancelledError`; the session stays
        active at its last commit (same ``chunk_index``, prompt and controls), the
        cancelled tick's events stay pending and go, in order, into the next chunk, and
        the backend rolls the session's state back (the tick consumer's ``cancel_tick``).
        Refused, changing nothing: :class:`NothingToCancelError` when no chunk is in flight
        (or its result is already in), :class:`CancelUnsupportedError` when the consumer
        or its model cannot roll back, :class:`SessionStateError` unless ``active``. An
        asyncio cancellation of ``next_chunk()`` is another thing: it fails the session
        closed, as in the seed.
        """
        self._require(SessionStatus.ACTIVE)
        tick = self._inflight_tick
        if tick is None or self._cancelled_request == tick.request_id:
            raise NothingToCancelError(f"session {self.session_id!r} is not generating a chunk.")
        cancel_tick = getattr(self._tick_consumer, "cancel_tick", None)
        if not callable(cancel_tick):
            raise CancelUnsupportedError(f"the tick consumer of session {self.session_id!r} cannot cancel a chunk.")
        cancel_tick(tick)  # raises (changing nothing) or promises the rollback
        self._cancelled_request = tick.request_id
        return tick.chunk_index

    @property
    def chunk_retractable(self) -> int | None:
        """The index of the last committed chunk while :meth:`retract_chunk` may still undo it, else ``None``."""
        undo = self._undo
        return None if undo is None or self._status is not SessionStatus.ACTIVE else undo.tick.chunk_index

    async def retract_chunk(self) -> TickRequest:
        """Undo the last committed chunk (a preemption: it is to be made again); return its tick.

        Possible until the session's next tick starts, after none since the commit. The
        session is back where it was before that chunk: the same ``chunk_index``, prompt and
        controls, and the chunk's applied events pending again (in order, with their
        acceptance times), so the next chunk applies them again -- with any accepted since.
        They come back even past ``max_pending_events`` (they were accepted: none is lost); new
        events are then refused (``EventQueueFullError``) until a chunk applies them.
        The backend rolls its state back (the tick consumer's ``retract_tick``). Counted in
        ``retracted`` and ``unapplied``. Refused, changing nothing:
        :class:`NothingToCancelError` when no chunk can be undone (none committed since the
        last tick began, a reset, or a control reducer's commit), :class:`CancelUnsupportedError`
        when the consumer or its model cannot roll back, :class:`SessionStateError` unless
        ``active``. A failed rollback fails the session closed.
        """
        async with self._tick_lock:
            self._require(SessionStatus.ACTIVE)
            undo = self._undo
            if undo is None:
                raise NothingToCancelError(f"session {self.session_id!r} has no committed chunk it can undo.")
            retract_tick = getattr(self._tick_consumer, "retract_tick", None)
            if not callable(retract_tick):
                raise CancelUnsupportedError(
                    f"the tick consumer of session {self.session_id!r} cannot undo a committed chunk."
                )
            try:
                await retract_tick(undo.tick)
            except CancelUnsupportedError:
                raise  # refused: nothing changed, the undo record stays
            except BaseException as error:
                self._undo = None
                await self._fail_tick(error)
                raise
            self._undo = None
            for event_id, record in undo.events:
                self._pending[event_id] = record
            self._prompt, self._controls, self._controls_snapshot = undo.prompt, undo.controls, undo.snapshot
            self._chunk_index -= 1
            self._counters.retracted += 1
            self._counters.unapplied += len(undo.events)
            return undo.tick

    # -- lifecycle ---------------------------------------------------------------------

    async def reset(self) -> None:
        """Reset the worker's state and start over at chunk 0.

        Pending events are dropped (recorded), the prompt and controls cleared; the
        duplicate window is kept, so a re-sent old event stays a duplicate.
        """
        async with self._tick_lock:
            self._require(SessionStatus.ACTIVE, SessionStatus.FAILED)
            failure = self._failure
            self._move(SessionStatus.RESETTING)
            try:
                await self._lifecycle.reset_session(self.session_id)
                if self._control_reducer is not None:
                    self._control_reducer.reset()
            except BaseException as error:
                self._failure = f"reset failed: {type(error).__name__}: {error}"
                self._failure_code = _failure_code(error, ErrorCode.RESET_FAILED)
                self._move(SessionStatus.FAILED)
                self._counters.failures += 1
                raise
            if failure is not None:
                self._drop_pending(DropReason.FAILED, failure)
            else:
                self._drop_pending(DropReason.RESET, "session reset")
            self._clear_world()
            self._chunk_index = 0
            self._epoch += 1
            self._failure = None
            self._failure_code = None
            self._counters.resets += 1
            self._move(SessionStatus.ACTIVE)

    async def close(self) -> None:
        """Release the worker's state; a failed cleanup leaves a ``CLEANUP_FAILED`` tombstone."""
        async with self._tick_lock:
            if self._status is SessionStatus.CLOSED:
                return
            self._move(SessionStatus.CLOSING)
            try:
                await self._lifecycle.close_session(self.session_id)
            except BaseException:
                self._move(SessionStatus.CLEANUP_FAILED)
                raise
            if self._failure is not None:
                self._drop_pending(DropReason.FAILED, self._failure)
            else:
                self._drop_pending(DropReason.CLOSED, "session closed")
            self._clear_world()
            self._move(SessionStatus.CLOSED)

    async def disconnect(self) -> None:
        """A transport disconnect releases the worker's state like an explicit close."""
        await self.close()


class SessionManager(Generic[TickOutputT]):
    """Creates, finds, resets and closes sessions that share one tick/lifecycle backend.

    A session stays registered until its close succeeds. :meth:`stats` sums the
    counters of live sessions and of those already closed.
    """

    def __init__(
        self,
        *,
        tick_consumer: TickConsumer[TickOutputT],
        lifecycle: SessionLifecycle,
        max_pending_events: int,
        request_id_factory: Callable[[str, int], str] | None = None,
        session_id_factory: Callable[[], str] | None = None,
        control_reducer_factory: Callable[[], ControlReducer] | None = None,
        control_validator: ControlValidator | None = None,
        coalesce_tracks: frozenset[str] = frozenset(),
    ) -> None:
        self._tick_consumer = tick_consumer
        self._lifecycle = lifecycle
        self._max_pending_events = _positive_int(max_pending_events, "max_pending_events")
        self._request_id_factory = request_id_factory
        self._session_id_factory = session_id_factory or (lambda: uuid.uuid4().hex)
        self._control_reducer_factory = control_reducer_factory
        self._control_validator = control_validator
        self._coalesce_tracks = coalesce_tracks
        self._sessions: dict[str, Session[TickOutputT]] = {}
        self._retired = SessionStats()

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session[TickOutputT]]:
        return iter(tuple(self._sessions.values()))

    async def create_session(self, session_id: str | None = None) -> Session[TickOutputT]:
        resolved = session_id or self._session_id_factory()
        if resolved in self._sessions:
            raise SessionExistsError(f"session {resolved!r} already exists.")
        session: Session[TickOutputT] = Session(
            resolved,
            tick_consumer=self._tick_consumer,
            lifecycle=self._lifecycle,
            max_pending_events=self._max_pending_events,
            request_id_factory=self._request_id_factory,
            control_reducer=self._control_reducer_factory() if self._control_reducer_factory else None,
            control_validator=self._control_validator,
            coalesce_tracks=self._coalesce_tracks,
        )
        self._sessions[resolved] = session
        return session

    async def get_session(self, session_id: str) -> Session[TickOutputT]:
        try:
            return self._sessions[session_id]
        except KeyError as exc:
            raise SessionStateError(f"session {session_id!r} does not exist.") from exc

    async def reset_session(self, session_id: str) -> None:
        session = await self.get_session(session_id)
        await session.reset()

    async def close_session(self, session_id: str) -> None:
        session = await self.get_session(session_id)
        await session.close()
        if self._sessions.get(session_id) is session:
            del self._sessions[session_id]
            self._retired = self._retired + session.stats

    async def disconnect(self, session_id: str) -> None:
        """Release the owning worker's state when the session's transport goes away."""
        await self.close_session(session_id)

    def stats(self) -> SessionStats:
        total = self._retired
        for session in self._sessions.values():
            total = total + session.stats
        return total
