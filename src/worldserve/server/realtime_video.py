"""``WS /v1/realtime/video``: vllm-omni 0.30.0's realtime video protocol over worldserve's sessions.

Owns: one vllm-omni client's socket: its ``session.start`` (within
``realtime_start_timeout_s``, at most 4 MiB, ``format`` ``m4s``; a bad one gets ``error
{message}`` and the socket closes), the session it starts -- created through the same
backend as ``/v1/world`` (same admission, batching with every other session on its worker,
auth, metrics; it never overtakes ``/v1/world`` starts waiting in line: while any wait, it
is refused, as a start without ``queue`` is there), served by a
:class:`~worldserve.server.host.WorldHost` with H.264 frames, of which this connection is
the only member -- and its messages after that (at most 128 KiB each):
``session.interaction`` (checked, queued in an
:class:`~worldserve.server.realtime_plan.InteractionPlan`, answered
``session.interaction.queued``; applied at the next chunk boundary through the session's
control plane: the plan turns what is due into one event right before each tick),
``session.ping`` / ``session.pong``, ``session.stop`` (``session.done {stopped: true}``).
Each chunk goes out as ``video.chunk_metadata`` and exactly one binary message (its fMP4
fragment; the init segment in front of the first); after the chunk that reaches
``num_frames`` come a ``trailer`` (an ``mfra`` box: the concatenated binaries form a
complete fragmented MP4 file) and ``session.done {stopped: false}``. A session that makes
no progress and gets no ``session.ping`` for ``realtime_stall_timeout_s`` ends with an
``error`` and ``session.done {stopped: true}``; a server that stops ends it with
``session.done {stopped: true}`` and closes with 1001 (:meth:`close_for_shutdown`).
Pacing: a chunk counts as played once the socket took it (vllm-omni's clients do not
ack), so a client that stops reading holds generation back, as on ``/v1/world``.

Must not know: HTTP routing, how the runtime reaches its workers, how models compute frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import struct
import time
import uuid
from collections.abc import Mapping
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from worldserve.errors import AdmissionRefusedError, SessionError
from worldserve.media import FrameEncoding
from worldserve.runtime.chunk import Chunk
from worldserve.server.config import ServerConfig
from worldserve.server.encoding import decode_start_image
from worldserve.server.host import Member, WorldBackend, WorldHost, WorldHosts
from worldserve.server.limits import TokenBucket
from worldserve.server.messages import ChunkMessage, SessionClosed, SessionFailed
from worldserve.server.metrics import ServerMetrics
from worldserve.server.pacing import Preempt
from worldserve.server.realtime_messages import (
    EVENT_ID_CONFLICT,
    INTERACTION_FAILED,
    MAX_INTERACTION_MESSAGE_BYTES,
    MAX_START_MESSAGE_BYTES,
    ChunkMetadata,
    InteractionQueued,
    RealtimeError,
    SessionDone,
    SessionPong,
    VideoStart,
    VideoStartRequest,
)
from worldserve.server.realtime_plan import Boundary, InteractionPlan, InteractionRefused, parse_interaction
from worldserve.server.waiting import WaitingRoom, waiting_room
from worldserve.session import Session, SessionEvent

__all__ = ["RealtimeVideoConnection", "mfra_trailer"]

log = logging.getLogger("worldserve.server")

_REQUEST_FIELDS = frozenset(VideoStartRequest.model_fields)


def mfra_trailer() -> bytes:
    """An empty movie fragment random access box (``mfra`` holding only ``mfro``): the end of a
    fragmented MP4 file (nothing is held back: every fragment was complete when sent)."""
    mfro = struct.pack(">I4sII", 16, b"mfro", 0, 24)
    return struct.pack(">I4s", 8 + len(mfro), b"mfra") + mfro


class _Ending(Exception):
    """The start failed; the reply was sent."""


class RealtimeVideoConnection:
    """Serves one ``/v1/realtime/video`` socket: one session, start to done."""

    def __init__(
        self,
        websocket: WebSocket,
        backend: WorldBackend,
        config: ServerConfig,
        metrics: ServerMetrics,
        hosts: WorldHosts,
        room: WaitingRoom[Session[Chunk]] | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self._ws = websocket
        self._backend = backend
        self._config = config
        self._metrics = metrics
        self._hosts = hosts
        self._room = room if room is not None else waiting_room(backend, config, hosts)
        self._clock = clock
        self._outbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._host: WorldHost | None = None
        self._member: Member | None = None
        self._plan: InteractionPlan | None = None
        self._request_id: str | None = None
        self._last_chunk: int | None = None  # the chunk that reaches num_frames (None: until stop)
        self._boundaries: dict[int, Boundary] = {}
        self._used_ids: set[str] = set()
        self._next_wire = 0
        self._sent = 0  # binary messages written (transport_chunk_index)
        self._backlog = 0
        self._finishing = False  # done is queued: no chunk after it
        self._cut = False  # it ends before its last chunk (stop, stall, failure): unwritten chunks are dropped
        self._progress = clock()
        self._events = TokenBucket(config.event_rate, config.event_burst, clock)

    # -- the world's side (Outlet) -------------------------------------------------

    def post(self, messages: tuple[BaseModel, ...], binary: tuple[bytes, ...] = ()) -> None:
        for message in messages:
            if isinstance(message, ChunkMessage) and binary:
                self._chunk(message, binary[0])
            elif isinstance(message, SessionFailed):
                self._error(f"generation failed ({message.code}): {message.message}", request_id=self._request_id)
                self._finish(None)
            elif isinstance(message, SessionClosed) and message.reason == "shutdown":
                self._finish(True, close_code=1001)

    def detach(self) -> None:  # this route has no resume: a member is never taken over
        return None

    @property
    def backlog(self) -> int:
        return self._backlog

    def unsent(self) -> list[tuple[BaseModel, ...]]:
        return []

    def _chunk(self, message: ChunkMessage, payload: bytes) -> None:
        if self._finishing:
            return  # made after the end (the chunk in flight when it came): not sent
        boundary = self._boundaries.pop(message.chunk_index, None)
        self._backlog += 1
        self._outbox.put_nowait(("chunk", (message, payload, boundary)))
        if self._last_chunk is not None and message.chunk_index >= self._last_chunk:
            self._outbox.put_nowait(("trailer", None))
            self._finish(False)

    def _error(self, message: str, **fields: Any) -> None:
        self._metrics.realtime_errors.labels(code=fields.get("code") or "none").inc()
        self._outbox.put_nowait(("json", RealtimeError(message=message, **fields)))

    def _finish(self, stopped: bool | None, close_code: int = 1000) -> None:
        """End the session: ``session.done`` (unless ``stopped`` is None: a failure, already reported), then close."""
        if self._finishing:
            return
        self._finishing = True
        self._cut = stopped is not False
        self._outbox.put_nowait(("done", (stopped, close_code)))

    async def close_for_shutdown(self, flush_timeout: float) -> None:
        """The server stops (the world has ended: ``session.done`` is queued, or the start is not
        through yet): write what is queued, within ``flush_timeout`` seconds, then close with 1001."""
        writer = self._writer
        if writer is not None and self._finishing:
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(flush_timeout):
                    await asyncio.shield(writer)
        with contextlib.suppress(Exception):
            await self._ws.close(code=1001, reason="server shutting down")

    # -- writing -------------------------------------------------------------------

    async def _write(self) -> None:
        while True:
            kind, item = await self._outbox.get()
            if kind == "json":
                await self._ws.send_text(item.model_dump_json(exclude_none=True))
            elif kind == "chunk":
                message, payload, boundary = item
                self._backlog -= 1
                if self._cut:
                    continue
                await self._send_binary("media", payload, message.frames.count, message.chunk_index, boundary)
                if self._member is not None and self._host is not None:
                    self._host.ack(self._member, message.seq)  # taken by the socket: played, for pacing
            elif kind == "trailer":
                await self._send_binary("trailer", mfra_trailer(), 0, None, None)
            elif kind == "done":
                stopped, close_code = item
                if stopped is not None:
                    done = SessionDone(request_id=self._request_id, chunks=self._sent, stopped=stopped)
                    await self._ws.send_text(done.model_dump_json())
                await self._end_session()
                with contextlib.suppress(Exception):
                    await self._ws.close(code=close_code)
                return

    async def _send_binary(
        self, kind: str, payload: bytes, frames: int, chunk_index: int | None, boundary: Boundary | None
    ) -> None:
        metadata = ChunkMetadata(
            request_id=self._request_id or "",
            kind="media" if kind == "media" else "trailer",
            num_frames=frames,
            byte_length=len(payload),
            generation_chunk_index=chunk_index,
            transport_chunk_index=self._sent,
            started_event_ids=list(boundary.started) if boundary else [],
            active_event_ids=list(boundary.active) if boundary else [],
            completed_event_ids=list(boundary.completed) if boundary else [],
        )
        await self._ws.send_text(metadata.model_dump_json())
        await self._ws.send_bytes(payload)
        self._sent += 1
        self._progress = self._clock()

    async def _end_session(self) -> None:
        host, member = self._host, self._member
        self._member = None
        if host is None or member is None or host.closed:
            return
        error = await host.close("closed", requester=member, message_id=None)
        if error is not None:
            log.warning("closing realtime video session %s failed: %s", host.session_id, error)
            await host.shutdown("closed")

    # -- the connection's life -------------------------------------------------------

    async def run(self) -> None:
        try:
            try:
                request = await self._receive_start()
                await self._start(request)
            except _Ending:
                with contextlib.suppress(Exception):
                    await self._ws.close(code=1000)
                return
            self._writer = asyncio.create_task(self._write(), name="realtime-video-writer")
            watchdog = asyncio.create_task(self._watch_stalls(), name="realtime-video-stalls")
            try:
                await self._read()
            finally:
                watchdog.cancel()
        except WebSocketDisconnect:
            pass
        finally:
            await self._release()

    async def _send_now(self, message: BaseModel) -> None:
        await self._ws.send_text(message.model_dump_json(exclude_none=True))

    async def _refuse(self, message: str) -> NoReturn:
        self._metrics.realtime_errors.labels(code="none").inc()
        with contextlib.suppress(Exception):
            await self._send_now(RealtimeError(message=message))
        raise _Ending

    async def _receive_start(self) -> VideoStartRequest:
        try:
            async with asyncio.timeout(self._config.realtime_start_timeout_s):
                frame = await self._ws.receive()
        except TimeoutError:
            await self._refuse("Timeout waiting for session.start")
        if frame["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(frame.get("code", 1000))
        raw = frame.get("text")
        if raw is None:
            await self._refuse("session.start must be a JSON text message")
        assert isinstance(raw, str)
        if len(raw) > MAX_START_MESSAGE_BYTES:
            await self._refuse("session.start message too large")
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):
            await self._refuse("Invalid JSON in session.start")
        if not isinstance(message, dict):
            await self._refuse("session.start must be a JSON object")
        if message.get("type") != "session.start":
            await self._refuse(f"Expected session.start, got: {message.get('type')}")
        if message.pop("format", "m4s") != "m4s":
            await self._refuse("Invalid session.start format: expected 'm4s'.")
        try:
            request = VideoStartRequest(**_request_data(message))
        except ValidationError as error:
            await self._refuse(f"Invalid session.start: {_describe(error)}")
        spec = self._backend.spec
        if request.model is not None and request.model != spec.name:
            await self._refuse(
                f"Model mismatch: request specifies '{request.model}' but server is running '{spec.name}'."
            )
        size = (request.width or spec.width, request.height or spec.height, request.fps or spec.fps)
        if size != (spec.width, spec.height, spec.fps):
            await self._refuse(
                f"Invalid session.start: model {spec.name!r} makes {spec.width}x{spec.height} frames at "
                f"{spec.fps:g} fps; width, height and fps must be those or absent."
            )
        return request

    async def _start(self, request: VideoStartRequest) -> None:
        spec = self._backend.spec
        image = await self._start_image(request)
        extra = request.extra_params or {}
        try:
            encoding = FrameEncoding.for_media("h264", extra.get("quality"), extra.get("bitrate_kbps"))
        except (ValueError, TypeError) as error:
            await self._refuse(f"Invalid session.start: extra_params: {error}")
        seed = (request.seed or 0) % 2**32
        try:
            self._room.refuse_if_waiting()  # those waiting in line on /v1/world came first
            session = await self._backend.create_session(
                prompt=request.prompt, seed=seed, image=image, encoding=encoding
            )
        except SessionError as error:
            retry = error.retry_after_s if isinstance(error, AdmissionRefusedError) else None
            hint = "" if retry is None else f" (retry after {round(retry * 1000)} ms)"
            await self._refuse(f"Cannot start the session: {error}{hint}")
        except ValueError as error:
            await self._refuse(f"Invalid session.start: {error}")
        self._request_id = f"video_stream-{session.session_id}"
        if request.num_frames:
            self._last_chunk = math.ceil(request.num_frames / spec.frames_per_chunk) - 1
        self._plan = InteractionPlan(spec)
        # Twin of connection.py's _begin (only the share flags differ). Left as is: merging it means one object for
        # the routes' server-wide parts (backend, config, metrics, hosts, clock), which issue 28's front-ends reshape.
        host = self._host = WorldHost(
            session,
            backend=self._backend,
            config=self._config,
            metrics=self._metrics,
            registry=self._hosts,
            media=encoding.media,
            quality=encoding.quality,
            bitrate_kbps=encoding.bitrate_kbps,
            clock=self._clock,
        )
        self._member = host.attach_host(self)
        host.pacing.before_tick = self._before_tick
        host.pacing.preempt = Preempt(enabled=False)  # vllm-omni's protocol has no way to replace a chunk sent
        self._metrics.sessions_started.inc()
        self._metrics.sessions_active.inc()
        self._metrics.realtime_sessions_started.inc()
        config = request.model_dump(exclude_none=True)
        config.update(width=spec.width, height=spec.height, fps=spec.fps, seed=seed)
        config["frames_per_chunk"] = spec.frames_per_chunk
        await self._send_now(VideoStart(request_id=self._request_id, config=config))
        self._progress = self._clock()
        host.start()

    async def _start_image(self, request: VideoStartRequest) -> bytes | None:
        reference = request.image_reference
        if reference is None:
            return None
        if isinstance(reference, list):
            await self._refuse("image_reference must be a single image reference.")
        assert not isinstance(reference, list)
        url = reference.image_url
        head, comma, data = url.partition(",")
        if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
            await self._refuse("image_reference.image_url must be a data:image/...;base64, URL (nothing is fetched).")
        spec = self._backend.spec
        try:
            return await asyncio.to_thread(decode_start_image, data, spec.height, spec.width)
        except ValueError as error:
            await self._refuse(f"Invalid image_reference: {error}")
        return None  # unreachable: _refuse raises

    async def _read(self) -> None:
        while True:
            frame = await self._ws.receive()
            if frame["type"] == "websocket.disconnect":
                return
            raw = frame.get("text")
            if raw is None:
                self._error("WebSocket messages must be JSON text")
                continue
            if len(raw) > MAX_INTERACTION_MESSAGE_BYTES:
                self._error("control message too large")
                continue
            try:
                message = json.loads(raw)
            except (ValueError, RecursionError):
                self._error("Invalid JSON message")
                continue
            if not isinstance(message, dict):
                self._error("WebSocket messages must be JSON objects")
                continue
            kind = message.get("type")
            if kind == "session.stop":
                self._finish(True)
            elif kind == "session.ping":
                self._progress = self._clock()
                self._outbox.put_nowait(("json", SessionPong()))
            elif kind == "session.interaction":
                self._interaction(message)
            else:
                self._error(f"Unknown message type: {kind}")

    async def _watch_stalls(self) -> None:
        timeout = self._config.realtime_stall_timeout_s
        while not self._finishing:
            await asyncio.sleep(min(1.0, timeout / 4))
            if self._clock() - self._progress > timeout and not self._finishing:
                self._error("Stall timeout: no generation progress")
                self._finish(True)
                break
        else:
            return  # it ended otherwise
        writer = self._writer
        if writer is not None:  # a client that stopped reading never takes the end: close its socket
            await asyncio.wait({writer}, timeout=timeout)
            if not writer.done():
                writer.cancel()
                with contextlib.suppress(Exception):
                    await self._ws.close(code=1011, reason="stalled")

    async def _release(self) -> None:
        writer = self._writer
        if writer is not None:
            if not self._finishing or writer.done():
                writer.cancel()
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(self._config.realtime_stall_timeout_s):
                    await writer
        host, member = self._host, self._member
        self._member = None
        if host is not None and member is not None and not host.closed:
            try:
                await host.disconnected(member, self, clean=True)
            except Exception:
                log.exception("releasing realtime video session %s failed", host.session_id)

    # -- interactions --------------------------------------------------------------

    def _interaction(self, message: Mapping[str, Any]) -> None:
        plan = self._plan
        assert plan is not None
        try:
            interaction = parse_interaction(message, uuid.uuid4().hex)
        except ValueError as error:
            self._error(str(error))
            return
        event_id = interaction.event_id
        ids = {"request_id": self._request_id, "event_id": event_id}
        if event_id in self._used_ids:
            self._error(
                f"event_id_conflict: {event_id!r} was already used in this session", code=EVENT_ID_CONFLICT, **ids
            )
            return
        self._used_ids.add(event_id)
        try:
            if self._finishing:
                raise InteractionRefused("the session is ending")
            if not self._events.take():
                raise InteractionRefused(f"more than {self._config.event_rate:g} interactions/s; slow down")
            if plan.pending >= self._session_limit():
                raise InteractionRefused("too many interactions wait for the next chunk")
            plan.queue(plan.check(interaction))
        except InteractionRefused as error:
            self._used_ids.discard(event_id)  # a failed submit frees the id (vllm-omni)
            self._error(f"Failed to apply interaction: {error}", code=INTERACTION_FAILED, **ids)
            return
        self._outbox.put_nowait(("json", InteractionQueued(request_id=self._request_id or "", event_id=event_id)))

    def _session_limit(self) -> int:
        host = self._host
        return 64 if host is None else host.session.max_pending_events

    async def _before_tick(self, session: Session[Any]) -> None:
        """Right before each tick: what the plan says the chunk applies goes in as one event."""
        plan, host, member = self._plan, self._host, self._member
        if plan is None or host is None or member is None:
            return
        boundary = plan.boundary()
        for event_id, reason in boundary.refused:
            self._used_ids.discard(event_id)
            self._error(
                f"Failed to apply interaction: {reason}",
                code=INTERACTION_FAILED,
                request_id=self._request_id,
                event_id=event_id,
            )
        if boundary.prompt is not None or boundary.controls:
            self._next_wire += 1
            event = SessionEvent(self._next_wire, prompt=boundary.prompt, controls=boundary.controls)
            try:
                await host.accept(member, event)
            except (SessionError, ValueError) as error:
                for event_id in boundary.started:
                    self._used_ids.discard(event_id)
                    self._error(
                        f"Failed to apply interaction: {error}",
                        code=INTERACTION_FAILED,
                        request_id=self._request_id,
                        event_id=event_id,
                    )
                boundary = Boundary(None, (), (), (), ())
        self._boundaries[session.chunk_index] = boundary


def _request_data(message: dict[str, Any]) -> dict[str, Any]:
    """vllm-omni's merge of ``sampling_params``: known request fields move up, the rest into ``extra_params``."""
    data = {key: value for key, value in message.items() if key not in ("type", "format", "sampling_params")}
    sampling = message.get("sampling_params")
    if isinstance(sampling, dict):
        extra = dict(data.get("extra_params") or {})
        for key, value in sampling.items():
            if key in _REQUEST_FIELDS and key not in data:
                data[key] = value
            else:
                extra[key] = value
        if extra:
            data["extra_params"] = extra
    return data


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False)[:4]:
        location = ".".join(str(step) for step in item["loc"]) or "message"
        parts.append(f"{location}: {item['msg']}")
    return "; ".join(parts)
