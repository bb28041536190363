"""One world on the server and the connections attached to it: resume and multiplayer.

Owns, per session: the session itself, its :class:`~.pacing_loop.PacingLoop` (the generation
task and the latency policy: when each tick goes and when its chunk plays, ``lead_chunks`` ahead
of real time or just in time, and preemption; the host answers what it asks: paused while the
controlling connections lag ``max_lag_chunks`` chunks, when a member's acks say a chunk plays,
sending a chunk made and undoing one), the session's
chunk ``seq``, frame encoding (once per chunk and media in use, shared by every member of that
media: each member picks its media on join or resume, the host's is the world's; the world tells
the runtime which other media are in use, :meth:`WorldBackend.set_extra_encodings`, so
a worker that encodes makes each once, and frames a worker already encoded in a wanted
media and quality are used as they are), a replay buffer of the last
``replay_chunks`` chunks, and its :class:`Member` s: the host, controllers and viewers,
each with its own event-id mapping (wire ids are per member; the session sees one
increasing sequence), its ack state, its resume token, and what it missed while parked.
For H.264 (one stream per world, encoded once for its H.264 members) it also owns where each member
stands in that stream: a member that has not received the stream's start (it joined late,
skipped chunks as a lagging viewer, or resumed past a gap) gets nothing until a chunk that
starts with an IDR frame, sent with the init segment in front; the world asks the encoder
for one at once (:meth:`WorldBackend.request_keyframe`: the worker's encoder, or its own
when the server encodes), so the wait is a chunk or two and every other member's stream
goes on untouched.
Frames in parts (a member that asked, ``options.parts``; JPEG or raw; a model with
``spec.frame_parts`` whose worker encodes): the world listens to its chunks' parts
(:meth:`WorldBackend.listen_parts`) and sends each as a ``chunk.part`` to the members that take parts,
under the seq the chunk will have (:class:`~.parts.PartsOut`); the chunk then reaches them without
the frames they have. A chunk with parts out is not cancelled or undone (its frames may be playing),
and the pacing takes it as ready when it is playable, while every connected member takes parts.
And whether the world is *in use*: each time a connected member arrives, acks a chunk or
sends an event, the runtime is told the session is in use for ``evict_idle_s`` more
seconds (:meth:`WorldBackend.mark_in_use`), and when its last member parks that it no
longer is, so a newcomer may evict only a world nobody is playing.
:class:`WorldHosts` is the registry of the server's worlds by session id.

Sans-I/O towards sockets: members are reached through :class:`Outlet` (``post`` never
blocks; a connection writes in its own task), so a slow viewer never holds up anyone.

Must not know: sockets, message parsing, HTTP, how the runtime reaches its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Literal, Protocol

from pydantic import BaseModel

from worldserve.errors import ErrorCode, InvalidEventError, StaleEventError
from worldserve.media import MEDIA, EncodedFrames, FrameEncoder, FrameEncoding, decode_frames
from worldserve.models.base import ModelSpec
from worldserve.runtime.chunk import Chunk
from worldserve.runtime.messages import ChunkPart
from worldserve.runtime.metrics import Capacity
from worldserve.server.config import ServerConfig
from worldserve.server.directory import Directory
from worldserve.server.messages import (
    ChunkFrames,
    ChunkMessage,
    ChunkPartMessage,
    ChunkSkipped,
    ChunkTimes,
    InputDropped,
    SessionClosed,
    SessionFailed,
)
from worldserve.server.metrics import ServerMetrics
from worldserve.server.pacing_loop import PacingLoop, TickClock
from worldserve.server.parts import PartsOut
from worldserve.session import (
    EventAcceptance,
    EventAcceptanceStatus,
    Session,
    SessionError,
    SessionEvent,
    SessionStateError,
    SessionStatus,
)

__all__ = ["Member", "Outlet", "Role", "WorldBackend", "WorldHost", "WorldHosts", "wire_media"]

log = logging.getLogger("worldserve.server")


class WorldBackend(TickClock, Protocol):
    """What a world needs from the runtime (its pacing loop: the chunk clock and the headroom)."""

    @property
    def spec(self) -> ModelSpec: ...

    async def create_session(
        self,
        *,
        prompt: str | None,
        seed: int,
        image: bytes | None,
        encoding: FrameEncoding | None = None,
        references: tuple[bytes, ...] = (),
    ) -> Session[Chunk]:
        """A new session; ``encoding`` is how its frames will be sent (the runtime's workers may
        encode them so, handing back :class:`~worldserve.media.EncodedFrames`); ``references``: the
        model's reference images, raw RGB in its slot order (all or none)."""
        ...

    async def close_session(self, session_id: str) -> None: ...

    def request_keyframe(self, session_id: str) -> bool:
        """Start the session's next chunk with an IDR frame (H.264) where its worker encodes;
        ``False`` when it cannot be asked (the world then encodes, or the stream starts anew)."""
        ...

    def set_extra_encodings(self, session_id: str, encodings: tuple[FrameEncoding, ...]) -> bool:
        """Have the session's worker encode its chunks in these media too, besides its own
        encoding (members asked for them); ``False`` when its worker does not encode (the world
        encodes them itself)."""
        ...

    def mark_in_use(self, session_id: str, seconds: float) -> None:
        """Someone plays the session: never evict it for the next ``seconds`` (0: it may be evicted)."""
        ...

    def listen_parts(self, session_id: str, listener: Callable[[ChunkPart], None] | None) -> bool:
        """Hear the session's chunks in parts as its worker makes them (``None``: stop); False when its model
        makes them whole."""
        ...

    def capacity(self) -> Capacity:
        """Room for new sessions now (slots, and whether a worker would take one)."""
        ...


#: Why chunks were not sent to a member (``chunk.skipped``'s ``reason``).
SkipReason = Literal["lagged", "keyframe", "resume"]


class Role(StrEnum):
    HOST = "host"  # started the world; it ends with the host
    CONTROLLER = "controller"  # joined; may send events and reset
    VIEWER = "viewer"  # joined; receives chunks only


