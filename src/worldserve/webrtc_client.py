"""``WebRTCWorldClient``: the Python client over WebRTC (``POST /v1/webrtc``) instead of a WebSocket.

The session protocol travels on a data channel as the same JSON messages, so every verb of
:class:`~worldserve.client.WorldClient` works unchanged; only the frames come apart, on a video track that aiortc
decodes. Each chunk's frames are told by their RTP timestamps: the server sends ``chunk.track {seq, rtp}`` as a
chunk's first frame goes out, and every frame from that timestamp until the next chunk's is that chunk's. A chunk
is handed over (:meth:`~worldserve.client.WorldClient.next_chunk`) once its frames are in, or once a later chunk's
frame shows that the rest were dropped (the server drops the oldest unsent frames of a peer that falls behind,
latency first): its ``frames`` are those shown, maybe fewer than its header's count or none, and ``received_at``
is when its first frame was decoded (when a WebRTC player shows it: frames come already paced).

Owns: the peer connection, its signalling (an HTTP offer and answer, ``DELETE`` to leave) and the frames' chunks.
Must not know: the protocol's messages beyond ``chunk`` and ``chunk.track`` (the base client's).
Needs the ``client`` and ``webrtc`` extras.

    async with WebRTCWorldClient("ws://127.0.0.1:8000/v1/world", token=TOKEN) as client:
        await client.start(prompt="snowy peaks")
        chunk = await client.next_chunk()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from email.message import Message
from typing import Any

import numpy as np
import numpy.typing as npt

from worldserve.client import ClientChunk, WorldClient, WorldClientError
from worldserve.fast_channel import FAST_LABEL, ChannelMerge, send_copy
from worldserve.ice import IceServer, parse_ice_links, parse_ice_server
from worldserve.sctp_timers import use_libwebrtc_timers

__all__ = ["WebRTCWorldClient", "webrtc_url"]

_WRAP = 2**32
#: Frames decoded before the ``chunk.track`` that names them are kept this long for it.
_KEEP_UNTOLD_S = 2.0
#: A chunk is handed over this long after its header at the latest, with the frames that came (maybe none).
_GIVE_UP_S = 2.0
#: A frame whose chunk could still be a later one (its chunk.track on its way) waits this long for it: as long as
#: the TypeScript client's ``HOLD_MS`` (a chunk.track a loaded box delays past 250 ms named a frame's chunk wrongly).
_HOLD_S = 1.0
#: No frame decoded this long while a chunk waits for its frames: a packet is missing still (aiortc's receiver
#: NACKs each once, so a lost NACK or a lost resend leaves a hole that holds every later frame until 128 packets
#: came behind it). Ask again for what is missing, and for a keyframe, as a browser's receiver does; again at
#: most this often.
_STALL_S = 0.25
#: A message longer than this goes in pieces of this size (a peer takes 64 KiB at least; Chromium 256 KiB).
_PIECE_BYTES = 64 * 1024


def webrtc_url(world_url: str) -> str:
    """The ``/v1/webrtc`` endpoint of the front-end whose ``/v1/world`` URL is ``world_url``."""
    base = world_url.removesuffix("/v1/world")
    return base.replace("wss://", "https://", 1).replace("ws://", "http://", 1) + "/v1/webrtc"


#: RTP timestamps this close are one frame's: aiortc's decoder gives a frame's timestamp back a tick off at times
#: (90 ticks is 1 ms; frames are at least 8 ms apart).
_SAME_TICKS = 90


def _after(a: int, b: int) -> bool:
    """RTP timestamp ``a`` is at or after ``b`` (32-bit, wrapping; within :data:`_SAME_TICKS` is the same)."""
    return (a - b + _SAME_TICKS) % _WRAP < _WRAP // 2


def _same(a: int, b: int) -> bool:
    return _after(a, b) and _after(b, a)


def _http(method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Message, str]:
    """(status, the reply's headers, its body); an HTTP error status is returned, not raised."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def _ice_servers_told(url: str, headers: dict[str, str]) -> list[IceServer]:
    """The ICE servers the endpoint tells (``OPTIONS``, ``Link`` headers: :func:`~worldserve.ice.parse_ice_links`);
    none when it tells none (a refusal, or a server from before ICE servers were told: 405) or cannot be asked."""
    try:
        status, replied, _ = _http("OPTIONS", url, None, headers)
    except OSError:
        return []
    return parse_ice_links(", ".join(replied.get_all("Link") or [])) if status < 300 else []


class _ChannelLink:
    """The data channel as the base client's message link; the peer connection's end ends it. A short message goes
    first as a copy on the fast channel (unordered, never resent), prefixed with its index among the main channel's
    messages: the server reads whichever copy comes first, in its place, once; and the server's copies are merged
    the same way here (:class:`~worldserve.fast_channel.ChannelMerge`)."""

    def __init__(self, pc: Any, channel: Any, fast: Any, resource: str, token: str | None) -> None:
        self.pc = pc
        self._channel = channel
        self._fast = fast
        self._sent = 0  # messages sent on the main channel so far
        self._resource = resource
        self._token = token
        self._inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self._closed = False
        #: The server's two channels merged, in order, once.
        self.merge = ChannelMerge()
        channel.on("message", lambda message: self._take(self.merge.main(message)))
        fast.on("message", lambda copy: self._take(self.merge.copy(copy)))
        channel.on("close", self._end)

        @pc.on("connectionstatechange")  # type: ignore[untyped-decorator]
        def changed() -> None:
            if pc.connectionState in ("failed", "closed"):
                self._end()

    def _take(self, read: list[str] | list[str | bytes]) -> None:  # what the merge read, in order
        if not self._closed:
            for message in read:
                self._inbox.put_nowait(message)

    def _end(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put_nowait(None)

    async def send(self, message: str) -> None:
        if self._closed or self._channel.readyState != "open":
            raise ConnectionError("the data channel is closed.")
        send_copy(self._fast, self._sent, message)
        data = message.encode()
        if len(data) <= _PIECE_BYTES:
            self._channel.send(message)
            self._sent += 1
            return
        # Longer than a data channel message may be (a start with its images): its bytes in binary pieces, then
        # an empty text that ends it (docs/protocol.md, "WebRTC").
        for start in range(0, len(data), _PIECE_BYTES):
            self._channel.send(data[start : start + _PIECE_BYTES])
            self._sent += 1
        self._channel.send("")
        self._sent += 1

    async def recv(self) -> str | bytes:
        message = await self._inbox.get()
        if message is None:
            self._inbox.put_nowait(None)
            raise ConnectionError("the data channel is closed.")
        return message

    async def __aiter__(self) -> AsyncIterator[str | bytes]:
        while True:
            try:
                yield await self.recv()
            except ConnectionError:
                return

    async def close(self) -> None:
        """Leave cleanly: ``DELETE`` the peer's resource (the server closes the session as on a socket's close)."""
        if self._resource:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_http, "DELETE", self._resource, None, headers)
        await self.abort()

    async def abort(self) -> None:
        """Lose the connection as a network would: the server parks the session for a resume."""
        self._end()
        with contextlib.suppress(Exception):
            await self.pc.close()


@dataclass
class _Shown:
    rtp: int
    at: float  # when it was decoded
    image: npt.NDArray[np.uint8] = field(repr=False)


class WebRTCWorldClient(WorldClient):
    """:class:`~worldserve.client.WorldClient` over WebRTC: the protocol on a data channel, frames on a video track.

    ``ack_on_show``: ack each chunk as its first frame is decoded, as a WebRTC player acks what it shows (off:
    leave it to :meth:`ack`, or to ``auto_ack`` as :meth:`next_chunk` hands it over). ``ice_servers``: STUN and
    TURN servers for this peer (:func:`~worldserve.ice.parse_ice_server`'s URLs; none: those the server tells, as
    WHEP clients ask, else host candidates only).
    """

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8000/v1/world",
        *,
        ack_on_show: bool = False,
        ice_servers: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(url, **kwargs)
        self.ack_on_show = ack_on_show
        self.ice_servers = tuple(parse_ice_server(server) for server in ice_servers)
        self._link: _ChannelLink | None = None
        self._frames_task: asyncio.Task[None] | None = None
        self._headers: dict[int, tuple[dict[str, Any], float]] = {}  # seq -> (header, when it came): not handed over
        self._marks: dict[int, int] = {}  # seq -> the RTP timestamp of its first frame (chunk.track)
        self._first: dict[int, int] = {}  # seq -> the index in the chunk of its first frame on the track
        self._held: list[_Shown] = []  # decoded frames whose chunk cannot be told yet
        self._shown: dict[int, list[_Shown]] = {}  # seq -> its frames decoded
        self._handed = -1  # the last seq handed over
        self._acking: set[asyncio.Task[None]] = set()
        #: Frames decoded on the track, and those of them told to no chunk (none named them in time, or they came
        #: after their chunk was handed over).
        self.frames_decoded = 0
        self.frames_unnamed = 0
        #: Frames told their chunk when their hold ran out (not sure: no later chunk.track came in time).
        self.frames_guessed = 0
        #: Times the track stalled while chunks waited for their frames (each asked again for the missing packets
        #: and for a keyframe).
        self.stalls = 0

    @property
    def fast_taken(self) -> int:
        """Messages of this connection read from the server's fast copies (their main copy was passed over)."""
        return self._link.merge.taken if self._link is not None else 0

    async def connect(self) -> None:
        import aiortc  # the webrtc extra

        from worldserve.webrtc_receiver import use_live_frames

        use_libwebrtc_timers()  # a lost packet holds the data channel 220 ms, not aiortc's 1 s (sctp_timers.py)
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        url = webrtc_url(self.url)
        told = list(self.ice_servers) or await asyncio.to_thread(_ice_servers_told, url, headers)  # none: the server's
        servers = [aiortc.RTCIceServer(s.url, s.username, s.credential) for s in told]
        pc = aiortc.RTCPeerConnection(aiortc.RTCConfiguration(iceServers=servers))
        channel = pc.createDataChannel("worldserve")
        fast = pc.createDataChannel(FAST_LABEL, ordered=False, maxRetransmits=0)  # copies of short messages
        use_live_frames(pc.addTransceiver("video", direction="recvonly").receiver)  # no frame waits for the next
        opened = asyncio.Event()
        channel.on("open", opened.set)
        track: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        @pc.on("track")
        def arrived(received: Any) -> None:
            if not track.done():
                track.set_result(received)

        headers["Content-Type"] = "application/sdp"
        try:
            await pc.setLocalDescription(await pc.createOffer())
            status, replied, answer = await asyncio.to_thread(
                _http, "POST", url, pc.localDescription.sdp.encode(), headers
            )
            location = replied.get("Location", "")
            if status != 201:
                raise WorldClientError(f"cannot connect to {url}: HTTP {status}: {_said(answer)}")
            await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=answer, type="answer"))
            async with asyncio.timeout(self._open_timeout):
                await opened.wait()
                video = await track
        except (OSError, TimeoutError) as error:
            await pc.close()
            raise WorldClientError(f"cannot connect to {url}: {error or type(error).__name__}") from error
        except BaseException:
            await pc.close()
            raise
        resource = urllib.parse.urljoin(url, location) if location else ""
        self._link = _ChannelLink(pc, channel, fast, resource, self._token)
        channel.on("message", self._told)  # chunk.track, read as it comes (the reader may wait behind a reply)
        self._ws = self._link
        self._reader = asyncio.create_task(self._read(), name="worldclient-reader")
        self._frames_task = asyncio.create_task(self._read_frames(pc, video), name="worldclient-frames")

    async def drop(self) -> None:
        if self._link is not None:
            await self._link.abort()
        await self._stop_reader()

    async def _stop_reader(self) -> None:
        if self._frames_task is not None:
            self._frames_task.cancel()
            with contextlib.suppress(BaseException):
                await self._frames_task
            self._frames_task = None
        self._tell(final=True)
        self._hand_over(every=True)  # what the connection brought is handed over, frames or not
        self._link = None
        self._marks.clear()
        self._first.clear()
        self._held.clear()
        self._shown.clear()
        await super()._stop_reader()

    # -- chunks and their frames ---------------------------------------------------

    async def _read_chunk(self, header: dict[str, Any]) -> ClientChunk | None:
        seq = int(header["seq"])
        superseded = header.get("supersedes")
        if superseded is not None and superseded in self._headers:
            self._hand_over(through=superseded)  # it never plays on: over with the frames it showed
        if seq > self._handed:
            self._headers[seq] = (header, time.monotonic())
        self._hand_over()
        return None

    def _told(self, text: str | bytes) -> None:
        if not isinstance(text, str) or not text.startswith('{"type":"chunk.track"'):
            return
        message = json.loads(text)
        self._marks[int(message["seq"])] = int(message["rtp"]) % _WRAP
        self._first[int(message["seq"])] = int(message.get("frame", 0))
        self._tell()
        self._hand_over()

    async def _read_frames(self, pc: Any, video: Any) -> None:
        receiver = next(t.receiver for t in pc.getTransceivers() if t.kind == "video")
        while True:
            try:
                async with asyncio.timeout(_STALL_S):
                    frame = await video.recv()
            except TimeoutError:
                if self._headers:  # a chunk waits for frames that do not come
                    await _ask_again(receiver)
                    self.stalls += 1
                self._tell()
                self._hand_over()
                continue
            except Exception:  # the track ended with its peer connection
                return
            at = time.monotonic()
            self.frames_decoded += 1
            self._held.append(_Shown(_rtp_of(receiver, int(frame.pts)), at, frame.to_ndarray(format="rgb24")))
            self._tell()
            self._hand_over()

    def _tell(self, *, final: bool = False) -> None:
        """Tell the held frames' chunks where that can be told: a frame is the chunk's whose first frame's RTP
        timestamp is the latest at or before its own, once no chunk.track still on its way could name a later one
        (its own timestamp is named, or a later one is), or once it is held longer than a chunk.track could be late
        (``final``: now, a connection ending)."""
        now = time.monotonic()
        held, self._held = self._held, []
        for shown in held:
            seq = self._chunk_of(shown.rtp)
            if seq is None:
                if not final and now - shown.at < _KEEP_UNTOLD_S:
                    self._held.append(shown)
                else:
                    self.frames_unnamed += 1
                continue
            mark = self._marks[seq]
            sure = _same(shown.rtp, mark) or any(
                _after(other, shown.rtp) and not _same(other, shown.rtp) for other in self._marks.values()
            )
            if not sure and not final and now - shown.at < _HOLD_S:
                self._held.append(shown)
                continue
            if seq <= self._handed:
                self.frames_unnamed += 1
                continue
            if not sure:
                self.frames_guessed += 1
            frames = self._shown.setdefault(seq, [])
            frames.append(shown)
            if len(frames) == 1 and self.ack_on_show:
                self._ack_soon(seq)

    def _chunk_of(self, rtp: int) -> int | None:
        found = None
        for seq, first in self._marks.items():
            if _after(rtp, first) and (found is None or _after(first, self._marks[found])):
                found = seq
        return found

    def _ack_soon(self, seq: int) -> None:
        task = asyncio.ensure_future(self.ack(seq))
        self._acking.add(task)
        task.add_done_callback(self._acking.discard)

    def _hand_over(self, *, every: bool = False, through: int | None = None) -> None:
        """Hand over, in seq order, the chunks that are done: their frames all in, passed by a newer chunk's
        frame, or none come for too long (``every``: all of them; ``through``: up to this seq)."""
        now = time.monotonic()
        newest_shown = max(self._shown, default=-1)
        for seq in sorted(self._headers):
            header, since = self._headers[seq]
            frames = self._shown.get(seq, [])
            done = (
                every
                or (through is not None and seq <= through)
                or len(frames) >= int(header["frames"]["count"])
                or newest_shown > seq
                or now - since > _GIVE_UP_S
            )
            if not done:
                return
            del self._headers[seq]
            self._shown.pop(seq, None)
            for older in [s for s in self._marks if s < seq]:
                del self._marks[older]  # no frame is told to it again: a later chunk's mark is at or before them
                self._first.pop(older, None)
            self._handed = max(self._handed, seq)
            if not frames and self.ack_on_show:
                self._ack_soon(seq)  # nothing of it to show: acked as it is passed over, as the page does
            self._deliver(self._chunk(header, frames, now, self._first.pop(seq, 0)))

    def _chunk(self, header: dict[str, Any], shown: list[_Shown], now: float, first: int) -> ClientChunk:
        info = header["frames"]
        frames = (
            np.stack([frame.image for frame in shown])
            if shown
            else np.zeros((0, int(info["height"]), int(info["width"]), 3), np.uint8)
        )
        at = shown[0].at if shown else now
        return ClientChunk.from_header(header, frames, received_at=at, arrived_at=at, first_frame=first)


async def _ask_again(receiver: Any) -> None:
    """NACK again every packet still missing and send a picture loss indication (RFC 4585), which aiortc's sender
    answers with the packets from its history and a keyframe (pinned aiortc: its receiver's own RTCP feedback)."""
    nacks = getattr(receiver, "_RTCRtpReceiver__nack_generator", None)
    missing = sorted(nacks.missing) if nacks is not None else []
    for source in receiver.getSynchronizationSources():
        with contextlib.suppress(Exception):  # a connection closing meanwhile
            if missing:
                await receiver._send_rtcp_nack(source.source, missing)
            await receiver._send_rtcp_pli(source.source)


def _rtp_of(receiver: Any, pts: int) -> int:
    """A received frame's RTP timestamp: aiortc's receiver gives ``pts`` from the first frame's timestamp, whose
    value it keeps (pinned aiortc; the client's test of chunk attribution fails if that changes)."""
    origin = int(receiver._RTCRtpReceiver__timestamp_mapper._origin or 0)
    return (pts + origin) % _WRAP


def _said(body: str) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(json.loads(body)["error"]["message"])
    return body[:200]
