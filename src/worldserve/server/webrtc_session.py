"""A whole session over WebRTC: the ``/v1/world`` protocol on a DataChannel, the frames on a video track.

``POST /v1/webrtc`` (the server's bearer token, as on every route) with an SDP offer that holds a data
channel (reliable and ordered: the default) and a video section answers ``201 Created`` with the SDP
answer and the peer's resource in ``Location``; ``DELETE`` on it closes the connection cleanly. The
data channel carries the same JSON messages as ``/v1/world``, both ways, so every feature of that
route is here too (the waiting line, resume, sharing, cancel, recording): the connection behind it *is*
the route's :class:`~worldserve.server.connection.Connection`, reading and writing a
:class:`DataChannelSocket` instead of a WebSocket. Only the frames travel apart: each chunk's header
goes on the data channel as on a WebSocket (``seq``, applied events, ``times``), its frames to the
video track (aiortc encodes them: one encode per peer), so a session here is always sent raw frames
(``media`` in ``session.start``, ``join`` and ``resume`` is taken as ``raw``). A peer connection that
fails parks its member as a dropped socket does: ``session.resume`` on a new peer takes the world back.

A message larger than one data channel message may be (Chromium sends at most 256 KiB: a ``session.start``
with its images may be larger) comes in pieces: its UTF-8 bytes as binary messages, in order, then an empty
text message that ends it. The socket joins them into the one text message the connection reads, holding at
most ``max_message_bytes`` (over that, the pieces are dropped as they come and the connection answers
``message_too_large``).

A lost packet holds a reliable, ordered channel until it is resent (a retransmission timeout: 220 ms at least),
and every message behind it with it. So a client may open a second channel, labelled ``worldserve.fast``,
unordered and never resent (:mod:`worldserve.fast_channel`), and send on it, first, a copy of each short message
it sends on the main channel, prefixed with that message's index there. The socket merges the two into the one
ordered stream the connection reads, and sends the client the same way: a copy of each short message it sends
(chunk headers, ``chunk.track``, replies) goes first on that channel, so a lost packet holds neither direction.

Owns: :class:`DataChannelSocket` and :class:`WebRTCSessions` (offers, answers, leaves).
Must not know: what the messages mean (the connection's), how frames are made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from worldserve.fast_channel import FAST_LABEL, ChannelMerge, send_copy
from worldserve.server.messages import ChunkTrack, wire_json
from worldserve.server.webrtc import (
    MAX_OFFER_BYTES,
    FrameTrack,
    WhepError,
    answer_offer,
    peer_connection,
    track_class,
)

__all__ = ["DataChannelSocket", "WebRTCSessions"]

_log = logging.getLogger("worldserve.server")

#: The data channel's label a client opens (any label is taken; this one is the documented one).
CHANNEL_LABEL = "worldserve"


class DataChannelSocket:
    """A connection's socket over a WebRTC data channel (its JSON messages) and a video track (its frames)."""

    def __init__(self, track: FrameTrack, max_message_bytes: int) -> None:
        self._track = track
        self._max_message_bytes = max_message_bytes
        self._pieces: list[bytes] = []  # a long message's binary pieces so far
        self._pieces_bytes = 0
        self._incoming: asyncio.Queue[Mapping[str, Any]] = asyncio.Queue()
        self._channel: Any = None
        self._chunk: tuple[int, tuple[int, int, int], int, list[npt.NDArray[np.uint8]]] | None = None
        self.closed = False
        #: Told each chunk's seq as its first frame goes out on the track (``Connection.frames_started``).
        self.on_started: Callable[[int], None] = lambda seq: None
        #: The client's two channels merged: what the connection reads, in order, once.
        self.merge = ChannelMerge()
        self._fast_channel: Any = None  # the client's fast channel, where a copy of each short message goes first
        self._sent = 0  # messages sent on the main channel so far
        #: Copies sent to the client.
        self.fast_sent = 0

    @property
    def fast_taken(self) -> int:
        """Messages read from their fast copy (their main copy was passed over)."""
        return self.merge.taken

    @property
    def fast_unused(self) -> int:
        """Copies not used (late, malformed, or too many ahead of a gap)."""
        return self.merge.unused

    @property
    def attached(self) -> bool:
        return self._channel is not None

    def attach(self, channel: Any) -> None:
        self._channel = channel
        channel.on("message", self._received)
        channel.on("close", lambda: self.gone(clean=False))

    def attach_fast(self, channel: Any) -> None:
        """The client's second channel: copies of its main channel's messages, each ``"<index>:<message>"``; the
        server's copies go on it too."""
        self._fast_channel = channel
        channel.on("message", self._fast)

    def _fast(self, message: str | bytes) -> None:
        if self.closed:
            return
        for read in self.merge.copy(message):  # a copy is short and text: never a piece
            self._incoming.put_nowait({"type": "websocket.receive", "text": _raw_media(read)})

    def gone(self, *, clean: bool) -> None:
        """The peer is gone: cleanly (DELETE) or not (a failed connection: the member is parked)."""
        if not self.closed:
            self.closed = True
            self._incoming.put_nowait({"type": "websocket.disconnect", "code": 1000 if clean else 1006})

    def _received(self, message: str | bytes) -> None:
        read = self.merge.main(message)  # [] (read from its copy already), or this message and the copies it freed
        if read:
            self._read(message)  # text, a piece, or the empty text that ends pieces
        for text in read[1:]:  # copies: text
            self._incoming.put_nowait({"type": "websocket.receive", "text": _raw_media(str(text))})

    def _read(self, message: str | bytes) -> None:
        if isinstance(message, bytes):  # a piece of a long message (clients send no other binary)
            self._pieces_bytes += len(message)
            if self._pieces_bytes <= self._max_message_bytes:
                self._pieces.append(message)
            else:
                self._pieces.clear()  # over the limit: dropped as it comes, told at its end
            return
        if self._pieces_bytes:
            self._incoming.put_nowait(self._joined(ended=not message))
            if not message:
                return  # it ended them
        self._incoming.put_nowait({"type": "websocket.receive", "text": _raw_media(message)})

    def _joined(self, *, ended: bool) -> Mapping[str, Any]:
        """The pieces so far as the one message they make: its text when an empty text ended them; else binary,
        refused as binary is; or only its size, over the limit."""
        size, joined = self._pieces_bytes, b"".join(self._pieces)
        self._pieces, self._pieces_bytes = [], 0
        if size > self._max_message_bytes:
            return {"type": "websocket.receive", "oversize": size}
        if ended:
            with contextlib.suppress(UnicodeDecodeError):
                return {"type": "websocket.receive", "text": _raw_media(joined.decode())}
        return {"type": "websocket.receive", "bytes": joined}

    async def receive(self) -> Mapping[str, Any]:
        return await self._incoming.get()

    async def send_text(self, data: str) -> None:
        if self._channel is None or self.closed:
            raise ConnectionError("the data channel is closed.")
        if data.startswith('{"type":"chunk"'):
            header = json.loads(data)
            frames = header["frames"]
            shape = (frames["height"], frames["width"], 3)
            self._chunk = (header["seq"], shape, frames["count"], [])
            if header.get("supersedes") is not None:
                self._track.drop(header["supersedes"])
        self._send(data)

    def _send(self, text: str) -> None:
        """One message on the main channel, a copy on the fast channel first when it is short."""
        if send_copy(self._fast_channel, self._sent, text):
            self.fast_sent += 1
        self._channel.send(text)
        self._sent += 1

    def hold_chunk(self, seq: int) -> None:
        """Chunk ``seq`` is being undone: its frames wait on the track (``FrameTrack.hold``)."""
        self._track.hold(seq)

    def release_chunk(self, seq: int) -> None:
        self._track.release(seq)

    def track_told(self, seq: int, frame: int, rtp: int) -> None:
        """Chunk ``seq``'s first frame on the track (``frame``: its index in the chunk) went out with RTP timestamp
        ``rtp``: tell the client, so it can tell each frame's chunk (key-to-photon over WebRTC is measured as on
        the other routes)."""
        if self._channel is not None and not self.closed:
            with contextlib.suppress(Exception):  # a channel closing now: the connection learns it on its own
                self._send(wire_json(ChunkTrack(seq=seq, frame=frame, rtp=rtp)))

    async def send_bytes(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError("the data channel is closed.")
        chunk = self._chunk
        if chunk is None:
            return
        seq, shape, count, frames = chunk
        frames.append(np.frombuffer(data, np.uint8).reshape(shape))
        if len(frames) == count:
            self._chunk = None
            self._track.push(seq, frames)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.gone(clean=code in (1000, 1001))
        if self._channel is not None:
            with contextlib.suppress(Exception):
                self._channel.close()


def _raw_media(text: str) -> str:
    """Frames go on the video track, so a session here is sent raw frames whatever media it asks for."""
    try:
        message = json.loads(text)
    except ValueError:
        return text  # the connection says what is wrong with it
    if not isinstance(message, dict):
        return text
    kind = message.get("type")
    if kind == "session.start" and isinstance(message.get("options", {}), dict):
        message["options"] = {**message.get("options", {}), "media": "raw"}
    elif kind in ("session.join", "session.resume"):
        message["media"] = "raw"
    else:
        return text
    return json.dumps(message)


@dataclass
class _Peer:
    resource: str
    pc: Any
    socket: DataChannelSocket


class WebRTCSessions:
    """The WebRTC peers of one server, each a connection of the session protocol."""

    def __init__(
        self,
        serve: Callable[[DataChannelSocket], Awaitable[None]],
        fps: Callable[[], float],
        *,
        ice_servers: Sequence[str] = (),
        frames: Callable[[], int],
        max_message_bytes: int,
    ) -> None:
        self._serve = serve
        self._max_message_bytes = max_message_bytes
        self._fps = fps
        self._frames = frames
        self._ice_servers = tuple(ice_servers)
        self._peers: dict[str, _Peer] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._peers)

    async def offer(self, sdp: str) -> tuple[str, str]:
        """Answer an offer: its resource id and the SDP answer (``WhepError`` when refused)."""
        if len(sdp.encode()) > MAX_OFFER_BYTES or "m=application" not in sdp or "m=video" not in sdp:
            raise WhepError(400, "bad_offer", "the offer must hold a data channel (m=application) and video (m=video).")

        socket: DataChannelSocket

        def started(seq: int) -> None:
            socket.on_started(seq)

        def told(seq: int, frame: int, rtp: int) -> None:
            socket.track_told(seq, frame, rtp)

        # The client acks on the channel as it shows a chunk; as each chunk's first frame goes out, the track tells
        # the client its RTP timestamp and the connection that the chunk can no longer be replaced.
        track = track_class()(self._fps(), self._frames(), started, told)
        socket = DataChannelSocket(track, self._max_message_bytes)
        pc = peer_connection(self._ice_servers)
        resource = secrets.token_urlsafe(16)
        peer = self._peers[resource] = _Peer(resource, pc, socket)

        @pc.on("datachannel")  # type: ignore[untyped-decorator]
        def opened(channel: Any) -> None:
            if channel.label == FAST_LABEL:
                socket.attach_fast(channel)
                return
            if socket.attached:
                return  # one channel a peer: the protocol's
            socket.attach(channel)
            task = asyncio.ensure_future(self._run(peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        @pc.on("connectionstatechange")  # type: ignore[untyped-decorator]
        async def changed() -> None:
            if pc.connectionState in ("failed", "closed"):
                socket.gone(clean=False)  # as a dropped socket: the member is parked for a resume

        try:
            answer = await answer_offer(pc, sdp, track)
        except Exception as error:
            self._peers.pop(resource, None)
            with contextlib.suppress(Exception):
                await pc.close()
            raise WhepError(400, "bad_offer", f"the offer could not be answered: {error}") from error
        return resource, answer

    async def leave(self, resource: str) -> None:
        peer = self._peers.get(resource)
        if peer is None:
            raise WhepError(404, "unknown_resource", "no such WebRTC peer on this server.")
        peer.socket.gone(clean=True)
        await self._close(peer)

    async def aclose(self) -> None:
        for peer in list(self._peers.values()):
            peer.socket.gone(clean=True)
            await self._close(peer)
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _run(self, peer: _Peer) -> None:
        try:
            await self._serve(peer.socket)
        except Exception:
            _log.exception("the WebRTC connection %s failed", peer.resource)
        finally:
            await self._close(peer)

    async def _close(self, peer: _Peer) -> None:
        if self._peers.pop(peer.resource, None) is None:
            return
        with contextlib.suppress(Exception):
            await peer.pc.close()