class Outlet(Protocol):
    """How a world reaches one member's connection."""

    def post(self, messages: tuple[BaseModel, ...], binary: tuple[bytes, ...] = ()) -> None:
        """Queue messages (and their binary frames, contiguously) for sending; never blocks."""

    def detach(self) -> None:
        """Another connection resumed this member: this one no longer speaks for it."""

    @property
    def backlog(self) -> int:
        """Chunks posted and not yet written to the socket (a client that acks without reading shows here)."""

    def unsent(self) -> list[tuple[BaseModel, ...]]:
        """The socket is gone: stop writing, and hand back the notices (messages without frames) never
        written to it, in order. Chunks are not among them: a resume re-sends those from the replay buffer."""


@dataclass(eq=False)
class Member:
    """One participant of a world; outlives its connection while parked."""

    host: WorldHost
    role: Role
    resume_token: str
    media: str = "jpeg"  # what it is sent: its choice on join or resume (the host's: the world's)
    outlet: Outlet | None = None
    gone: bool = False  # left, or the world ended
    seq_base: int = 0  # wire seq = session seq + seq_base (a connection's seq never repeats)
    joined_seq: int = -1  # the world's last chunk when it joined: nothing before it is its own
    acked_seq: int = -1
    acked_at: float | None = None  # when its last new ack came (server clock): it showed that chunk's first frame
    #: the last chunk whose first frame its transport sent where it cannot be called back (a WebRTC track): to
    #: the world's preemption that chunk has begun to play, though its ack comes only as it is shown
    started_seq: int = -1
    sent_seq: int = -1
    floor: int = -1  # highest of its wire ids applied or dropped
    sid_of: dict[int, int] = field(default_factory=dict)  # pending: wire id -> session id
    wire_of: dict[int, int] = field(default_factory=dict)  # pending: session id -> wire id
    recent: OrderedDict[int, None] = field(default_factory=OrderedDict)  # wire ids accepted lately
    # seq -> its ids applied in that chunk, their latencies and their acceptance instants (server clock, s);
    # kept until acked (or told in chunk.skipped)
    applied: dict[int, tuple[list[int], list[float], list[float]]] = field(default_factory=dict)
    held: list[tuple[BaseModel, ...]] = field(default_factory=list)  # notices while parked
    skipped_from: int | None = None
    skipped_reason: SkipReason = "lagged"  # why the chunks from ``skipped_from`` on were not sent
    needs_key: bool = True  # H.264: it cannot decode a chunk that does not start with an IDR frame
    stream_init: bytes = b""  # H.264: the init segment it was sent last
    parts: bool = False  # its connection takes a chunk's frames in parts (chunk.part), as they are made
    failure_reported: tuple[int, str | None, str | None] | None = None
    reported_dropped: set[int] = field(default_factory=set)  # session ids reported with session.failed
    expiry: asyncio.Task[None] | None = None

    @property
    def can_control(self) -> bool:
        return self.role is not Role.VIEWER

    def post(self, *messages: BaseModel) -> None:
        """Send notices now, or hold them for a resume while parked."""
        if self.outlet is not None:
            self.outlet.post(messages)
        elif not self.gone:
            self.held.append(messages)


@dataclass(frozen=True, slots=True)
class _Version:
    """One chunk in one media: what each member of that media is sent."""

    frames: ChunkFrames
    payloads: tuple[bytes, ...]
    keyframe: bool = False  # H.264: the fragment starts with an IDR frame ...
    init: bytes = b""  # ... and this is its stream's init segment

    @property
    def nbytes(self) -> int:
        return sum(len(payload) for payload in self.payloads)


@dataclass(frozen=True, slots=True)
class _Made:
    """One chunk as the world made it: encoded once per media in use, shared by every member's header."""

    seq: int
    epoch: int
    chunk_index: int
    request_id: str
    versions: dict[str, _Version]  # by media
    timings: dict[str, float]
    batch_size: int
    #: the server's instants (its clock, s): tick issued, dispatched to the worker, stepped, encoded
    instants: tuple[float, float, float, float] | None = None
    #: the seq of the chunk this one replaces (a preemption undid that one after it was sent)
    supersedes: int | None = None
    #: the events it applied as the members knew them, (member, session id, wire id), and when
    #: each was accepted (None: unknown): what a preemption that undoes it gives back
    ledger: tuple[tuple[Member, int, int], ...] = ()
    accepted: tuple[tuple[int, float | None], ...] = ()
    #: its first frames went out in parts (chunk.part) to these connections, in the host's media
    parted: PartsOut | None = None

    def for_member(self, member: Member, now: float) -> tuple[ChunkMessage, tuple[bytes, ...]] | None:
        """The header and binary messages ``member`` gets, in its media (handed over at ``now``, the
        server's clock); None while it waits for a keyframe (H.264), or when the chunk was not made
        in its media (it asked just now).

        An H.264 member gets the init segment in front of the fragment when the chunk starts a
        stream it has not begun (its first, or its first after a gap, or a new encoder's)."""
        version = self.versions.get(member.media)
        if version is None:
            member.needs_key = member.needs_key or member.media == "h264"  # a gap in its stream
            return None
        frames, payloads = version.frames, version.payloads
        if frames.media == "h264":
            fresh = version.keyframe and (member.needs_key or member.stream_init != version.init)
            if member.needs_key and not fresh:
                return None
            if fresh:
                member.needs_key = False
                member.stream_init = version.init
                payloads = (version.init + payloads[0],)
            frames = frames.model_copy(
                update={
                    "sizes": [len(payloads[0])],
                    "keyframe": version.keyframe,
                    "init_bytes": len(version.init) * fresh,
                }
            )
        parted = self.parted
        if parted is not None and (member.outlet is None or not parted.took(member.outlet) or frames.media == "h264"):
            parted = None  # it was not sent the parts (another media, or another connection: a resume)
        if parted is not None:  # it has the first frames already: the rest, and how many it has
            frames = frames.model_copy(update={"sizes": frames.sizes[parted.sent :], "sent": parted.sent})
            payloads = payloads[parted.sent :]
        event_ids, latencies, accepted = member.applied.get(self.seq, ([], [], []))
        times = None
        if self.instants is not None:
            tick, dispatched, stepped, encoded = self.instants
            times = ChunkTimes(
                accepted_ms=[at * 1000.0 for at in accepted],
                tick_ms=tick * 1000.0,
                dispatched_ms=dispatched * 1000.0,
                stepped_ms=stepped * 1000.0,
                encoded_ms=encoded * 1000.0,
                sent_ms=now * 1000.0,
                part_ms=None if parted is None or not parted.arrivals else parted.arrivals[0][0] * 1000.0,
            )
        header = ChunkMessage(
            seq=self.seq + member.seq_base,
            epoch=self.epoch,
            chunk_index=self.chunk_index,
            request_id=self.request_id,
            applied_event_ids=event_ids,
            frames=frames,
            timings=self.timings,
            batch_size=self.batch_size,
            applied_latency_ms=latencies,
            times=times,
            supersedes=None if self.supersedes is None else self.supersedes + member.seq_base,
        )
        return header, payloads


