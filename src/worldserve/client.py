"""``WorldClient``: drive a worldserve world from Python over its WebSocket protocol.

Owns: one connection (``websockets``), a reader task that demultiplexes replies (by
the client message ``id`` it stamps on every request), chunks (a JSON header, then its
binary messages -- one per frame for JPEG and raw, one fMP4 fragment for H.264, decoded with
PyAV by the one H.264 stream decoder of the connection's session -- as ``uint8 [frames,
height, width, 3]`` numpy arrays),
dropped-event notices and session failures; a refused handshake said as what to fix (the
token, the origin, the path: the server's 401, 403, 404); and acknowledging each chunk as it is
consumed, which is what lets the server pace generation to this client.

Must not know: the server's internals. Needs the ``client`` extra (websockets, numpy,
pillow, av).

    async with WorldClient("ws://127.0.0.1:8000/v1/world") as client:
        await client.start(prompt="snowy peaks", seed=3)
        await client.send_event(controls=[keys("W")])
        async for chunk in client.chunks():
            print(chunk.chunk_index, chunk.applied_event_ids, chunk.frames.shape)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import websockets
from PIL import Image
from websockets.asyncio.client import ClientConnection

from worldserve.h264 import H264Decoder
from worldserve.protocol import ControlInput

__all__ = [
    "Acceptance",
    "ClientChunk",
    "ClientPart",
    "Dropped",
    "Queued",
    "SessionFailedError",
    "SessionInfo",
    "WorldClient",
    "WorldClientError",
    "WorldError",
    "camera",
    "keys",
]


class WorldClientError(Exception):
    """The connection or the protocol broke (not a server-reported error)."""


class WorldError(Exception):
    """An ``error`` message from the server: ``code`` is stable (see docs/protocol.md)."""

    def __init__(self, code: str, message: str, event_id: int | None = None, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.event_id = event_id
        #: The server's hint (set on ``admission_refused``): try again after this many milliseconds.
        self.retry_after_ms = retry_after_ms


class SessionFailedError(WorldError):
    """The session failed (``session.failed``); only ``reset()`` or ``close()`` go on."""


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    model: dict[str, Any]
    media: str
    max_pending_events: int
    max_lag_chunks: int
    role: str = "host"  # "host", "controller" or "viewer"
    lead_chunks: int = 0  # whole chunks the server makes ahead of playback (0: just in time)
    resume_token: str | None = None  # for resume() after a dropped connection (None: the server has it off)
    resume_grace_s: float | None = None  # how long the server keeps a dropped connection's place
    viewer_token: str | None = None  # share tokens (start(share_viewers=..., share_controllers=...))
    controller_token: str | None = None
    #: The /v1/world URL of the front-end the world lives on, as it told (None: it has no --public-url).
    url: str | None = None


@dataclass(frozen=True, slots=True)
class Queued:
    """A ``session.queued`` notice: this start waits in line (``position`` 1 is next)."""

    position: int
    ahead: int
    eta_s: float | None  # the server's estimate; None until it has measured session lengths
    received: float  # time.monotonic() when it arrived


@dataclass(frozen=True, slots=True)
class Acceptance:
    event_id: int
    status: str  # "accepted" or "duplicate"
    pending: int


@dataclass(frozen=True, slots=True)
class Dropped:
    event_ids: tuple[int, ...]
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class ClientChunk:
    seq: int
    epoch: int
    chunk_index: int
    request_id: str
    applied_event_ids: tuple[int, ...]
    frames: npt.NDArray[np.uint8] = field(repr=False)
    timings: dict[str, float]
    batch_size: int
    applied_latency_ms: tuple[float, ...]  # server-side, acceptance -> commit, per applied event
    received_at: float  # time.monotonic() when its frames were decoded (ready to show)
    arrived_at: float | None = None  # time.monotonic() when its last binary message arrived (before decoding)
    times: dict[str, Any] | None = None  # the server's instants (the header's `times`), None from older servers
    #: A preemption: the seq of the chunk received before that this one replaces (same chunk index; drop
    #: what is left of that one unplayed). None for every other chunk.
    supersedes: int | None = None
    #: The index in the chunk of ``frames[0]``: 0 unless the frames before it were dropped (over WebRTC, the
    #: server drops the oldest unsent frames of a peer behind; ``frames`` then holds fewer than the chunk made).
    first_frame: int = 0
    #: Its frames that came before it in parts (``start(parts=True)``), and when the first part arrived and was
    #: decoded (time.monotonic(): its first frames could be shown from then); 0 and None for a chunk sent whole.
    parted: int = 0
    first_part_arrived_at: float | None = None
    first_part_at: float | None = None

    @classmethod
    def from_header(
        cls,
        header: Mapping[str, Any],
        frames: npt.NDArray[np.uint8],
        *,
        received_at: float,
        arrived_at: float | None,
        first_frame: int = 0,
    ) -> ClientChunk:
        """A chunk from its ``chunk`` message and its frames."""
        return cls(
            seq=header["seq"],
            epoch=header["epoch"],
            chunk_index=header["chunk_index"],
            request_id=header["request_id"],
            applied_event_ids=tuple(header["applied_event_ids"]),
            frames=frames,
            timings=header.get("timings", {}),
            batch_size=header.get("batch_size", 1),
            applied_latency_ms=tuple(header.get("applied_latency_ms", ())),
            received_at=received_at,
            arrived_at=arrived_at,
            times=header.get("times"),
            supersedes=header.get("supersedes"),
            first_frame=first_frame,
        )


@dataclass(frozen=True, slots=True)
class ClientPart:
    """Frames of a chunk still being made (``start(parts=True)``): frames ``first`` .. of chunk ``seq``."""

    seq: int
    epoch: int
    chunk_index: int
    first: int
    frames: npt.NDArray[np.uint8] = field(repr=False)
    received_at: float  # time.monotonic() when its frames were decoded (ready to show)
    arrived_at: float  # time.monotonic() when its last binary message arrived (before decoding)


def keys(*held: str) -> ControlInput:
    """A ``keys`` control of the built-in models: the movement keys held now."""
    return ControlInput("keys", "worldserve.keys.v1", {"held": list(held)})


def camera(dx: float, dy: float) -> ControlInput:
    """A ``camera`` control of the built-in models: pan velocity, px per frame."""
    return ControlInput("camera", "worldserve.camera.v1", {"dx": dx, "dy": dy})


_CLOSED = object()
#: How many session.moved in a row a resume or join follows (front-ends that disagree cannot send it round forever).
_MAX_MOVES = 3


def _image_field(image: npt.NDArray[np.uint8] | bytes) -> str:
    """An image for the wire: base64 of its bytes (an array is sent as PNG)."""
    if isinstance(image, np.ndarray):
        buffer = io.BytesIO()
        Image.fromarray(image, mode="RGB").save(buffer, format="PNG")
        image = buffer.getvalue()
    return base64.b64encode(image).decode()


class MessageLink(Protocol):
    """What a client reads and writes its messages on besides a WebSocket connection (a WebRTC data channel)."""

    async def send(self, message: str) -> None: ...

    async def recv(self) -> str | bytes: ...

    async def close(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[str | bytes]: ...


class WorldClient:
    """An async client for one session over one WebSocket connection."""

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8000/v1/world",
        *,
        token: str | None = None,
        open_timeout: float = 10.0,
        reply_timeout: float = 30.0,
        auto_ack: bool = True,
    ) -> None:
        self.url = url
        #: Ack each chunk as :meth:`next_chunk` hands it over (True), or leave it to :meth:`ack` (a
        #: player that acks as it shows a chunk's first frame, as the page does: the server paces to
        #: it and preempts only chunks not yet playing).
        self.auto_ack = auto_ack
        self._token = token
        self._open_timeout = open_timeout
        self._reply_timeout = reply_timeout
        self._ws: ClientConnection | MessageLink | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._chunks: asyncio.Queue[ClientChunk | BaseException | object] = asyncio.Queue()
        self._taken: ClientChunk | None = None  # taken from _chunks by a next_chunk cancelled before returning it
        self._ids = itertools.count(1)
        self._event_ids = itertools.count(1)
        self._epoch = 0
        self._h264: H264Decoder | None = None  # the session's H.264 stream, decoded in order
        self.session: SessionInfo | None = None
        #: Every ``input.dropped`` notice received, in order.
        self.dropped: list[Dropped] = []
        #: Every ``chunk.skipped`` notice received, as (from_seq, to_seq) inclusive ...
        self.skipped: list[tuple[int, int]] = []
        #: ... and this client's event ids that those skipped chunks applied, in order.
        self.skipped_applied: list[int] = []
        #: The last chunk seq received (what ``resume()`` tells the server); -1 before any.
        self.last_seq = -1
        #: Every ``session.queued`` notice of a ``start(queue=True)``, in order.
        self.queued: list[Queued] = []
        self._on_queued: Callable[[Queued], None] | None = None
        self._waiting_start: str | None = None  # the id of a start waiting in line
        #: Hears each part of a chunk as it comes (``start(parts=True)``), before the chunk; the chunk that
        #: follows holds its frames too (:attr:`ClientChunk.parted`). Called from the reader: keep it short.
        self.on_part: Callable[[ClientPart], None] | None = None
        self._parts: dict[int, list[ClientPart]] = {}  # seq -> the parts of a chunk not come yet

    # -- connection ----------------------------------------------------------------

    async def connect(self) -> None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            self._ws = await websockets.connect(
                self.url,
                additional_headers=headers,
                subprotocols=[websockets.Subprotocol("worldserve.v1")],
                open_timeout=self._open_timeout,
                max_size=16 * 1024 * 1024,
            )
        except websockets.InvalidStatus as error:
            raise WorldClientError(f"cannot connect to {self.url}: {self._refusal(error)}") from error
        except (OSError, websockets.InvalidHandshake, websockets.InvalidURI, TimeoutError) as error:
            reason = str(error) or type(error).__name__  # a TimeoutError says nothing
            raise WorldClientError(f"cannot connect to {self.url}: {reason}") from error
        self._reader = asyncio.create_task(self._read(), name="worldclient-reader")

    def _refusal(self, error: websockets.InvalidStatus) -> str:
        """Why the server refused the handshake and what to fix, from its status and JSON error
        (docs/protocol.md): the token (401), the origin (403), the path (404)."""
        status = error.response.status_code
        said = ""
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            said = str(json.loads(error.response.body or b"")["error"]["message"])
        if status == 401:
            if self._token:
                return "the server refused this token (HTTP 401): give the token the server was started with (--token)"
            return "the server needs a token (HTTP 401): give the one it was started with (--token)"
        if status == 403 and said:
            return f"the server refused the connection (HTTP 403): {said}"
        if status == 403:  # a server that says no more (an older worldserve, a proxy)
            return (
                "the server refused the WebSocket handshake (HTTP 403): a missing or wrong token, a refused "
                "origin, or no WebSocket endpoint at this path (worldserve's is /v1/world)"
            )
        if status == 404:
            where = said.rstrip(".") if said else "no WebSocket endpoint at this path"
            return f"{where} (HTTP 404): check the URL (worldserve's is /v1/world)"
        return f"the server refused the WebSocket handshake (HTTP {status}){': ' + said if said else ''}"

    async def __aenter__(self) -> WorldClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.disconnect()

    async def disconnect(self) -> None:
        """Close the connection cleanly (the server releases the session as on ``close``)."""
        if self._ws is not None:
            await self._ws.close()
        await self._stop_reader()

    async def drop(self) -> None:
        """Lose the connection abruptly, as a network failure would (no close handshake).

        The server parks the session for its resume grace period; :meth:`resume` takes it back.
        """
        if isinstance(self._ws, ClientConnection):
            self._ws.transport.abort()
        await self._stop_reader()

    async def _stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        self._ws = self._reader = None
        # Drop the end-of-connection marker: a resume goes on with the same queue of chunks.
        kept = []
        while not self._chunks.empty():
            item = self._chunks.get_nowait()
            if item is not _CLOSED:
                kept.append(item)
        for item in kept:
            self._chunks.put_nowait(item)

    async def resume(
        self,
        session: SessionInfo | None = None,
        *,
        last_seq: int | None = None,
        keyframe: bool | None = None,
        media: str | None = None,
    ) -> SessionInfo:
        """Reconnect and take this client's session back after :meth:`drop` (or a lost connection).

        Chunks after the last one received are re-sent (a ``chunk.skipped`` notice in
        :attr:`skipped` names any the server no longer had); event ids go on as before.
        ``session`` (with ``last_seq``, the last chunk seq it got) takes over one that another
        client had: a restarted process that kept its :class:`SessionInfo`, another device.
        ``keyframe``: ask for the H.264 stream to start again at an IDR frame with its init
        segment (``None``: when this client has no decoder state for an h264 session, which a
        client taking a session over never has); the chunks before it come as ``chunk.skipped``.
        A client taking a session over numbers its events from 1: ids the earlier client used are
        ``stale_event`` or ``duplicate``, so pass ``event_id`` above them to :meth:`send_event`.
        ``media``: be sent "raw", "jpeg" or "h264" from now on (``None``: as before).
        Raises :class:`WorldError` ``resume_refused`` once the grace period is over.
        """
        if session is not None:
            self.session = session
            self._h264 = None
            if last_seq is not None:
                self.last_seq = last_seq
        info = self.session
        if info is None or info.resume_token is None:
            raise WorldClientError("no resumable session (start or join one; the server may have resume off).")
        if media is not None and media != info.media:
            self._h264 = None  # another media: an H.264 stream starts over for this client
        if keyframe is None:
            keyframe = (media or info.media) == "h264" and (self._h264 is None or not self._h264.ready)
        if self._ws is not None:
            await self.drop()
        await self.connect()
        message: dict[str, Any] = {
            "type": "session.resume",
            "session_id": info.session_id,
            "token": info.resume_token,
            "last_seq": self.last_seq,
        }
        if keyframe:
            message["keyframe"] = True
        if media is not None:
            message["media"] = media
        reply = await self._follow(message)
        self.session = replace(info, role=reply["role"], media=reply["media"])
        return self.session

    async def join(self, session_id: str, token: str, *, role: str = "viewer", media: str | None = None) -> SessionInfo:
        """Open a shared world (``role``: ``viewer`` or ``controller``) with a token from its host;
        ``media``: be sent "raw", "jpeg" or "h264" (``None``: the world's media, its host's)."""
        message: dict[str, Any] = {"type": "session.join", "session_id": session_id, "token": token, "role": role}
        if media is not None:
            message["media"] = media
        reply = await self._follow(message)
        self.last_seq = int(reply["seq"])
        self.session = SessionInfo(
            session_id=reply["session_id"],
            model=reply["model"],
            media=reply["media"],
            max_pending_events=reply["max_pending_events"],
            max_lag_chunks=reply["max_lag_chunks"],
            lead_chunks=int(reply.get("lead_chunks", 1)),  # a server before the field made a chunk ahead
            role=reply["role"],
            resume_token=reply.get("resume_token"),
            resume_grace_s=reply.get("resume_grace_s"),
        )
        return self.session

    # -- requests ------------------------------------------------------------------

    async def _move(self, url: str) -> None:
        """Leave this connection (it holds no session: a clean close) for one to ``url``."""
        await self.disconnect()
        self.url = url
        await self.connect()

    async def _follow(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send a ``session.resume`` or ``session.join`` and return its reply; where the world lives on
        another front-end of the service (``session.moved``), connect there (:attr:`url` becomes its
        URL, the token goes along) and send it again."""
        reply = await self._request(message)
        for _ in range(_MAX_MOVES):
            if reply["type"] != "session.moved":
                return reply
            await self._move(str(reply["url"]))
            reply = await self._request(message)
        if reply["type"] == "session.moved":
            raise WorldClientError(
                f"session {message['session_id']} moved more than {_MAX_MOVES} times in a row (last to {reply['url']})."
            )
        return reply

    async def _request(self, message: dict[str, Any], *, wait: bool = True) -> dict[str, Any]:
        """Send ``message`` and return its reply (``wait=False``: however long it takes, for a start
        waiting in line, which the server's queue timeout bounds)."""
        if self._ws is None:
            raise WorldClientError("not connected; call connect() or use 'async with'.")
        message_id = f"c{next(self._ids)}"
        if not wait:
            self._waiting_start = message_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[message_id] = future
        try:
            await self._ws.send(json.dumps({**message, "id": message_id}))
            async with asyncio.timeout(self._reply_timeout if wait else None):
                reply = await future
        finally:
            self._replies.pop(message_id, None)
            if self._waiting_start == message_id:
                self._waiting_start = None
        if reply["type"] == "error":
            raise WorldError(reply["code"], reply["message"], reply.get("event_id"), reply.get("retry_after_ms"))
        if reply["type"] == "session.failed":
            raise SessionFailedError(reply["code"], reply["message"])
        return reply

    async def start(
        self,
        prompt: str | None = None,
        *,
        seed: int = 0,
        image: npt.NDArray[np.uint8] | bytes | None = None,
        references: Mapping[str, npt.NDArray[np.uint8] | bytes] | None = None,
        media: str = "raw",
        quality: int | None = None,
        bitrate_kbps: int | None = None,
        model: str | None = None,
        share_viewers: bool = False,
        share_controllers: bool = False,
        queue: bool = False,
        on_queued: Callable[[Queued], None] | None = None,
        parts: bool = False,
    ) -> SessionInfo:
        """Start this connection's session; ``image`` is an optional start image (an RGB array, or PNG,
        JPEG or raw RGB bytes); ``references``: a model's reference images by slot name (its spec's
        ``reference_slots``: all of them or none), each an RGB array or PNG/JPEG/raw RGB bytes.

        ``media``: "raw" (exact), "jpeg" or "h264" (decoded here either way); ``quality`` and, for
        h264, ``bitrate_kbps`` as in docs/protocol.md (``None``: the server's default for the media).
        ``share_viewers`` / ``share_controllers`` ask for tokens others can :meth:`join` with.
        ``queue``: when the server is full, wait in line until a slot opens (each position
        notice is appended to :attr:`queued` and passed to ``on_queued``) instead of raising
        ``admission_refused`` at once; the server refuses after its ``--queue-timeout-s``. Behind a
        balancer, the service's line may start it on another front-end (``session.moved``): the
        client connects there by itself (:attr:`url` becomes its URL) and starts with the reservation.
        ``parts``: take each chunk's frames in parts as the model makes them (JPEG or raw, a model whose
        spec says ``frame_parts``): :attr:`on_part` hears each, and the chunk still comes whole from
        :meth:`next_chunk`.
        """
        options: dict[str, Any] = {"media": media}
        if parts:
            options["parts"] = True
        if quality is not None:
            options["quality"] = quality
        if bitrate_kbps is not None:
            options["bitrate_kbps"] = bitrate_kbps
        message: dict[str, Any] = {"type": "session.start", "seed": seed, "options": options}
        if share_viewers or share_controllers:
            message["share"] = {"viewers": share_viewers, "controllers": share_controllers}
        if prompt is not None:
            message["prompt"] = prompt
        if model is not None:
            message["model"] = model
        if image is not None:
            message["image"] = _image_field(image)
        if references:
            message["references"] = {name: _image_field(picture) for name, picture in references.items()}
        if queue:
            message["queue"] = True
        self._on_queued = on_queued
        try:
            reply = await self._request(message, wait=not queue)
            for _ in range(_MAX_MOVES):  # the service's line placed this start on another front-end: go there
                if reply["type"] != "session.moved":
                    break
                await self._move(str(reply["url"]))
                reply = await self._request({**message, "reservation": reply["reservation"]}, wait=not queue)
            if reply["type"] == "session.moved":
                raise WorldClientError(f"the start moved more than {_MAX_MOVES} times in a row.")
        finally:
            self._on_queued = None
        self.session = SessionInfo(
            session_id=reply["session_id"],
            model=reply["model"],
            media=reply["media"],
            max_pending_events=reply["max_pending_events"],
            max_lag_chunks=reply["max_lag_chunks"],
            lead_chunks=int(reply.get("lead_chunks", 1)),  # a server before the field made a chunk ahead
            resume_token=reply.get("resume_token"),
            resume_grace_s=reply.get("resume_grace_s"),
            viewer_token=(reply.get("share") or {}).get("viewer"),
            controller_token=(reply.get("share") or {}).get("controller"),
            url=reply.get("url"),
        )
        return self.session

    async def send_event(
        self,
        *,
        prompt: str | None = None,
        controls: Sequence[ControlInput | dict[str, Any]] = (),
        event_id: int | None = None,
        transition_chunks: int | None = None,
    ) -> Acceptance:
        """Send one event and wait until the server accepted it (not yet applied).

        ``transition_chunks`` (with a prompt) blends the prompt change over that many chunks, for
        models that declare the ``prompt_transition`` control.
        """
        resolved = next(self._event_ids) if event_id is None else event_id
        message: dict[str, Any] = {
            "type": "input.event",
            "event_id": resolved,
            "controls": [c.to_dict() if isinstance(c, ControlInput) else dict(c) for c in controls],
        }
        if prompt is not None:
            message["prompt"] = prompt
        if transition_chunks is not None:
            message["transition_chunks"] = transition_chunks
        reply = await self._request(message)
        return Acceptance(event_id=reply["event_id"], status=reply["status"], pending=reply["pending"])

    async def reset(self) -> int:
        """Reset the session (also after a failure); returns the new epoch."""
        reply = await self._request({"type": "session.reset"})
        self._epoch = int(reply["epoch"])
        return self._epoch

    async def cancel_chunk(self) -> int:
        """Cancel the chunk being made; returns its ``chunk_index`` (the next chunk sent has that index).

        The session stays at its last chunk; its events stay queued for the next one.
        Raises :class:`WorldError` ``nothing_to_cancel`` (no chunk in flight) or
        ``cancel_unsupported`` (the model cannot roll back; the chunk arrives as usual).
        """
        reply = await self._request({"type": "chunk.cancel"})
        return int(reply["chunk_index"])

    async def ping(self) -> float:
        """Round-trip time in seconds."""
        started = time.perf_counter()
        await self._request({"type": "ping"})
        return time.perf_counter() - started

    async def close(self) -> None:
        """Close the session (the server answers with any dropped events), then the socket.

        A ``start(queue=True)`` still waiting in line leaves it: that start raises
        :class:`WorldClientError`.
        """
        waiting = self._waiting_start
        if self._ws is not None and (self.session is not None or waiting is not None):
            with contextlib.suppress(WorldError, WorldClientError):
                await self._request({"type": "session.close"})
            self.session = None
            start = None if waiting is None else self._replies.get(waiting)
            if start is not None and not start.done():
                start.set_exception(WorldClientError("left the waiting line: close() withdrew the start."))
        await self.disconnect()

    # -- chunks --------------------------------------------------------------------

    async def next_chunk(self, timeout: float | None = None) -> ClientChunk:
        """The next chunk of the current epoch; acknowledges it to the server (unless ``auto_ack`` is off)."""
        while True:
            item: ClientChunk | BaseException | object
            if self._taken is not None:  # a call cancelled while acking it: hand it over now
                item, self._taken = self._taken, None
            else:
                # Not asyncio.wait_for: on 3.11 it swallows a cancel that lands as the item arrives
                # (a caller's task then never stops); under asyncio.timeout the item stays queued.
                async with asyncio.timeout(timeout):
                    item = await self._chunks.get()
            if item is _CLOSED:
                self._chunks.put_nowait(_CLOSED)
                raise WorldClientError("connection closed.")
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, ClientChunk)
            if self.auto_ack:
                try:
                    await self.ack(item.seq)
                except asyncio.CancelledError:
                    self._taken = item  # not lost: the next call returns it (a repeated ack is ignored)
                    raise
            if item.epoch >= self._epoch:
                return item

    async def ack(self, seq: int) -> None:
        """Tell the server chunk ``seq`` is playing (its first frame shown); a closed socket is ignored."""
        if self._ws is not None:
            with contextlib.suppress(websockets.ConnectionClosed, ConnectionError):
                await self._ws.send(json.dumps({"type": "chunk.ack", "seq": seq}))

    async def chunks(self) -> AsyncIterator[ClientChunk]:
        """Chunks as they arrive, until the connection closes; a failure raises."""
        while True:
            try:
                yield await self.next_chunk()
            except WorldClientError:
                return

    # -- reading -------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for raw in self._ws:
                if isinstance(raw, bytes):
                    raise WorldClientError("binary message without a chunk header.")
                message = json.loads(raw)
                kind = message.get("type")
                if kind == "chunk":
                    chunk = await self._read_chunk(message)
                    if chunk is not None:  # None: its frames come apart (WebRTC), and it is delivered then
                        self._deliver(chunk)
                elif kind == "chunk.part":
                    self._take_part(message, *(await self._read_payloads(message["frames"])))
                elif kind == "chunk.skipped":
                    self.skipped.append((message["from_seq"], message["to_seq"]))
                    self.skipped_applied.extend(message.get("applied_event_ids", ()))
                    self.last_seq = max(self.last_seq, message["to_seq"])
                elif kind == "input.dropped":
                    self.dropped.append(
                        Dropped(tuple(message["event_ids"]), message["reason"], message.get("detail", ""))
                    )
                elif kind == "session.queued":
                    queued = Queued(message["position"], message["ahead"], message["eta_s"], time.monotonic())
                    self.queued.append(queued)
                    if self._on_queued is not None:
                        self._on_queued(queued)
                elif message.get("id") in self._replies:
                    future = self._replies[message["id"]]
                    if not future.done():
                        future.set_result(message)
                elif kind == "session.closed":  # not ours to close: the host ended the world
                    self.session = None
                    self._chunks.put_nowait(WorldClientError(f"session closed ({message.get('reason')})."))
                elif kind == "session.failed":
                    self._chunks.put_nowait(SessionFailedError(message["code"], message["message"]))
                elif kind == "error":
                    self._chunks.put_nowait(WorldError(message["code"], message["message"], message.get("event_id")))
        except websockets.ConnectionClosed:
            pass
        except WorldClientError as error:
            self._chunks.put_nowait(error)
        finally:
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(WorldClientError("connection closed before the reply."))
            self._chunks.put_nowait(_CLOSED)

    def _deliver(self, chunk: ClientChunk) -> None:
        self.last_seq = max(self.last_seq, chunk.seq)
        self._chunks.put_nowait(chunk)

    def _take_part(self, header: dict[str, Any], frames: npt.NDArray[np.uint8], arrived_at: float) -> None:
        seq, first = header["seq"], header["first"]
        part = ClientPart(seq, header["epoch"], header["chunk_index"], first, frames, time.monotonic(), arrived_at)
        if first == 0:
            self._parts[seq] = [part]  # a chunk made again after its first parts went starts over
        else:
            held = self._parts.get(seq)
            if held is None or sum(len(p.frames) for p in held) != first:
                raise WorldClientError(f"chunk {seq}'s part from frame {first} does not follow the ones before.")
            held.append(part)
        if self.on_part is not None:
            self.on_part(part)

    async def _read_chunk(self, header: dict[str, Any]) -> ClientChunk | None:
        seq, info = header["seq"], header["frames"]
        sent = int(info.get("sent") or 0)
        rest, arrived_at = await self._read_payloads(info)
        held = self._parts.pop(seq, [])
        for old in [old for old in self._parts if old < seq]:
            del self._parts[old]  # parts of chunks that never came (a failure, a chunk made again)
        frames = rest
        if sent:
            if sum(len(part.frames) for part in held) != sent:
                raise WorldClientError(f"chunk {seq} says {sent} frames came in parts; they did not.")
            frames = np.concatenate([*(part.frames for part in held), rest])
        chunk = ClientChunk.from_header(header, frames, received_at=time.monotonic(), arrived_at=arrived_at)
        if not sent:
            return chunk
        return replace(chunk, parted=sent, first_part_arrived_at=held[0].arrived_at, first_part_at=held[0].received_at)

    async def _read_payloads(self, info: dict[str, Any]) -> tuple[npt.NDArray[np.uint8], float]:
        """The binary messages that follow a header (``info``: its ``frames``), decoded, and when the last of
        them arrived (time.monotonic(), before decoding)."""
        assert self._ws is not None
        payloads = []
        for _ in range(len(info["sizes"])):
            payload = await self._ws.recv()
            if not isinstance(payload, bytes):
                raise WorldClientError("expected a binary frame after a chunk header.")
            payloads.append(payload)
        arrived_at = time.monotonic()
        height, width = info["height"], info["width"]
        if not payloads:
            frames = np.zeros((0, height, width, 3), np.uint8)
        elif info["media"] == "raw":
            frames = np.stack([np.frombuffer(p, dtype=np.uint8).reshape(height, width, 3) for p in payloads])
        elif info["media"] == "h264":
            frames = await asyncio.to_thread(self._decode_h264, payloads[0], int(info.get("init_bytes") or 0))
        else:
            frames = await asyncio.to_thread(_decode_jpegs, payloads)
        return frames, arrived_at

    def _decode_h264(self, payload: bytes, init_bytes: int) -> npt.NDArray[np.uint8]:
        if self._h264 is None or init_bytes:
            self._h264 = self._h264 or H264Decoder()
        try:
            return self._h264.decode(payload[init_bytes:], payload[:init_bytes])
        except ValueError as error:
            raise WorldClientError(f"undecodable h264 chunk: {error}") from error


def _decode_jpegs(payloads: list[bytes]) -> npt.NDArray[np.uint8]:
    return np.stack([np.asarray(Image.open(io.BytesIO(p)).convert("RGB"), dtype=np.uint8) for p in payloads])
