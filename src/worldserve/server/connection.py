"""One WebSocket connection: its session, its message handling and its paced generation loop.

Owns, per connection: parsing and answering client messages (typed errors, never an
exception out of the loop), the one session it started, a generation task that calls
``next_chunk()`` paced to playback (at most ``lead_chunks`` ahead of real time, and
paused whenever ``max_lag_chunks`` chunks are un-acked), frame
encoding off the event loop, forwarding of dropped-event records (superseded ones right after the ``input.accepted``
of their successor), ``chunk.cancel``, and the release of
the session on ``session.close``, on idle timeout and on disconnect.

Must not know: HTTP routing, how the runtime reaches its workers, what controls mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.websockets import WebSocket, WebSocketDisconnect

from worldserve.errors import AdmissionRefusedError, ChunkCancelledError, ErrorCode
from worldserve.models.base import ModelSpec
from worldserve.protocol import ControlInput
from worldserve.runtime.chunk import Chunk
from worldserve.server.config import ServerConfig
from worldserve.server.encoding import decode_start_image, encode_frames
from worldserve.server.limits import TokenBucket
from worldserve.server.messages import (
    ChunkAck,
    ChunkCancel,
    ChunkCancelled,
    ChunkFrames,
    ChunkMessage,
    ClientMessageError,
    ErrorMessage,
    InputAccepted,
    InputDropped,
    InputEvent,
    Ping,
    Pong,
    SessionClose,
    SessionClosed,
    SessionFailed,
    SessionReset,
    SessionResetDone,
    SessionStart,
    SessionStarted,
    parse_client_message,
)
from worldserve.server.metrics import ServerMetrics
from worldserve.session import (
    EventAcceptanceStatus,
    Session,
    SessionError,
    SessionEvent,
    SessionStateError,
    SessionStatus,
)

__all__ = ["Connection", "WorldBackend"]

log = logging.getLogger("worldserve.server")


class WorldBackend(Protocol):
    """What a connection needs from the runtime."""

    @property
    def spec(self) -> ModelSpec: ...

    async def create_session(self, *, prompt: str | None, seed: int, image: bytes | None) -> Session[Chunk]: ...

    async def close_session(self, session_id: str) -> None: ...


def _wire_code(error: SessionError, fallback: ErrorCode) -> ErrorCode:
    """The error's own code where it is one of the vocabulary's, else ``fallback``."""
    try:
        return ErrorCode(error.code)
    except ValueError:
        return fallback


class Connection:
    """Serves one WebSocket until it closes; at most one live session at a time."""

    def __init__(
        self,
        websocket: WebSocket,
        backend: WorldBackend,
        config: ServerConfig,
        metrics: ServerMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ws = websocket
        self._backend = backend
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._send_lock = asyncio.Lock()
        self._events = TokenBucket(config.event_rate, config.event_burst, clock)
        self._session: Session[Chunk] | None = None
        self._media = "jpeg"
        self._quality = 90
        self._generator: asyncio.Task[None] | None = None
        self._stopping = False
        self._wake = asyncio.Event()
        self._sent_seq = -1
        self._acked_seq = -1
        self._started_at = 0.0
        self._first_chunk_sent = False
        self._accepted_at: dict[int, float] = {}  # pending event id -> when it was accepted
        self._failure_reported: tuple[int, str | None, str | None] | None = None  # the last failure sent
        self._reported_dropped: set[int] = set()  # pending ids already reported dropped with it

    # -- sending -------------------------------------------------------------------

    async def _send(self, message: BaseModel, *binary: bytes) -> None:
        """Send one JSON message and, contiguously, its binary frames."""
        await self._send_all((message,), binary)

    async def _send_all(self, messages: tuple[BaseModel, ...], binary: tuple[bytes, ...] = ()) -> None:
        """Send JSON messages and binary frames contiguously: nothing else gets between them."""
        texts = [message.model_dump_json(by_alias=True, exclude_none=True) for message in messages]
        async with self._send_lock:
            for text in texts:
                await self._ws.send_text(text)
            for payload in binary:
                await self._ws.send_bytes(payload)

    async def _error(
        self,
        code: ErrorCode,
        message: str,
        *,
        message_id: str | None,
        event_id: int | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        self._metrics.client_errors.labels(code=code.value).inc()
        await self._send(
            ErrorMessage(id=message_id, code=code, message=message, event_id=event_id, retry_after_ms=retry_after_ms)
        )

    async def _forward_dropped(self, session: Session[Chunk]) -> None:
        """Tell the client of discarded events, except those already reported with ``session.failed``."""
        for record in session.take_dropped():
            event_ids = [event_id for event_id in record.event_ids if event_id not in self._reported_dropped]
            self._reported_dropped.difference_update(record.event_ids)
            for event_id in event_ids:
                self._accepted_at.pop(event_id, None)
            if event_ids:
                await self._send(InputDropped(event_ids=event_ids, reason=record.reason.value, detail=record.detail))

    async def _report_failure(self, session: Session[Chunk], *, message_id: str | None = None) -> None:
        """Send ``session.failed`` once per failure, with the events it can no longer apply.

        The failed session keeps its pending events until a reset or close discards them
        (the seed's behaviour), but it can never apply them: they are reported dropped
        (``failed``) right behind ``session.failed``, in one contiguous send, and not again
        when the reset or close discards them. Called by the generator when a tick fails,
        and by any reply that refers to the failure, so that reply never overtakes it.
        """
        failure = session.failure
        key = (session.epoch, session.failure_code, failure)
        if session.status is not SessionStatus.FAILED or failure is None or key == self._failure_reported:
            return
        self._failure_reported = key
        code = session.failure_code or ErrorCode.TICK_FAILED
        self._metrics.session_failures.labels(code=code).inc()
        messages: list[BaseModel] = [SessionFailed(id=message_id, code=code, message=failure)]
        pending = session.pending_event_ids
        if pending:
            self._reported_dropped.update(pending)
            for event_id in pending:
                self._accepted_at.pop(event_id, None)
            messages.append(InputDropped(event_ids=list(pending), reason="failed", detail=failure))
        await self._send_all(tuple(messages))

    # -- the connection's life -----------------------------------------------------

    async def run(self) -> None:
        """Read and answer messages until the client goes away or idles out."""
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self._ws.receive(), timeout=self._config.idle_timeout)
                except TimeoutError:
                    await self._close_session("idle_timeout", message_id=None)
                    await self._ws.close(code=1000, reason="idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                await self._handle_frame(message)
        except WebSocketDisconnect:
            return
        finally:
            await self._release()

    async def _handle_frame(self, message: Mapping[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            await self._error(
                ErrorCode.INVALID_MESSAGE, "binary messages are not accepted; send JSON text.", message_id=None
            )
            return
        if len(text) > self._config.max_message_bytes or len(text.encode()) > self._config.max_message_bytes:
            await self._error(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"message exceeds {self._config.max_message_bytes} bytes.",
                message_id=None,
            )
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
        }
        try:
            await handlers[type(parsed)](parsed)
        except (WebSocketDisconnect, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("internal error while handling %s", type(parsed).__name__)
            await self._error(ErrorCode.INTERNAL_ERROR, "internal server error.", message_id=parsed.id)

    async def _release(self) -> None:
        """On disconnect: stop generating at once and release the worker's state."""
        await self._stop_generator(grace=0)
        session, self._session = self._session, None
        if session is not None:
            try:
                await self._backend.close_session(session.session_id)
            except Exception:
                log.exception("releasing session %s after disconnect failed", session.session_id)
            finally:
                self._metrics.sessions_active.dec()

    # -- client messages -----------------------------------------------------------

    async def _on_start(self, message: SessionStart) -> None:
        if self._session is not None:
            await self._error(ErrorCode.SESSION_EXISTS, "this connection already has a session.", message_id=message.id)
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
        if message.image is not None:
            try:
                image = await asyncio.to_thread(decode_start_image, message.image, spec.height, spec.width)
            except ValueError as error:
                await self._error(ErrorCode.INVALID_IMAGE, str(error), message_id=message.id)
                return
        try:
            session = await self._backend.create_session(prompt=message.prompt, seed=message.seed, image=image)
        except SessionError as error:
            retry = error.retry_after_s if isinstance(error, AdmissionRefusedError) else None
            await self._error(
                _wire_code(error, ErrorCode.INTERNAL_ERROR),
                str(error),
                message_id=message.id,
                retry_after_ms=None if retry is None else round(retry * 1000),
            )
            return
        except ValueError as error:  # options the model cannot take
            await self._error(ErrorCode.INVALID_MESSAGE, str(error), message_id=message.id)
            return
        self._session = session
        self._failure_reported = None
        self._reported_dropped.clear()
        self._accepted_at.clear()  # event ids are the session's own
        self._media = message.options.media
        self._quality = message.options.quality
        self._stopping = False
        self._started_at = self._clock()
        self._first_chunk_sent = False
        self._metrics.sessions_started.inc()
        self._metrics.sessions_active.inc()
        await self._send(
            SessionStarted(
                id=message.id,
                session_id=session.session_id,
                model=spec.to_dict(),
                media=self._media,
                max_pending_events=session.max_pending_events,
                max_lag_chunks=self._config.max_lag_chunks,
            )
        )
        self._generator = asyncio.create_task(self._generate(session), name=f"generate-{session.session_id}")

    async def _on_event(self, message: InputEvent) -> None:
        session = self._session
        if session is None:
            await self._error(
                ErrorCode.NO_SESSION, "send session.start first.", message_id=message.id, event_id=message.event_id
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
            event = SessionEvent(
                event_id=message.event_id,
                prompt=message.prompt,
                controls=tuple(ControlInput(c.track, c.schema_, c.data) for c in message.controls),
            )
        except ValueError as error:
            await self._error(ErrorCode.INVALID_MESSAGE, str(error), message_id=message.id, event_id=message.event_id)
            return
        try:
            acceptance = await session.accept_event(event)
            if acceptance.status is EventAcceptanceStatus.ACCEPTED:
                self._accepted_at[acceptance.event_id] = self._clock()
        except SessionError as error:
            code = _wire_code(error, ErrorCode.INVALID_STATE)
            if code is ErrorCode.INVALID_STATE and session.status is SessionStatus.FAILED:
                await self._report_failure(session)  # the failure goes out before the reply that names it
                detail = f"session failed ({session.failure}); send session.reset."
            else:
                detail = str(error)
            await self._error(code, detail, message_id=message.id, event_id=message.event_id)
            return
        await self._send(
            InputAccepted(
                id=message.id,
                event_id=acceptance.event_id,
                status=acceptance.status.value,
                pending=acceptance.pending_event_count,
            )
        )
        await self._forward_dropped(session)  # events this one superseded, if any

    async def _on_reset(self, message: SessionReset) -> None:
        session = self._session
        if session is None:
            await self._error(ErrorCode.NO_SESSION, "send session.start first.", message_id=message.id)
            return
        try:
            await session.reset()
        except SessionStateError as error:
            await self._error(ErrorCode.INVALID_STATE, str(error), message_id=message.id)
            return
        except Exception:
            await self._report_failure(session, message_id=message.id)  # failed: reset_failed or its own code
            return
        self._acked_seq = self._sent_seq  # nothing of the old epoch counts as lag any more
        self._wake.set()
        await self._forward_dropped(session)
        await self._send(SessionResetDone(id=message.id, epoch=session.epoch))

    async def _on_close(self, message: SessionClose) -> None:
        if self._session is None:
            await self._error(ErrorCode.NO_SESSION, "there is no session to close.", message_id=message.id)
            return
        await self._close_session("closed", message_id=message.id)

    async def _close_session(self, reason: str, *, message_id: str | None) -> None:
        """Stop generating after the chunk in flight, release the session, tell the client."""
        session = self._session
        if session is None:
            return
        self._stopping = True
        self._wake.set()
        try:
            # Waits for the tick in flight; the generator then sends that last chunk and stops.
            await self._backend.close_session(session.session_id)
        except Exception as error:
            await self._send(SessionFailed(id=message_id, code=ErrorCode.CLEANUP_FAILED, message=str(error)))
            return
        await self._stop_generator(grace=self._backend.spec.chunk_seconds * 4 + 1.0)
        self._session = None
        self._metrics.sessions_active.dec()
        await self._forward_dropped(session)
        await self._send(SessionClosed(id=message_id, reason=reason))

    async def _stop_generator(self, grace: float) -> None:
        """Let the generation task finish within ``grace`` seconds, else cancel it."""
        self._stopping = True
        self._wake.set()
        generator = self._generator
        if generator is None:
            return
        if grace > 0:
            await asyncio.wait({generator}, timeout=grace)
        if not generator.done():
            generator.cancel()
            with contextlib.suppress(BaseException):
                await generator
        self._generator = None

    async def _on_cancel(self, message: ChunkCancel) -> None:
        session = self._session
        if session is None:
            await self._error(ErrorCode.NO_SESSION, "send session.start first.", message_id=message.id)
            return
        try:
            chunk_index = await session.cancel_chunk()
        except SessionError as error:
            await self._error(_wire_code(error, ErrorCode.INVALID_STATE), str(error), message_id=message.id)
            return
        # The generator's next_chunk() raises ChunkCancelledError and it starts the next chunk.
        await self._send(ChunkCancelled(id=message.id, chunk_index=chunk_index))

    async def _on_ping(self, message: Ping) -> None:
        await self._send(Pong(id=message.id))

    async def _on_ack(self, message: ChunkAck) -> None:
        if message.seq > self._acked_seq:
            self._acked_seq = min(message.seq, self._sent_seq)
            self._wake.set()

    # -- generation ----------------------------------------------------------------

    async def _wait(self, timeout: float | None) -> None:
        """Sleep until woken (ack, reset, close) or ``timeout`` passes."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _generate(self, session: Session[Chunk]) -> None:
        """Produce chunks paced to playback, with client backpressure, until stopped."""
        period = self._backend.spec.chunk_seconds
        lead = self._config.lead_chunks
        anchor: float | None = None  # when chunk 0 of this epoch was ready
        produced = 0  # chunks of this epoch so far
        epoch = session.epoch
        while not self._stopping:
            if session.status is not SessionStatus.ACTIVE:
                await self._wait(None)  # failed: wait for a reset (or close)
                continue
            if self._sent_seq - self._acked_seq >= self._config.max_lag_chunks:
                await self._wait(None)  # backpressure: the client lags
                continue
            if session.epoch != epoch:
                epoch, anchor, produced = session.epoch, None, 0
            if anchor is not None:
                delay = anchor + (produced - lead) * period - self._clock()
                if delay > 0:
                    await self._wait(delay)
                    if self._stopping or session.epoch != epoch:
                        continue
                    if self._clock() < anchor + (produced - lead) * period:
                        continue  # woken early (an ack): wait out the rest
                elif delay < -period:
                    anchor -= delay  # fell behind real time: re-anchor playback
            started = self._clock()
            try:
                chunk = await session.next_chunk()
            except SessionStateError:
                continue  # a reset or close got in first
            except ChunkCancelledError:
                continue  # chunk.cancel: the session is back at its last commit; make the chunk again
            except Exception:
                await self._report_failure(session)
                continue
            chunk_epoch = session.epoch
            finished = self._clock()
            if anchor is None or chunk_epoch != epoch:
                epoch, anchor, produced = chunk_epoch, finished, 0
            produced += 1
            await self._send_chunk(chunk, chunk_epoch, started=started, committed=finished)

    async def _send_chunk(self, chunk: Chunk, epoch: int, *, started: float, committed: float) -> None:
        tick_seconds = committed - started
        frames = chunk.frames
        metadata = chunk.metadata
        payloads = await asyncio.to_thread(encode_frames, frames, self._media, self._quality)
        self._sent_seq += 1
        applied_latency = [
            (committed - self._accepted_at.pop(event_id, committed)) * 1000.0 for event_id in metadata.applied_event_ids
        ]
        self._metrics.chunk_latency.observe(tick_seconds)
        self._metrics.frames_sent.inc(len(payloads))
        await self._send(
            ChunkMessage(
                seq=self._sent_seq,
                epoch=epoch,
                chunk_index=metadata.chunk_index,
                request_id=metadata.request_id,
                applied_event_ids=list(metadata.applied_event_ids),
                frames=ChunkFrames(
                    count=len(payloads),
                    media="jpeg" if self._media == "jpeg" else "raw",
                    width=int(frames.shape[2]),
                    height=int(frames.shape[1]),
                    sizes=[len(payload) for payload in payloads],
                ),
                timings={
                    "tick_ms": tick_seconds * 1000.0,
                    "queued_ms": chunk.queued_s * 1000.0,
                    "model_ms": chunk.compute_s * 1000.0,
                    "engine_ms": chunk.roundtrip_s * 1000.0,
                },
                batch_size=chunk.batch_size,
                applied_latency_ms=applied_latency,
            ),
            *payloads,
        )
        if not self._first_chunk_sent:
            self._first_chunk_sent = True
            self._metrics.time_to_first_chunk.observe(self._clock() - self._started_at)