def _skipped(member: Member, first: int, last: int, reason: SkipReason) -> ChunkSkipped:
    """The notice of chunks ``first``..``last`` not sent to ``member``, with its own events they applied."""
    applied: list[int] = []
    for seq in sorted(member.applied):
        if first <= seq <= last:
            applied.extend(member.applied.pop(seq)[0])
    return ChunkSkipped(
        from_seq=first + member.seq_base, to_seq=last + member.seq_base, applied_event_ids=applied, reason=reason
    )


def _backlog(member: Member) -> int:
    return 0 if member.outlet is None else member.outlet.backlog


def _forget_acked(member: Member) -> None:
    for seq in [seq for seq in member.applied if seq <= member.acked_seq]:
        del member.applied[seq]


def _token() -> str:
    return secrets.token_urlsafe(24)


def _matches(expected: str | None, offered: str) -> bool:
    return expected is not None and hmac.compare_digest(expected.encode(), offered.encode())


class WorldHost:
    """A session served to one or more connections; see the module docstring."""

    def __init__(
        self,
        session: Session[Chunk],
        *,
        backend: WorldBackend,
        config: ServerConfig,
        metrics: ServerMetrics,
        registry: WorldHosts,
        media: str,
        quality: int | None = None,
        bitrate_kbps: int | None = None,
        share_viewers: bool = False,
        share_controllers: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session = session
        self.session_id = session.session_id
        self._backend = backend
        self._config = config
        self._metrics = metrics
        self._registry = registry
        self._clock = clock
        self.media = media
        self._encoding = FrameEncoding.for_media(media, quality, bitrate_kbps)  # what the host is sent
        self._encoders: dict[str, FrameEncoder] = {}  # by media: for frames a worker did not encode
        self._extra: tuple[str, ...] = ()  # the other media in use, as the runtime was last told
        self._keyframe_asked = False  # H.264: an IDR frame is on its way (asked, not yet seen)
        self.viewer_token = _token() if share_viewers else None
        self.controller_token = _token() if share_controllers else None
        self.members: list[Member] = []
        self.closed = False
        self._seq = -1
        self._replay: deque[_Made] = deque(maxlen=config.replay_chunks)
        self._accepted_at: dict[int, float] = {}  # pending session event id -> when it was accepted
        self._next_sid = 0
        self._failure_key: tuple[int, str | None, str | None] | None = None
        self._last: _Made | None = None  # the last chunk sent, while a preemption may undo it
        self._parts: PartsOut | None = None  # the chunk in flight's parts sent so far
        self._listening = False  # the runtime hands this world its chunks' parts
        self._started_at = clock()
        self._first_chunk_sent = False
        #: The generation task and the latency policy (pacing_loop.py): lead, preemption, backpressure.
        self.pacing = PacingLoop(
            session,
            self,
            backend,
            period=backend.spec.chunk_seconds,
            lead=config.lead_for(backend.spec),
            preempt=config.preempt_for(backend.spec),
            metrics=metrics,
            chunk_clock=config.chunk_clock,
            clock=clock,
        )
        registry.add(self)

    @property
    def seq(self) -> int:
        """The last chunk's seq (-1 before the first)."""
        return self._seq

    @property
    def age(self) -> float:
        """Seconds since the world started."""
        return self._clock() - self._started_at

    # -- members -------------------------------------------------------------------

    def _add(self, role: Role, outlet: Outlet, seq_base: int, media: str | None = None) -> Member:
        member = Member(
            self,
            role,
            _token(),
            media=self.media if media is None else media,
            outlet=outlet,
            seq_base=seq_base,
            joined_seq=self._seq,
            acked_seq=self._seq,
            sent_seq=self._seq,
        )
        self.members.append(member)
        self.pacing.wake()
        self._in_use()
        return member

    def attach_host(self, outlet: Outlet, seq_base: int = 0, *, parts: bool = False) -> Member:
        """The starting connection's member; then :meth:`start` generation. ``parts``: it takes a chunk's
        frames in parts as the worker makes them, where the world's media (JPEG, raw) and model allow."""
        member = self._add(Role.HOST, outlet, seq_base)
        member.parts = parts and self.media in ("jpeg", "raw") and self.spec.frame_parts
        if member.parts and not self._listening:
            self._listening = self._backend.listen_parts(self.session_id, self._on_part)
        return member

    def _on_part(self, part: ChunkPart) -> None:
        """A part of the chunk in flight: on to the members that take parts (those that took its first)."""
        encoded = part.frames
        if self.closed or not isinstance(encoded, EncodedFrames) or not encoded.encoding.same_bytes(self._encoding):
            return  # only the world's own media, as its worker encoded it
        epoch = self.session.epoch
        out = self._parts
        if part.first == 0:  # a tick's first part (a chunk made again after a cancel starts over)
            takers = tuple(m.outlet for m in self.members if m.parts and m.outlet is not None and m.media == self.media)
            out = self._parts = PartsOut(epoch, part.chunk_index, self._seq + 1, takers) if takers else None
        if out is None or (out.epoch, out.chunk_index) != (epoch, part.chunk_index):
            return
        if not out.add(self._clock(), part.first, encoded.payloads):
            return
        version = _version(encoded)
        for member in self.members:
            if member.outlet is not None and out.took(member.outlet):
                message = ChunkPartMessage(
                    seq=out.seq + member.seq_base,
                    epoch=epoch,
                    chunk_index=part.chunk_index,
                    first=part.first,
                    frames=version.frames,
                )
                member.outlet.post((message,), version.payloads)

    def parts_out(self) -> bool:
        """Whether the chunk in flight has frames out in parts (then it is not cancelled: they may be playing)."""
        out, session = self._parts, self.session
        return out is not None and (out.epoch, out.chunk_index) == (session.epoch, session.chunk_in_flight)

    def playable(self, epoch: int, chunk_index: int, committed: float) -> float:
        """When the chunk just committed could begin to play for every connected member: ``committed``, or
        sooner when all of them were sent it in parts (:meth:`~.parts.PartsOut.playable`)."""
        out, spec = self._parts, self.spec
        if out is None or (out.epoch, out.chunk_index) != (epoch, chunk_index) or out.sent != spec.frames_per_chunk:
            return committed
        connected = [member.outlet for member in self.members if member.outlet is not None]
        if not connected or not all(out.took(outlet) for outlet in connected):
            return committed
        return min(committed, out.playable(spec.fps))

    def start(self) -> None:
        self.pacing.start()

    @property
    def spec(self) -> ModelSpec:
        """The world's model."""
        return self._backend.spec

    def grants(self, token: str, role: Role) -> bool:
        """Whether ``token`` lets its bearer join this (open) world as ``role``: a viewer's or a controller's
        share token to watch, a controller's to steer (never the host's place)."""
        viewer_ok = _matches(self.viewer_token, token) or _matches(self.controller_token, token)
        allowed = _matches(self.controller_token, token) if role is Role.CONTROLLER else viewer_ok
        return not self.closed and allowed and role is not Role.HOST

    def join(
        self, token: str, role: Role, outlet: Outlet, seq_base: int = 0, *, media: str | None = None
    ) -> Member | None:
        """A new viewer or controller, or None when ``token`` does not grant ``role``; ``media``:
        what it is sent (``None``: the world's, the host's media)."""
        if media is not None and media not in MEDIA:
            raise ValueError(f"unknown media {media!r}; expected one of {list(MEDIA)}.")
        if not self.grants(token, role):
            return None
        self._metrics.members_joined.labels(role=role.value).inc()
        member = self._add(role, outlet, seq_base, media)
        self._sync_media()
        if self._seq >= 0 and member.media == "h264":
            self.want_keyframe()  # it starts at the stream's next IDR frame (H.264)
        return member

    def find_resumable(self, token: str) -> Member | None:
        """The member whose resume token this is (every token is compared, in constant time)."""
        found = None
        for member in self.members:
            if hmac.compare_digest(member.resume_token.encode(), token.encode()) and not member.gone:
                found = member
        return None if self.closed else found

    def resume(
        self, member: Member, last_seq: int, outlet: Outlet, *, keyframe: bool = False, media: str | None = None
    ) -> int:
        """Rebind ``member`` to ``outlet``; the caller replies, then :meth:`replay` from the seq returned.

        ``last_seq`` (session seq) is clamped to what the member could have received. ``keyframe``:
        the connection has no decoder state (H.264): its stream starts again at an IDR frame, as
        a late joiner's does, gap or not. ``media``: what it is sent from now on (``None``: as
        before); another media than before starts like a late joiner's (an H.264 stream at an IDR frame).
        """
        if media is not None and media not in MEDIA:
            raise ValueError(f"unknown media {media!r}; expected one of {list(MEDIA)}.")
        if member.outlet is not None and member.outlet is not outlet:
            member.outlet.detach()
        if member.expiry is not None:
            member.expiry.cancel()
            member.expiry = None
        member.outlet = outlet
        last = max(min(last_seq, self._seq), member.joined_seq)
        member.acked_seq = max(member.acked_seq, last)
        _forget_acked(member)
        member.sent_seq = last
        member.skipped_from = None
        if keyframe:
            member.needs_key = True
        if media is not None and media != member.media:
            member.media = media
            member.needs_key = True
            member.stream_init = b""
            self._sync_media()
        self._metrics.sessions_resumed.inc()
        self._in_use()
        return last

    def buffered_after(self, member: Member, last_seq: int) -> int:
        """How many buffered chunks a resume of ``member`` from ``last_seq`` gets re-sent (H.264: from
        the first chunk it can decode: the next one when nothing is missing and it can follow the
        stream, else the first keyframe)."""
        count = 0
        contiguous = not member.needs_key
        expected = last_seq + 1
        for made in self._replay:
            if made.seq <= last_seq:
                continue
            version = made.versions.get(member.media)
            if version is None:
                contiguous = False  # not made in its media: a gap
                continue
            contiguous = contiguous and made.seq == expected
            expected = made.seq + 1
            if member.media == "h264" and not contiguous and not version.keyframe and count == 0:
                continue
            count += 1
        return count

    def replay(self, member: Member, last_seq: int) -> int:
        """Post what ``member`` missed after ``last_seq`` (session seq): chunks (or ``chunk.skipped``), then notices."""
        replayed = 0
        outlet = member.outlet
        if outlet is None:
            return 0
        missing_from = last_seq + 1
        withheld = False  # the gap holds chunks withheld for a keyframe (its reason), not only unbuffered ones
        for made in self._replay:
            if made.seq <= last_seq:
                continue
            if made.seq > missing_from:
                member.needs_key = True  # a gap: an H.264 stream can go on only from an IDR frame
            sent = made.for_member(member, self._clock())
            if sent is None:
                withheld = True
                continue  # withheld (H.264, waiting for a keyframe): reported as skipped with the gap
            if made.seq > missing_from:
                outlet.post((_skipped(member, missing_from, made.seq - 1, "keyframe" if withheld else "resume"),))
                withheld = False
                self._metrics.chunks_skipped.inc(made.seq - missing_from)
            outlet.post((sent[0],), sent[1])
            self._count_sent(made.versions[member.media])
            missing_from = made.seq + 1
            member.sent_seq = made.seq
            replayed += 1
        if missing_from <= self._seq:  # older than the replay buffer, and nothing newer buffered
            member.needs_key = True
            outlet.post((_skipped(member, missing_from, self._seq, "keyframe" if withheld else "resume"),))
            member.acked_seq = max(member.acked_seq, self._seq)
            member.sent_seq = self._seq
        if member.needs_key and self._seq >= 0 and member.media == "h264":
            self.want_keyframe()
        held, member.held = member.held, []
        for messages in held:
            outlet.post(messages)
        self._report_failure()
        self.pacing.wake()
        return replayed

    async def disconnected(self, member: Member, outlet: Outlet, *, clean: bool) -> None:
        """``member``'s connection went away: park it for the grace period, or let it go."""
        if member.outlet is not outlet or member.gone:
            return  # resumed elsewhere meanwhile
        member.outlet = None
        grace = self._config.resume_grace_s
        if grace > 0 and not clean and not self.closed:
            member.held[:0] = outlet.unsent()  # posted before the drop, never written: a resume sends them first
            member.expiry = asyncio.create_task(self._expire(member, grace), name=f"park-{self.session_id}")
            self._unattended()
            return
        await self._leave(member)

    async def _expire(self, member: Member, grace: float) -> None:
        await asyncio.sleep(grace)
        member.expiry = None
        if member.outlet is None and not member.gone:
            await self._leave(member)

    async def _leave(self, member: Member) -> None:
        if member.role is Role.HOST:
            await self.shutdown("host_left")
        else:
            self.remove(member)

    async def shutdown(self, reason: str, failure: SessionError | None = None) -> None:
        """End the world at once (the host is gone, or the server stops): cancel the tick in flight, release.

        ``failure``: why the world cannot go on anyway (e.g. the runtime lost every worker): each
        connected member not told of a failure yet gets ``session.failed`` with its code first.
        """
        await self.pacing.stop(grace=0)
        if failure is not None:
            self._report_lost(failure)
        try:
            await self._backend.close_session(self.session_id)
        except SessionStateError:
            pass  # already closed: a close in progress (session.close, session.stop) got there first
        except Exception:
            log.exception("releasing session %s (%s) failed", self.session_id, reason)
        self._finish(reason, requester=None, message_id=None)

    def _report_lost(self, failure: SessionError) -> None:
        if self.session.status is SessionStatus.FAILED:
            self._report_failure()  # its own failure (often this one), once per member
            return
        code = failure.code if isinstance(failure.code, str) else ErrorCode.TICK_FAILED
        self._metrics.session_failures.labels(code=code).inc()
        for member in self.members:
            member.post(SessionFailed(code=code, message=str(failure)))

    def remove(self, member: Member) -> None:
        """A joiner leaves (``session.close``, or its grace ran out); the world goes on."""
        member.gone = True
        member.outlet = None
        if member.expiry is not None:
            member.expiry.cancel()
            member.expiry = None
        with contextlib.suppress(ValueError):
            self.members.remove(member)
        self._sync_media()
        self.pacing.wake()
        self._unattended()

    def _in_use(self) -> None:
        """A connected member arrived, acked or sent an event: the world is in use a while more."""
        if not self.closed:
            self._backend.mark_in_use(self.session_id, self._config.evict_idle_s)

    def _unattended(self) -> None:
        """No member is connected (all parked or gone): a newcomer may evict this world now."""
        if not self.closed and all(member.outlet is None for member in self.members):
            self._backend.mark_in_use(self.session_id, 0.0)

    def wake(self) -> None:
        """Something the pacing depends on changed (a socket drained): look again."""
        self.pacing.wake()

    def ack(self, member: Member, wire_seq: int) -> None:
        self._in_use()
        seq = wire_seq - member.seq_base
        if seq > member.acked_seq:
            member.acked_seq = min(seq, self._seq)
            member.acked_at = self._clock()
            _forget_acked(member)
            if member.can_control:
                self.pacing.played(member.acked_seq, member.acked_at)
                self.pacing.wake()

    def started(self, member: Member, wire_seq: int) -> None:
        """The member's transport sent chunk ``wire_seq``'s first frame where it cannot be called back (a WebRTC
        video track): no preemption may replace that chunk any more."""
        seq = wire_seq - member.seq_base
        member.started_seq = max(member.started_seq, min(seq, self._seq))

    def hold_chunk(self, seq: int) -> None:
        """Chunk ``seq`` is being undone (a preemption, awaiting its worker): members whose transport sends frames
        on its own time (a WebRTC track) hold that chunk's, so none begins to play meanwhile; its replacement
        drops them, :meth:`release_chunk` lets them go (the undo did not happen)."""
        self._tell_outlets("hold_chunk", seq)

    def release_chunk(self, seq: int) -> None:
        self._tell_outlets("release_chunk", seq)

    def _tell_outlets(self, method: str, seq: int) -> None:
        for member in self.members:
            call = getattr(member.outlet, method, None)  # outlets that send frames themselves have it
            if call is not None and not member.gone:
                call(seq + member.seq_base)

    def lost_picture(self, member: Member) -> None:
        """``member``'s decoder cannot go on (its WebRTC peer lost a picture, or its track dropped encoded frames):
        it is sent nothing until an IDR frame, which is asked for now (H.264; other media need none)."""
        if member.media == "h264" and not member.gone:
            member.needs_key = True
            self.want_keyframe()

    # -- events ----------------------------------------------------------------------

    def _floor(self, member: Member) -> int:
        """The member's event floor: its last applied or dropped id, or its highest in the tick in flight."""
        session_floor = self.session.event_floor
        inflight = [wire for sid, wire in member.wire_of.items() if sid <= session_floor]
        return max([member.floor, *inflight])

    async def accept(self, member: Member, event: SessionEvent) -> EventAcceptance:
        """Accept ``member``'s event (wire id) as the session's next event id; errors as the session's."""
        session = self.session
        wire = event.event_id
        if session.status is SessionStatus.ACTIVE:
            if wire in member.sid_of or wire in member.recent:
                session.note_transport_refusal(EventAcceptanceStatus.DUPLICATE)
                return EventAcceptance(
                    self.session_id, wire, EventAcceptanceStatus.DUPLICATE, session.pending_event_count
                )
            floor = self._floor(member)
            if wire <= floor:
                session.note_transport_refusal("stale")
                raise StaleEventError(f"event_id {wire} is stale; this connection's event floor is {floor}.")
        sid = max(self._next_sid, session.event_floor + 1)
        try:
            acceptance = await session.accept_event(replace(event, event_id=sid))
        except InvalidEventError as error:  # the session names its own id: say the member's instead
            reason = error.__cause__ if error.__cause__ is not None else error
            raise InvalidEventError(f"event {wire} refused: {reason}") from reason
        self._in_use()
        self._next_sid = sid + 1
        self._accepted_at[sid] = self._clock()
        member.sid_of[wire] = sid
        member.wire_of[sid] = wire
        member.recent[wire] = None
        if len(member.recent) > session.max_pending_events:
            member.recent.popitem(last=False)
        await self.pacing.consider_preempt()
        return replace(acceptance, event_id=wire)

    # -- what the pacing loop asks of the world (pacing_loop.World) ----------------------

    def plays_at(self, seq: int, paced: float | None) -> float | None:
        """When chunk ``seq`` begins to play for the first connected member to play it: the pacer's
        instant ``paced``, or sooner where a member's acks say so (an ack: it showed that chunk's
        first frame; the chunks after it follow a period apart, or at once when its player ran
        dry, which leaves it no later than the period after its last ack, less the frame a player
        that fell behind catches up with). None: not known, or
        some member began it already (then it is not preempted)."""
        if paced is None:
            return None
        due = paced
        period = self._backend.spec.chunk_seconds
        catch_up = period / self._backend.spec.frames_per_chunk  # a player behind shows one frame early
        for member in self.members:
            if member.outlet is None or member.gone:
                continue
            if member.acked_seq >= seq or member.started_seq >= seq:
                return None  # on its screen already, or on its way there for good
            if member.acked_at is not None:
                due = min(due, member.acked_at + (seq - member.acked_seq) * period - catch_up)
        return due

    def replaceable(self) -> bool:
        """A chunk sent may be replaced unless an H.264 member has it (a fragment may be decoded already), or it
        went out in parts (its first frames may be playing before any ack could say so)."""
        parted = self._last is not None and self._last.parted is not None
        return "h264" not in self._media_in_use() and not parted

    def undo(self, seq: int) -> None:
        """The pacing loop undid chunk ``seq``, the last sent (a preemption): the members' ledgers,
        this world's encoders and the replay buffer go back to before it; the chunk made again
        supersedes it."""
        last, self._last = self._last, None
        if last is None or last.seq != seq:
            raise ValueError(f"chunk {seq} is not the last sent; nothing of it can be undone.")
        for media, encoder in self._encoders.items():  # this world's own encoders made it: roll them back too
            if media in last.versions:
                encoder.rollback(last.versions[media].frames.count)
        for member, sid, wire in last.ledger:  # its events are pending again, as each member knows them
            member.wire_of[sid] = wire
            member.sid_of[wire] = sid
        for sid, at in last.accepted:
            if at is not None:
                self._accepted_at[sid] = at
        for member in self.members:
            member.applied.pop(last.seq, None)
            if member.acked_seq == last.seq - 1:  # nobody plays it now: it holds no one's generation back
                member.acked_seq = last.seq
        with contextlib.suppress(ValueError):
            self._replay.remove(last)

    def forward_dropped(self) -> None:
        """Tell each member of its discarded events, except those already reported with ``session.failed``."""
        for record in self.session.take_dropped():
            for sid in record.event_ids:
                self._accepted_at.pop(sid, None)
            for member in self.members:
                wires = []
                for sid in record.event_ids:
                    wire = member.wire_of.pop(sid, None)
                    if wire is None:
                        continue
                    member.sid_of.pop(wire, None)
                    member.floor = max(member.floor, wire)
                    if sid in member.reported_dropped:
                        member.reported_dropped.discard(sid)
                    else:
                        wires.append(wire)
                if wires:
                    detail = record.detail
                    if record.superseded_by is not None:  # name the successor in this member's own ids
                        successor = member.wire_of.get(record.superseded_by)
                        detail = (
                            "superseded by another controller's event"
                            if successor is None
                            else f"superseded by event {successor}"
                        )
                    member.post(InputDropped(event_ids=wires, reason=record.reason.value, detail=detail))

    def _report_failure(self, *, requester: Member | None = None, message_id: str | None = None) -> None:
        """Send ``session.failed`` once per failure to each member, with its events the world can no longer apply.

        The failed session keeps its pending events until a reset or close discards them
        (the seed's behaviour), but it can never apply them: they are reported dropped
        (``failed``) right behind ``session.failed``, in one contiguous send, and not again
        when the reset or close discards them. Called by the generator when a tick fails,
        by any reply that refers to the failure (so that reply never overtakes it), and on
        resume (a member parked meanwhile hears of it then).
        """
        session = self.session
        failure = session.failure
        key = (session.epoch, session.failure_code, failure)
        if session.status is not SessionStatus.FAILED or failure is None:
            return
        code = session.failure_code or ErrorCode.TICK_FAILED
        if key != self._failure_key:
            self._failure_key = key
            self._metrics.session_failures.labels(code=code).inc()
        pending = session.pending_event_ids
        for sid in pending:
            self._accepted_at.pop(sid, None)
        for member in self.members:
            if member.failure_reported == key or member.outlet is None:
                continue
            member.failure_reported = key
            messages: list[BaseModel] = [
                SessionFailed(id=message_id if member is requester else None, code=code, message=failure)
            ]
            mine = [sid for sid in pending if sid in member.wire_of]
            if mine:
                member.reported_dropped.update(mine)
                messages.append(
                    InputDropped(event_ids=[member.wire_of[sid] for sid in mine], reason="failed", detail=failure)
                )
            member.outlet.post(tuple(messages))

    def report_failure(self, requester: Member | None = None, message_id: str | None = None) -> None:
        self._report_failure(requester=requester, message_id=message_id)

    async def reset(self) -> None:
        """Reset the world (a controller asked); raises as ``Session.reset`` does."""
        await self.session.reset()
        for encoder in self._encoders.values():
            encoder.keyframe()  # the new epoch starts with an IDR frame, as a worker's encoder does
        for member in self.members:
            if member.outlet is not None:  # nothing of the old epoch counts as lag any more
                member.acked_seq = member.sent_seq = self._seq
        self.pacing.wake()
        self.forward_dropped()

    # -- the world's end -------------------------------------------------------------

    async def close(self, reason: str, *, requester: Member, message_id: str | None) -> Exception | None:
        """Stop after the chunk in flight, release the session, tell everyone; the error if cleanup failed."""
        self.pacing.stopping = True
        self.pacing.wake()
        try:
            # Waits for the tick in flight; the pacing loop then sends that last chunk and stops.
            await self._backend.close_session(self.session_id)
        except Exception as error:
            return error
        await self.pacing.stop(grace=self._backend.spec.chunk_seconds * 4 + 1.0)
        self._finish(reason, requester=requester, message_id=message_id)
        return None

    def _finish(self, reason: str, *, requester: Member | None, message_id: str | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._registry.remove(self)
        self._metrics.sessions_active.dec()
        self.forward_dropped()
        for member in list(self.members):
            if member is requester:
                member.post(SessionClosed(id=message_id, reason=reason))
            else:
                member.post(SessionClosed(reason="host_left" if reason != "shutdown" else reason))
            member.gone = True
            if member.expiry is not None:
                member.expiry.cancel()
                member.expiry = None
        self.members.clear()

    # -- generation ----------------------------------------------------------------

    def _drivers(self) -> Iterator[Member]:
        return (m for m in self.members if m.can_control and m.outlet is not None)

    def held_back(self) -> bool:
        """Backpressure: nobody controlling is connected, or the slowest of them lags ``max_lag_chunks``.

        Lag is un-acked chunks, or chunks not yet written to its socket, whichever is more.
        """
        lag = max(
            (max(self._seq - member.acked_seq, _backlog(member)) for member in self._drivers()),
            default=None,
        )
        return lag is None or lag >= self._config.max_lag_chunks

    async def send(self, chunk: Chunk, epoch: int, *, started: float, committed: float, supersedes: int | None) -> int:
        """Hand a committed chunk to every member (the pacing loop made it); its seq."""
        tick_seconds = committed - started
        metadata = chunk.metadata
        encoded, encode_s = await self._encoded(chunk)
        # Key-to-photon's server part, as consecutive instants: the engine's durations placed
        # back from the commit (its round trip ends there; a worker's encoding ends it).
        stepped = committed - chunk.encode_s
        dispatched = min(stepped, committed - chunk.roundtrip_s)
        dispatched = max(started, dispatched)
        stepped = max(dispatched, stepped)
        encoded_at = max(committed, self._clock())
        if "h264" in encoded and encoded["h264"].keyframe:
            self._keyframe_asked = False
        self._seq += 1
        seq = self._seq
        out, self._parts = self._parts, None
        parted = None
        if out is not None and (out.epoch, out.chunk_index, out.seq) == (epoch, metadata.chunk_index, seq):
            mine = encoded.get(self.media)
            if mine is not None and mine.payloads[: out.sent] == tuple(out.payloads):
                parted = out  # else (a chunk made again after its parts went): sent whole, as it is
        # each applied event's acceptance (unknown: taken as the tick's, 0 ms of latency as before)
        known = {sid: self._accepted_at.pop(sid, None) for sid in metadata.applied_event_ids}
        accepted_at = {sid: started if at is None else at for sid, at in known.items()}
        ledger: list[tuple[Member, int, int]] = []
        for member in self.members:
            wires, latencies, accepted = [], [], []
            for sid in metadata.applied_event_ids:
                wire = member.wire_of.pop(sid, None)
                if wire is not None:
                    ledger.append((member, sid, wire))
                    member.sid_of.pop(wire, None)
                    member.floor = max(member.floor, wire)
                    wires.append(wire)
                    at = known[sid]
                    latencies.append(0.0 if at is None else (committed - at) * 1000.0)
                    accepted.append(accepted_at[sid])
            if wires:
                member.applied[seq] = (wires, latencies, accepted)
        self._metrics.chunk_latency.observe(tick_seconds)
        for at in accepted_at.values():
            self._metrics.k2p_wait_tick.observe(max(0.0, started - at))
        self._metrics.k2p_queue.observe(dispatched - started)
        self._metrics.k2p_step.observe(stepped - dispatched)
        self._metrics.k2p_encode.observe(encoded_at - stepped)
        made = _Made(
            seq=seq,
            epoch=epoch,
            chunk_index=metadata.chunk_index,
            request_id=metadata.request_id,
            versions={media: _version(frames) for media, frames in encoded.items()},
            timings={
                "tick_ms": tick_seconds * 1000.0,
                "queued_ms": chunk.queued_s * 1000.0,
                "model_ms": chunk.compute_s * 1000.0,
                "engine_ms": chunk.roundtrip_s * 1000.0,
                "encode_ms": encode_s * 1000.0,
            },
            batch_size=chunk.batch_size,
            instants=(started, dispatched, stepped, encoded_at),
            supersedes=supersedes,
            ledger=tuple(ledger),
            accepted=tuple(known.items()),
            parted=parted,
        )
        self._last = made
        self._replay.append(made)
        for member in self.members:
            self._deliver(member, made)
        if not self._first_chunk_sent:
            self._first_chunk_sent = True
            self._metrics.time_to_first_chunk.observe(self._clock() - self._started_at)
        return seq

    def _media_in_use(self) -> list[str]:
        """The media members use (parked ones too: they may resume), the host's first."""
        used = [self.media]
        for member in self.members:
            if not member.gone and member.media not in used:
                used.append(member.media)
        return used

    def _wanted(self, media: str) -> FrameEncoding:
        """How ``media`` is encoded here: the host's as it asked, another at its default quality."""
        return self._encoding if media == self.media else FrameEncoding.for_media(media)

    def _sync_media(self) -> None:
        """Members came or went: tell the runtime which other media to encode, and drop this
        world's own encoders of media no member uses any more."""
        used = self._media_in_use()
        for media in [media for media in self._encoders if media not in used]:
            del self._encoders[media]  # an encode in flight may hold it still; freed with its last reference
        extra = tuple(used[1:])
        if extra == self._extra or self.closed:
            return
        self._extra = extra
        try:
            self._backend.set_extra_encodings(self.session_id, tuple(self._wanted(media) for media in extra))
        except Exception:
            log.exception("asking for media %s for session %s failed", list(extra), self.session_id)

    async def _encoded(self, chunk: Chunk) -> tuple[dict[str, EncodedFrames], float]:
        """The chunk's frames in each media in use, and the time spent encoding them: a worker's
        payloads as they are when they match (its time, for its batch), else encoded here in a
        thread (frames a worker encoded otherwise are decoded first). A media a member asked
        for just now that the worker did not make yet is made here only from raw payloads
        (exact); else it is left out and its members skip the chunk (the worker makes it from
        its next chunk on: a chunk or two)."""
        frames = chunk.frames
        made = frames.versions() if isinstance(frames, EncodedFrames) else {}
        counted = list(made)  # the chunk's encodings, counted together once all are made (one scrape sees all or none)
        encoded: dict[str, EncodedFrames] = {}
        arrays = frames if not isinstance(frames, EncodedFrames) else None
        spent = 0.0
        for media in self._media_in_use():
            wanted = self._wanted(media)
            ready = made.get(media)
            if ready is not None and ready.encoding.same_bytes(wanted):
                encoded[media] = ready
                # The worker makes this media now: an encoder of this world's that made it until the worker
                # began is not its stream any more (a keyframe asked of it would never come).
                self._encoders.pop(media, None)
                continue
            began = time.perf_counter()
            if arrays is None:
                # The host's media from other payloads; another media only from exact (raw) ones, else
                # its members skip this chunk (the worker makes it from its next chunk on).
                source = made.get("raw") if media != self.media else next(iter(made.values()))
                if source is None:
                    continue
                arrays = await asyncio.to_thread(decode_frames, source)
            encoder = self._encoders.get(media)
            if encoder is None or not encoder.encoding.same_bytes(wanted):
                spec = self._backend.spec
                encoder = self._encoders[media] = FrameEncoder(wanted, spec.width, spec.height, spec.fps)
            encoded[media] = await asyncio.to_thread(encoder.encode, arrays)
            counted.append(media)
            spent += time.perf_counter() - began
        for media in counted:
            self._metrics.chunk_encodings.labels(media=media).inc()
        return encoded, (chunk.encode_s if made else 0.0) + spent

    def want_keyframe(self) -> None:
        """H.264: a member waits for an IDR frame, or would skip ahead to one (its WebRTC track fell behind, and is
        sent the stream meanwhile); ask for one unless one is already on its way."""
        if "h264" not in self._media_in_use() or self._keyframe_asked:
            return
        encoder = self._encoders.get("h264")
        if encoder is not None:  # this world encodes its own H.264 stream
            encoder.keyframe()
            self._keyframe_asked = True
            return
        try:
            self._keyframe_asked = self._backend.request_keyframe(self.session_id)
        except Exception:
            log.exception("asking for a keyframe for session %s failed", self.session_id)

    def _count_sent(self, version: _Version) -> None:
        self._metrics.frames_sent.inc(version.frames.count)
        self._metrics.media_bytes_sent.labels(media=version.frames.media).inc(version.nbytes)

    def _deliver(self, member: Member, made: _Made) -> None:
        """Post a chunk to a connected member; a viewer ``max_lag_chunks`` behind skips it instead."""
        outlet = member.outlet
        if outlet is None:
            return  # parked: the replay buffer keeps it for a resume
        lag = max(member.sent_seq - member.acked_seq, outlet.backlog)
        if member.role is Role.VIEWER and lag >= self._config.max_lag_chunks:
            self._skip(member, made, "lagged")
            member.needs_key = True  # H.264: the chunk after the gap cannot be decoded
            return
        sent = made.for_member(member, self._clock())
        if sent is None:  # H.264: it must start at an IDR frame (one is asked for); or not made in its media yet
            self._skip(member, made, "keyframe")
            member.acked_seq = max(member.acked_seq, made.seq)  # a withheld chunk never holds generation back
            member.sent_seq = made.seq
            if member.media == "h264":
                self.want_keyframe()
            return
        if member.skipped_from is not None:
            outlet.post((_skipped(member, member.skipped_from, made.seq - 1, member.skipped_reason),))
            member.skipped_from = None
        outlet.post((sent[0],), sent[1])
        member.sent_seq = made.seq
        self._count_sent(made.versions[member.media])

    def _skip(self, member: Member, made: _Made, reason: SkipReason) -> None:
        if member.skipped_from is None:
            member.skipped_from, member.skipped_reason = made.seq, reason
        self._metrics.chunks_skipped.inc()


def _version(encoded: EncodedFrames) -> _Version:
    """One media's payloads of a chunk, with the header fields every member of that media shares."""
    frames = ChunkFrames(
        count=encoded.count,
        media=wire_media(encoded.encoding.media),
        width=encoded.width,
        height=encoded.height,
        sizes=[len(payload) for payload in encoded.payloads],
    )
    return _Version(frames, encoded.payloads, encoded.keyframe, encoded.init)


def wire_media(media: str) -> Literal["jpeg", "raw", "h264"]:
    """``media`` as the wire's literal type."""
    if media == "jpeg":
        return "jpeg"
    if media == "raw":
        return "raw"
    if media == "h264":
        return "h264"
    raise ValueError(f"unknown media {media!r}.")


class WorldHosts:
    """The server's worlds by session id; ``on_end`` hears how long each world that ended ran."""

    def __init__(self, directory: Directory | None = None) -> None:
        self._hosts: dict[str, WorldHost] = {}
        self.on_end: Callable[[float], None] | None = None
        #: The service's session directory (several front-ends), told of each world as it starts and ends.
        self.directory = directory

    def add(self, host: WorldHost) -> None:
        self._hosts[host.session_id] = host
        if self.directory is not None:
            self.directory.published(host.session_id)

    def remove(self, host: WorldHost) -> None:
        if self._hosts.get(host.session_id) is host:
            del self._hosts[host.session_id]
            if self.directory is not None:
                self.directory.withdrawn(host.session_id)
            if self.on_end is not None:
                self.on_end(host.age)

    def get(self, session_id: str) -> WorldHost | None:
        return self._hosts.get(session_id)

    def session_ids(self) -> tuple[str, ...]:
        return tuple(self._hosts)

    def __len__(self) -> int:
        return len(self._hosts)

    async def shutdown(self, failure: SessionError | None = None) -> None:
        """The server stops: end every world still open (parked ones included), each member told
        ``session.closed {reason: "shutdown"}``; ``failure``: why they could not go on anyway,
        sent to each as ``session.failed`` first."""
        await asyncio.gather(*(host.shutdown("shutdown", failure) for host in list(self._hosts.values())))
