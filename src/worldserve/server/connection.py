"""One WebSocket connection: parsing client messages, replies, and writing in order.

Owns, per connection: parsing and answering client messages (typed errors, never an
exception out of the loop), its rate limit, its one writer task (everything this
connection sends goes through one queue, in order, so a world can post to it without
waiting: a slow reader never holds up the world or other members), and which member
of which world (:class:`~worldserve.server.host.WorldHost`) it speaks for: it starts
one (``session.start``; with ``queue``, it waits in the front-end's
:class:`~worldserve.server.waiting.WaitingRoom` meanwhile, reading on), joins one
(``session.join``) or resumes one (``session.resume``). On disconnect it tells its
world whether the close was clean (the world then parks the member for a resume, or
lets it go), or leaves the line.

Must not know: HTTP routing, how the runtime reaches its workers, what controls mean,
how generation is paced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.websockets import WebSocketDisconnect

from worldserve.errors import AdmissionRefusedError, ErrorCode
from worldserve.media import FrameEncoding
from worldserve.protocol import ControlInput, transition_chunks_control
from worldserve.runtime.chunk import Chunk
from worldserve.server.config import ServerConfig
from worldserve.server.encoding import decode_references, decode_start_image
from worldserve.server.host import Member, Role, WorldBackend, WorldHost, WorldHosts, wire_media
from worldserve.server.limits import TokenBucket
from worldserve.server.messages import (
    ChunkAck,
    ChunkCancel,
    ChunkCancelled,
    ClientMessageError,
    ErrorMessage,
    InputAccepted,
    InputEvent,
    Ping,
    Pong,
    SessionClose,
    SessionClosed,
    SessionFailed,
    SessionJoin,
    SessionJoined,
    SessionMoved,
    SessionQueued,
    SessionReset,
    SessionResetDone,
    SessionResume,
    SessionResumed,
    SessionStart,
    SessionStarted,
    ShareTokens,
    parse_client_message,
    wire_json,
)
from worldserve.server.metrics import ServerMetrics
from worldserve.server.waiting import Position, StartMoved, WaitingRoom, waiting_room
from worldserve.session import (
    EventAcceptanceStatus,
    Session,
    SessionError,
    SessionEvent,
    SessionStateError,
    SessionStatus,
)

__all__ = ["Connection", "Socket", "WorldBackend"]

log = logging.getLogger("worldserve.server")

#: Close codes of a clean, intended close: the member leaves at once (others park it for a resume).
_CLEAN_CLOSE = frozenset({1000, 1001})


def _wire_code(error: SessionError, fallback: ErrorCode) -> ErrorCode:
    """The error's own code where it is one of the vocabulary's, else ``fallback``."""
    try:
        return ErrorCode(error.code)
    except ValueError:
        return fallback


_Item = tuple[tuple[BaseModel, ...], tuple[bytes, ...], "asyncio.Future[None] | None"]


class Socket(Protocol):
    """What a connection reads and writes: Starlette's ``WebSocket``, or a WebRTC DataChannel and its video
    track (``webrtc_session.DataChannelSocket``). ``receive`` gives ASGI WebSocket events
    (``websocket.receive`` with ``text``, ``websocket.disconnect`` with ``code``); a transport that drops a message
    over ``max_start_bytes`` before it is whole says ``websocket.receive`` with ``oversize`` (its bytes)."""

    async def receive(self) -> Mapping[str, Any]: ...

    async def send_text(self, data: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class Connection:
    """Serves one WebSocket until it closes; speaks for at most one member of one world at a time."""

    def __init__(
        self,
        websocket: Socket,
        backend: WorldBackend,
        config: ServerConfig,
        metrics: ServerMetrics,
        hosts: WorldHosts | None = None,
        room: WaitingRoom[Session[Chunk]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ws = websocket
        self._backend = backend
        self._config = config
        self._metrics = metrics
        self._hosts = hosts if hosts is not None else WorldHosts()
        self._room = room if room is not None else waiting_room(backend, config, self._hosts)
        self._queued: asyncio.Task[None] | None = None  # session.start waiting in line
        self._clock = clock
        self._events = TokenBucket(config.event_rate, config.event_burst, clock)
        self._member: Member | None = None
        self._outbox: asyncio.Queue[_Item] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._clean_close = False
        self._closing: asyncio.Task[None] | None = None
        self._seq_base = 0  # the next chunk seq this connection may use: seq never repeats on a connection
        self._backlog = 0
        self._writing: tuple[BaseModel, ...] = ()  # what the writer has yet to write of the item it holds

    # -- the world's side (Outlet) -------------------------------------------------

    def post(self, messages: tuple[BaseModel, ...], binary: tuple[bytes, ...] = ()) -> None:
        """Queue messages and their binary frames; the writer sends them contiguously, in order."""
        if binary:
            self._backlog += 1
        self._outbox.put_nowait((messages, binary, None))

    @property
    def backlog(self) -> int:
        """Chunks queued and not yet written."""
        return self._backlog

    def unsent(self) -> list[tuple[BaseModel, ...]]:
        """Stop the writer; return the notices it never wrote (see :meth:`Outlet.unsent`)."""
        if self._writer is not None:
            self._writer.cancel()
        notices = [self._writing] if self._writing else []
        self._writing = ()
        while not self._outbox.empty():
            messages, binary, done = self._outbox.get_nowait()
            if done is not None and not done.done():
                done.set_result(None)
            if messages and not binary:
                notices.append(messages)
        return notices

    def detach(self) -> None:
        """Another connection resumed our member: stop speaking for it and close this socket."""
        self._forget()
        self._closing = asyncio.create_task(self._close_socket(4000, "resumed elsewhere"))

    async def close_for_shutdown(self, flush_timeout: float) -> None:
        """The server stops (its worlds have ended, their ``session.closed`` queued): write what is
        queued, within ``flush_timeout`` seconds, then close the socket with 1001 (going away)."""
        self._clean_close = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(flush_timeout):
                await self._flush()
        with contextlib.suppress(Exception):
            await self._ws.close(code=1001, reason="server shutting down")

    async def _close_socket(self, code: int, reason: str) -> None:
        await self._flush()
        with contextlib.suppress(Exception):
            await self._ws.close(code=code, reason=reason)

    # -- sending -------------------------------------------------------------------

    async def _write(self) -> None:
        while True:
            messages, binary, done = await self._outbox.get()
            try:
                if not binary:
                    self._writing = messages
                for index, message in enumerate(messages):
                    await self._ws.send_text(wire_json(message))
                    if not binary:
                        self._writing = messages[index + 1 :]
                for payload in binary:
                    await self._ws.send_bytes(payload)
                if binary:
                    self._backlog -= 1
                    if self._member is not None and self._member.can_control:
                        self._member.host.wake()
            except Exception:
                if done is not None and not done.done():
                    done.set_result(None)
                return  # the socket is gone; the reader sees the disconnect
            if done is not None and not done.done():
                done.set_result(None)

    async def _flush(self) -> None:
        """Wait until everything queued so far is written (or the socket is gone)."""
        writer = self._writer
        if writer is None or writer.done():
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outbox.put_nowait(((), (), done))
        await asyncio.wait({done, writer}, return_when=asyncio.FIRST_COMPLETED)

    async def _send(self, message: BaseModel, *binary: bytes) -> None:
        """Send one reply (after everything queued before it) and wait until it is written."""
        self.post((message,), binary)
        await self._flush()

    async def _error(
        self,
        code: ErrorCode,
        message: str,
        *,
        message_id: str | None,
        event_id: int | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        self._metrics.error_replies(code).inc()
        await self._send(
            ErrorMessage(id=message_id, code=code, message=message, event_id=event_id, retry_after_ms=retry_after_ms)
        )

    # -- the connection's life -----------------------------------------------------

    async def run(self) -> None:
        """Read and answer messages until the client goes away or idles out."""
        self._writer = asyncio.create_task(self._write(), name="connection-writer")
        try:
            while True:
                try:
                    async with asyncio.timeout(self._config.idle_timeout):
                        message = await self._ws.receive()
                except TimeoutError:
                    if self._queued is not None:
                        continue  # waiting in line is not idling: the queue's own timeout bounds it
                    await self._end("idle_timeout", message_id=None)
                    await self._flush()
                    self._clean_close = True
                    await self._ws.close(code=1000, reason="idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    self._clean_close = message.get("code", 1000) in _CLEAN_CLOSE
                    return
                await self._handle_frame(message)
        except WebSocketDisconnect as disconnect:
            self._clean_close = disconnect.code in _CLEAN_CLOSE
            return
        finally:
            await self._release()

    def _current(self) -> Member | None:
        member = self._member
        if member is not None and member.gone:
            self._forget()
            member = None
        return member

    def _forget(self) -> None:
        """Stop speaking for our member; a later session's seq goes on after its last."""
        member, self._member = self._member, None
        if member is not None:
            self._seq_base = max(self._seq_base, member.seq_base + member.sent_seq + 1)

    async def _handle_frame(self, message: Mapping[str, Any]) -> None:
        text = message.get("text")
        if "oversize" in message:  # a transport that dropped a message over every limit as it came (WebRTC's pieces)
            limit = self._config.max_start_bytes
            await self._error(ErrorCode.MESSAGE_TOO_LARGE, f"message exceeds {limit} bytes.", message_id=None)
            return
        if text is None:
            await self._error(
                ErrorCode.INVALID_MESSAGE,
                "binary messages are not accepted; send JSON text (over WebRTC, a long message's binary pieces "
                "end with an empty text message).",
                message_id=None,
            )
            return
        # A session's start may carry images (up to max_start_bytes) while the connection has none;
        # every other message, and a start on a connection that has a session, is held to max_message_bytes.
        starting = self._current() is None and self._queued is None
        limit = self._config.max_start_bytes if starting else self._config.max_message_bytes
        size = len(text) if len(text) > limit else len(text.encode())
        largest = self._config.max_message_bytes
        too_large = f"message exceeds {limit} bytes." if size > limit else None
        if too_large is None and size > largest and _message_type(text) != "session.start":
            too_large = f"message exceeds {largest} bytes (only session.start may be larger, up to {limit})."
        if too_large is not None:
            await self._error(ErrorCode.MESSAGE_TOO_LARGE, too_large, message_id=None)
            return
        try:
            parsed = parse_client_message(text)
        except ClientMessageError as error:
            await self._error(error.code, str(error), message_id=error.message_id)
            return
        handlers: dict[type[BaseModel], Callable[[Any], Awaitable[None]]] = {
            SessionStart: self._on_start,
            InputEvent: self._on_event,
            SessionReset: self._on_reset,
            SessionClose: self._on_close,
            Ping: self._on_ping,
            ChunkAck: self._on_ack,
            ChunkCancel: self._on_cancel,
            SessionResume: self._on_resume,
            SessionJoin: self._on_join,
        }
        try:
            await handlers[type(parsed)](parsed)
        except (WebSocketDisconnect, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("internal error while handling %s", type(parsed).__name__)
            await self._error(ErrorCode.INTERNAL_ERROR, "internal server error.", message_id=parsed.id)

    async def _release(self) -> None:
        """On disconnect: the world parks our member for a resume, or lets it go (a clean close);
        a start waiting in line leaves it."""
        queued = self._queued
        if queued is not None:
            queued.cancel()
            with contextlib.suppress(BaseException):
                await queued
        member = self._current()
        self._member = None
        try:
            if member is not None:
                try:
                    await member.host.disconnected(member, self, clean=self._clean_close)
                except Exception:
                    log.exception("releasing session %s after disconnect failed", member.host.session_id)
        finally:
            if self._writer is not None:
                self._writer.cancel()
                with contextlib.suppress(BaseException):
                    await self._writer

    # -- client messages -----------------------------------------------------------

    async def _has_session(self, message_id: str | None) -> bool:
        """Refuse (``session_exists``) a start, join or resume on a connection that has a session or waits for one."""
        if self._current() is None and self._queued is None:
            return False
        detail = "is waiting in line for a session" if self._queued is not None else "already has a session"
        await self._error(ErrorCode.SESSION_EXISTS, f"this connection {detail}.", message_id=message_id)
        return True

    async def _on_start(self, message: SessionStart) -> None:
        if await self._has_session(message.id):
            return
        spec = self._backend.spec
        if message.model is not None and message.model != spec.name:
            await self._error(
                ErrorCode.UNKNOWN_MODEL,
                f"this server runs model {spec.name!r}, not {message.model!r}.",
                message_id=message.id,
            )
            return
        image = None
        if message.image is None and spec.requires_image:
            await self._error(
                ErrorCode.INVALID_IMAGE,
                f"model {spec.name!r} starts a world from a start image: send `image` ({spec.width}x{spec.height}).",
                message_id=message.id,
            )
            return
        references: tuple[bytes, ...] = ()
        try:
            if message.image is not None:
                image = await asyncio.to_thread(decode_start_image, message.image, spec.height, spec.width)
            if message.references:
                references = await asyncio.to_thread(decode_references, message.references, spec)
        except ValueError as error:
            await self._error(ErrorCode.INVALID_IMAGE, str(error), message_id=message.id)
            return
        options = message.options
        try:
            encoding = FrameEncoding.for_media(options.media, options.quality, options.bitrate_kbps)
        except ValueError as error:  # a media the server does not know
            await self._error(ErrorCode.INVALID_MESSAGE, str(error), message_id=message.id)
            return

        async def create() -> Session[Chunk]:
            session = await self._backend.create_session(
                prompt=message.prompt, seed=message.seed, image=image, encoding=encoding, references=references
            )
            # In use from birth: the next start (the line's next) must not evict it before its host arrives.
            self._backend.mark_in_use(session.session_id, self._config.evict_idle_s)
            return session

        if message.queue or message.reservation is not None:  # wait in line if need be, reading on meanwhile
            self._queued = asyncio.create_task(self._start_in_line(message, encoding, create), name="waiting-in-line")
            return
        try:
            self._room.refuse_if_waiting()
            session = await create()
        except (SessionError, ValueError) as error:
            await self._start_refused(error, message.id)
            return
        await self._begin(message, session, encoding)

    async def _start_in_line(
        self, message: SessionStart, encoding: FrameEncoding, create: Callable[[], Awaitable[Session[Chunk]]]
    ) -> None:
        def notify(where: Position) -> None:
            self.post((SessionQueued(id=message.id, position=where.position, ahead=where.ahead, eta_s=where.eta_s),))

        try:
            session = await self._room.admit(create, notify, message.reservation)
        except StartMoved as moved:  # the service's line placed it on another front-end: the client goes there
            self._queued = None
            self._metrics.sessions_moved.inc()
            self.post((SessionMoved(id=message.id, url=moved.url, reservation=moved.reservation),))
            return
        except (SessionError, ValueError) as error:
            self._queued = None
            await self._start_refused(error, message.id)
            return
        except Exception:
            self._queued = None
            log.exception("internal error while waiting in line")
            await self._error(ErrorCode.INTERNAL_ERROR, "internal server error.", message_id=message.id)
            return
        finally:
            self._queued = None
        await self._begin(message, session, encoding)

    async def _start_refused(self, error: SessionError | ValueError, message_id: str | None) -> None:
        if isinstance(error, SessionError):
            retry = error.retry_after_s if isinstance(error, AdmissionRefusedError) else None
            await self._error(
                _wire_code(error, ErrorCode.INTERNAL_ERROR),
                str(error),
                message_id=message_id,
                retry_after_ms=None if retry is None else round(retry * 1000),
            )
        else:  # options the model cannot take
            await self._error(ErrorCode.INVALID_MESSAGE, str(error), message_id=message_id)

    async def _begin(self, message: SessionStart, session: Session[Chunk], encoding: FrameEncoding) -> None:
        """The start was admitted: the world and its host member, then ``session.started``."""
        spec = self._backend.spec
        host = WorldHost(
            session,
            backend=self._backend,
            config=self._config,
            metrics=self._metrics,
            registry=self._hosts,
            media=encoding.media,
            quality=encoding.quality,
            bitrate_kbps=encoding.bitrate_kbps,
            share_viewers=message.share.viewers,
            share_controllers=message.share.controllers,
            clock=self._clock,
        )
        member = self._member = host.attach_host(self, self._seq_base, parts=message.options.parts)
        self._metrics.sessions_started.inc()
        self._metrics.sessions_active.inc()
        share = None
        if host.viewer_token is not None or host.controller_token is not None:
            share = ShareTokens(viewer=host.viewer_token, controller=host.controller_token)
        await self._send(
            SessionStarted(
                id=message.id,
                session_id=session.session_id,
                model=spec.to_dict(),
                media=wire_media(host.media),
                max_pending_events=session.max_pending_events,
                max_lag_chunks=self._config.max_lag_chunks,
                lead_chunks=self._config.lead_chunks,
                resume_token=member.resume_token if self._config.resume_grace_s > 0 else None,
                resume_grace_s=self._config.resume_grace_s if self._config.resume_grace_s > 0 else None,
                share=share,
                url=self._config.world_url,
            )
        )
        host.start()

    async def _on_join(self, message: SessionJoin) -> None:
        if await self._has_session(message.id):
            return
        host = self._hosts.get(message.session_id)
        if host is None and await self._moved(message.session_id, message.id):
            return
        role = Role(message.role)
        member = None if host is None else host.join(message.token, role, self, self._seq_base, media=message.media)
        if host is None or member is None:
            await self._error(
                ErrorCode.JOIN_REFUSED, "cannot join: unknown session or wrong token.", message_id=message.id
            )
            return
        self._member = member
        await self._send(
            SessionJoined(
                id=message.id,
                session_id=host.session_id,
                role="controller" if role is Role.CONTROLLER else "viewer",
                model=self._backend.spec.to_dict(),
                media=wire_media(member.media),
                max_pending_events=host.session.max_pending_events,
                max_lag_chunks=self._config.max_lag_chunks,
                lead_chunks=self._config.lead_chunks,
                seq=host.seq + member.seq_base,
                resume_token=member.resume_token if self._config.resume_grace_s > 0 else None,
                resume_grace_s=self._config.resume_grace_s if self._config.resume_grace_s > 0 else None,
            )
        )
        host.report_failure(member)

    async def _moved(self, session_id: str, message_id: str | None) -> bool:
        """A world that does not live here but on another front-end of the service (the session
        directory says which): tell the client where (``session.moved``); True if so."""
        directory = self._hosts.directory
        url = None if directory is None else await directory.find(session_id)
        if url is None:
            return False
        self._metrics.sessions_moved.inc()
        await self._send(SessionMoved(id=message_id, session_id=session_id, url=url))
        return True

    async def _on_resume(self, message: SessionResume) -> None:
        if await self._has_session(message.id):
            return
        host = self._hosts.get(message.session_id)
        if host is None and await self._moved(message.session_id, message.id):
            return
        member = None
        if host is not None and self._config.resume_grace_s > 0:
            member = host.find_resumable(message.token)
        if host is None or member is None:
            await self._error(
                ErrorCode.RESUME_REFUSED,
                "cannot resume: unknown or expired session, or wrong token.",
                message_id=message.id,
            )
            return
        last_seq = host.resume(
            member, message.last_seq - member.seq_base, self, keyframe=message.keyframe, media=message.media
        )
        self._member = member
        self.post(
            (
                SessionResumed(
                    id=message.id,
                    session_id=host.session_id,
                    role=member.role.value,
                    model=self._backend.spec.to_dict(),
                    media=wire_media(member.media),
                    max_pending_events=host.session.max_pending_events,
                    max_lag_chunks=self._config.max_lag_chunks,
                    lead_chunks=self._config.lead_chunks,
                    seq=host.seq + member.seq_base,
                    replayed=host.buffered_after(member, last_seq),
                ),
            )
        )
        host.replay(member, last_seq)
        await self._flush()

    async def _on_event(self, message: InputEvent) -> None:
        member = self._current()
        if member is None:
            await self._error(
                ErrorCode.NO_SESSION, "send session.start first.", message_id=message.id, event_id=message.event_id
            )
            return
        if not member.can_control:
            await self._error(
                ErrorCode.NOT_CONTROLLER,
                "viewers cannot send events.",
                message_id=message.id,
                event_id=message.event_id,
            )
            return
        if not self._events.take():
            await self._error(
                ErrorCode.RATE_LIMITED,
                f"more than {self._config.event_rate:g} events/s; slow down.",
                message_id=message.id,
                event_id=message.event_id,
            )
            return
        try:
            controls = [ControlInput(c.track, c.schema_, c.data) for c in message.controls]
            if message.transition_chunks is not None:
                if message.prompt is None:
                    raise ValueError(
                        "transition_chunks goes with the prompt change it blends; this event has no prompt."
                    )
                controls.append(transition_chunks_control(message.transition_chunks))
            event = SessionEvent(event_id=message.event_id, prompt=message.prompt, controls=tuple(controls))
        except ValueError as error:
            await self._error(ErrorCode.INVALID_MESSAGE, str(error), message_id=message.id, event_id=message.event_id)
            return
        host = member.host
        session = host.session
        try:
            acceptance = await host.accept(member, event)
        except SessionError as error:
            code = _wire_code(error, ErrorCode.INVALID_STATE)
            if code is ErrorCode.INVALID_STATE and session.status is SessionStatus.FAILED:
                host.report_failure(member)  # the failure goes out before the reply that names it
                detail = f"session failed ({session.failure}); send session.reset."
            else:
                detail = str(error)
            await self._error(code, detail, message_id=message.id, event_id=message.event_id)
            return
        # Events this one superseded, if any, go out just before its input.accepted: once the
        # client has its reply it has every notice about the queue it changed (a socket lost
        # right after the reply loses nothing it must know).
        host.forward_dropped()
        await self._send(
            InputAccepted(
                id=message.id,
                event_id=acceptance.event_id,
                status="accepted" if acceptance.status is EventAcceptanceStatus.ACCEPTED else "duplicate",
                pending=acceptance.pending_event_count,
            )
        )

    async def _on_cancel(self, message: ChunkCancel) -> None:
        member = self._current()
        if member is None:
            await self._error(ErrorCode.NO_SESSION, "send session.start first.", message_id=message.id)
            return
        if not member.can_control:
            await self._error(ErrorCode.NOT_CONTROLLER, "viewers cannot cancel chunks.", message_id=message.id)
            return
        if member.host.parts_out():
            message_text = "the chunk in flight's first frames were sent already (chunk.part): it is not cancelled."
            await self._error(ErrorCode.NOTHING_TO_CANCEL, message_text, message_id=message.id)
            return
        try:
            chunk_index = await member.host.session.cancel_chunk()
        except SessionError as error:
            await self._error(_wire_code(error, ErrorCode.INVALID_STATE), str(error), message_id=message.id)
            return
        # The world's generator sees ChunkCancelledError and makes that chunk again.
        await self._send(ChunkCancelled(id=message.id, chunk_index=chunk_index))

    async def _on_reset(self, message: SessionReset) -> None:
        member = self._current()
        if member is None:
            await self._error(ErrorCode.NO_SESSION, "send session.start first.", message_id=message.id)
            return
        if not member.can_control:
            await self._error(ErrorCode.NOT_CONTROLLER, "viewers cannot reset the world.", message_id=message.id)
            return
        host = member.host
        try:
            await host.reset()
        except SessionStateError as error:
            await self._error(ErrorCode.INVALID_STATE, str(error), message_id=message.id)
            return
        except Exception:
            host.report_failure(member, message.id)  # failed: reset_failed or its own code
            await self._flush()
            return
        await self._send(SessionResetDone(id=message.id, epoch=host.session.epoch))

    async def _on_close(self, message: SessionClose) -> None:
        queued = self._queued
        if queued is not None:  # leaves the line
            queued.cancel()
            with contextlib.suppress(BaseException):
                await queued
            if self._current() is None:  # not admitted meanwhile
                await self._send(SessionClosed(id=message.id, reason="left_queue"))
                return
        if self._current() is None:
            await self._error(ErrorCode.NO_SESSION, "there is no session to close.", message_id=message.id)
            return
        await self._end("closed", message_id=message.id)

    async def _end(self, reason: str, *, message_id: str | None) -> None:
        """The host ends its world for everyone; a joiner leaves it. Either way the reply is ``session.closed``."""
        member = self._current()
        if member is None:
            return
        host = member.host
        if member.role is not Role.HOST:
            host.remove(member)
            self._forget()
            await self._send(SessionClosed(id=message_id, reason=reason))
            return
        error = await host.close(reason, requester=member, message_id=message_id)
        if error is not None:
            await self._send(SessionFailed(id=message_id, code=ErrorCode.CLEANUP_FAILED, message=str(error)))
            return
        self._forget()
        await self._flush()

    async def _on_ping(self, message: Ping) -> None:
        await self._send(Pong(id=message.id))

    async def _on_ack(self, message: ChunkAck) -> None:
        member = self._current()
        if member is not None:
            member.host.ack(member, message.seq)

    def hold_chunk(self, seq: int) -> None:
        """Chunk ``seq`` is being undone (a preemption): a socket whose transport sends frames on its own time
        (a WebRTC track) holds them until :meth:`release_chunk`, or until its replacement drops them."""
        hold = getattr(self._ws, "hold_chunk", None)
        if hold is not None:
            hold(seq)

    def release_chunk(self, seq: int) -> None:
        release = getattr(self._ws, "release_chunk", None)
        if release is not None:
            release(seq)

    def frames_started(self, seq: int) -> None:
        """The socket's transport sent chunk ``seq``'s first frame where it cannot be called back (a WebRTC video
        track, whose receiver shows what it got): the world preempts that chunk no more."""
        member = self._current()
        if member is not None:
            member.host.started(member, seq)


def _message_type(text: str) -> object:
    """The ``type`` of a JSON object message (None when it is not one): a large message's kind, before its
    fields are validated."""
    try:
        message = json.loads(text)
    except ValueError:
        return None
    return message.get("type") if isinstance(message, dict) else None
