"""WebRTC for viewers, signalled as WHEP: a world's frames as a video track to any WHEP player.

``POST /v1/whep/{session_id}`` with a share token of the world as its bearer token and an SDP offer
(``application/sdp``) answers ``201 Created`` with the SDP answer and the viewer's resource in
``Location``; ``DELETE`` on that resource leaves. Signalling is not trickled: the answer carries every
candidate (host candidates; STUN/TURN servers from ``--ice-server`` for real networks). Each peer
connection is one *viewer* member of the world (:class:`~worldserve.server.host.WorldHost`). When the
offer takes H.264 (``--whep-media auto``, the default), the member is sent the world's own H.264 stream,
encoded once for all its H.264 members (WebSocket and WebRTC alike), and aiortc only packetises it; else
(or with ``raw``) it is sent raw frames, which aiortc encodes for this peer alone (VP8 or H.264).

Latency first: the track holds at most ``max_frames`` frames not yet sent and drops the oldest when a
newer one comes (a viewer behind never falls further behind); encoded frames depend on those before
them, so there it drops up to the newest IDR frame it holds, or all of them, then waits for an IDR frame
and asks the world for one (as it does when the peer reports a lost picture: RTCP PLI or FIR). It plays
them at the model's frame rate and acks each chunk as its first frame goes out, as a player acks what it
shows, so the world's pacing and a lagging viewer's skipping work as for WebSocket viewers.

Owns: :class:`FrameTrack` (the video track), :class:`WhepViewer` (the member's outlet), :class:`WhepPeers`
(the offers, answers and leaves of one server, and their errors).
Must not know: how frames are made, the WebSocket protocol's messages beyond the chunk's header.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from worldserve.h264 import AccessUnit, access_units
from worldserve.ice import parse_ice_server
from worldserve.playout_delay import use_zero_playout_delay
from worldserve.sctp_timers import use_libwebrtc_timers
from worldserve.server.host import Member, Role, WorldHost, WorldHosts
from worldserve.server.messages import ChunkMessage, SessionClosed, SessionFailed

__all__ = [
    "MAX_OFFER_BYTES",
    "FrameTrack",
    "WhepError",
    "WhepPeers",
    "WhepViewer",
    "answer_offer",
    "load_aiortc",
    "offers_h264",
    "peer_connection",
    "track_class",
    "whep_url",
]

_log = logging.getLogger("worldserve.server")

#: An SDP offer larger than this is refused (a real one is a few kB).
MAX_OFFER_BYTES = 64 * 1024
_CLOCK_RATE = 90_000


def whep_url(world_url: str, session_id: str) -> str:
    """The WHEP endpoint of ``session_id`` on the front-end whose ``/v1/world`` URL is ``world_url``."""
    base = world_url.removesuffix("/v1/world")
    return base.replace("wss://", "https://", 1).replace("ws://", "http://", 1) + f"/v1/whep/{session_id}"


class WhepError(Exception):
    """A refused WHEP request: its HTTP status, a stable code and what to fix."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def load_aiortc() -> Any:
    try:
        import aiortc
    except ImportError:  # pragma: no cover - depends on the extra
        raise WhepError(501, "not_supported", "this server has no WebRTC: pip install 'worldserve[webrtc]'.") from None
    use_libwebrtc_timers()  # a lost packet holds a data channel 220 ms, not aiortc's 1 s (sctp_timers.py)
    use_zero_playout_delay()  # a browser shows each frame as it is decoded (playout_delay.py)
    return aiortc


def peer_connection(ice_servers: Sequence[str]) -> Any:
    """A new aiortc peer connection with these STUN/TURN servers (:func:`~worldserve.ice.parse_ice_server`'s URLs;
    none: host candidates only)."""
    aiortc = load_aiortc()
    parsed = [parse_ice_server(url) for url in ice_servers]
    servers = [aiortc.RTCIceServer(urls=s.url, username=s.username, credential=s.credential) for s in parsed]
    return aiortc.RTCPeerConnection(configuration=aiortc.RTCConfiguration(iceServers=servers))


def offers_h264(sdp: str) -> bool:
    """Whether an SDP offer takes H.264 as aiortc sends it (packetization mode 1, in RTP's H264/90000)."""
    upper = sdp.upper()
    return "H264/90000" in upper and "PACKETIZATION-MODE=1" in upper


async def answer_offer(pc: Any, sdp: str, track: Any, *, h264: bool = False) -> str:
    """Answer an SDP offer on ``pc``, sending ``track`` on the offer's video section (in H.264 alone with
    ``h264``); the answer's SDP (with every candidate: not trickled). Raises what aiortc raises for a bad offer
    (with ``h264``, one without an H.264 it can send), ``ValueError`` for one without video."""
    aiortc = load_aiortc()
    if h264:  # the codecs are agreed as the offer is set: a transceiver made before it takes the offer's video
        codecs = aiortc.RTCRtpSender.getCapabilities("video").codecs
        preferred = pc.addTransceiver("video", direction="sendonly")
        preferred.setCodecPreferences([c for c in codecs if c.mimeType.lower() in ("video/h264", "video/rtx")])
    await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=sdp, type="offer"))
    video = [transceiver for transceiver in pc.getTransceivers() if transceiver.kind == "video"]
    if not video:
        raise ValueError("no video section")
    video[0].direction = "sendonly"
    track.sender = pc.addTrack(track)
    await pc.setLocalDescription(await pc.createAnswer())
    return str(pc.localDescription.sdp)


#: A frame on a track: raw pixels (the peer's own encoder encodes them) or one already encoded.
TrackFrame = npt.NDArray[np.uint8] | AccessUnit


class FrameTrack:
    """The video track of one viewer: frames in as chunks come, out at the model's rate, oldest dropped first.

    Made an aiortc ``MediaStreamTrack`` by :func:`_track_class` (aiortc is imported only when WHEP is used).
    """

    kind = "video"

    def __init__(
        self,
        fps: float,
        max_frames: int,
        on_shown: Callable[[int], None],
        on_track: Callable[[int, int, int], None] | None = None,
        on_gap: Callable[[], None] | None = None,
        on_behind: Callable[[], None] | None = None,
    ) -> None:
        self._fps = fps
        self._max = max_frames
        self._on_shown = on_shown  # a chunk's first frame went out (or was passed over): its seq
        self._on_track = on_track  # a chunk's first frame on the track went out: (seq, its index, RTP timestamp)
        self._on_gap = on_gap  # encoded frames: the stream can go on only from an IDR frame, wanted now
        self._on_behind = on_behind  # encoded frames over the bound: an IDR frame to skip ahead to, wanted now
        self._behind = False  # asked for one (on_behind), not yet come
        self._wait_key = False  # encoded frames were dropped: none goes until an IDR frame
        self._held: int | None = None  # a chunk being undone (a preemption): none of its frames goes yet
        self._untold: list[tuple[int, int, int]] = []  # (seq, index, pts) of those sent before the origin was known
        self._last_seq: int | None = None  # the chunk of the last frame sent
        self._last_pts: int | None = None
        #: The RTP timestamp the stream's pts 0 goes out with (aiortc draws it at random): known once a frame went.
        self.rtp_origin: int | None = None
        self._frames: deque[tuple[int, int, TrackFrame]] = deque()  # (seq, index in its chunk, frame)
        self._arrived = asyncio.Event()
        self._next = 0.0  # when the next frame is due (monotonic)
        self._t0: float | None = None
        self.sent = 0
        self.dropped = 0

    def push(self, seq: int, frames: Sequence[TrackFrame]) -> None:
        if self._held is not None and seq > self._held:
            self.drop(self._held)  # undone, and another chunk came (a reset since): it never goes
        for index, frame in enumerate(frames):
            if isinstance(frame, AccessUnit) and frame.idr:
                self._wait_key = self._behind = False
            elif self._wait_key and isinstance(frame, AccessUnit):
                self._pass_over(seq, index)
                continue
            self._frames.append((seq, index, frame))
        while len(self._frames) > self._max:  # latency first: the oldest unsent frames go
            if not isinstance(self._frames[0][2], AccessUnit):
                self._pass_over(*self._frames.popleft()[:2])
                continue
            # A decoder cannot skip an encoded frame: go on from the newest IDR frame held. With none past the
            # first, the frames wait (two chunks that came together, a busy box) while an IDR frame to skip
            # ahead to is asked for; only past twice the bound do they all go, and the stream waits for one.
            keys = [at for at, (_, _, frame) in enumerate(self._frames) if isinstance(frame, AccessUnit) and frame.idr]
            if keys and keys[-1] > 0:
                for _ in range(keys[-1]):
                    self._pass_over(*self._frames.popleft()[:2])
            elif len(self._frames) <= 2 * self._max:
                if not self._behind and self._on_behind is not None:
                    self._behind = True
                    self._on_behind()
                break
            else:
                self.lost_picture()
        self._arrived.set()

    def lost_picture(self) -> None:
        """Encoded frames: the peer cannot decode what comes next (frames were dropped, or it said so: RTCP PLI or
        FIR): nothing goes until an IDR frame, which is asked for."""
        self._wait_key = True
        kept: deque[tuple[int, int, TrackFrame]] = deque()
        for seq, index, frame in self._frames:
            if isinstance(frame, AccessUnit):
                self._pass_over(seq, index)
            else:
                kept.append((seq, index, frame))
        self._frames = kept
        if self._on_gap is not None:
            self._on_gap()

    def _pass_over(self, seq: int, index: int) -> None:
        self.dropped += 1
        if index == 0:
            self._on_shown(seq)  # passed over, as a lagging player would: not held against pacing

    def drop(self, seq: int) -> None:
        """A chunk was superseded (a preemption): its frames not yet sent go."""
        self._frames = deque(item for item in self._frames if item[0] != seq)
        self.release(seq)  # held while it was undone: gone now

    def hold(self, seq: int) -> None:
        """Chunk ``seq`` is being undone (a preemption): none of its frames goes out until :meth:`release` (the
        undo failed: they go) or :meth:`drop` (its replacement came: they never go), so none can begin to play
        while the undo awaits its worker. A chunk begun already is not held: too late (the caller checks)."""
        if seq != self._last_seq:
            self._held = seq

    def release(self, seq: int) -> None:
        """Chunk ``seq`` is held no more (see :meth:`hold`)."""
        if self._held == seq:
            self._held = None
            self._arrived.set()

    def _sendable(self) -> bool:
        return bool(self._frames) and (self._held is None or self._frames[0][0] != self._held)

    async def next_frame(self) -> tuple[TrackFrame, int]:
        """The next frame to send and its timestamp (90 kHz), at the model's frame rate."""
        while True:
            while not self._sendable():
                self._arrived.clear()
                await self._arrived.wait()
                self._next = max(self._next, time.monotonic())  # a stall: go on from now, not in a burst
            wait = self._next - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._sendable():  # none dropped or held meanwhile (a superseded chunk, a lost picture, an undo)
                break
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        self._next = max(self._next, now - 1.0 / self._fps) + 1.0 / self._fps
        seq, index, frame = self._frames.popleft()
        pts = round((now - self._t0) * _CLOCK_RATE)
        if index == 0:
            self._on_shown(seq)
        if seq != self._last_seq and self._on_track is not None:  # its first frame on the track, dropped ones aside
            self._untold.append((seq, index, pts))
            self._tell()
        self._last_seq = seq
        self.sent += 1
        self._last_pts = pts
        return frame, pts

    def sent_rtp(self, rtp: int) -> None:
        """The RTP timestamp the last frame from :meth:`next_frame` went out with (0: none went yet): the
        stream's origin, so each chunk's first frame can be told by its RTP timestamp (``chunk.track``)."""
        if self.rtp_origin is None and rtp and self._last_pts is not None:
            self.rtp_origin = (rtp - self._last_pts) % 2**32
            self._tell()

    def _tell(self) -> None:
        if self.rtp_origin is None or self._on_track is None:
            return
        for seq, index, pts in self._untold:
            self._on_track(seq, index, (self.rtp_origin + pts) % 2**32)
        self._untold.clear()


def track_class() -> type:
    """``FrameTrack`` as an aiortc ``MediaStreamTrack`` (its ``recv`` gives ``av.VideoFrame``)."""
    aiortc = load_aiortc()
    import av

    class AiortcFrameTrack(aiortc.MediaStreamTrack, FrameTrack):  # type: ignore[misc,name-defined]
        kind = "video"

        def __init__(self, *args: Any, **kwargs: Any) -> None:  # FrameTrack's
            aiortc.MediaStreamTrack.__init__(self)
            FrameTrack.__init__(self, *args, **kwargs)
            self.sender: Any = None  # set by answer_offer

        async def recv(self) -> Any:
            # aiortc's sender asks for a frame only once the last one's packets went out, stamped with a random
            # origin it keeps to itself (pinned aiortc: the test of chunk.track fails if that changes).
            sender = self.sender
            if self.rtp_origin is None and sender is not None:
                self.sent_rtp(int(getattr(sender, "_RTCRtpSender__rtp_timestamp", 0)))
            frame, pts = await self.next_frame()
            if isinstance(frame, AccessUnit):
                # The sender packetises a packet as it is; a PLI or FIR from the peer only sets the flag its own
                # encoder would read (pinned aiortc): the world's encoder is asked for an IDR frame instead.
                if sender is not None and getattr(sender, "_RTCRtpSender__force_keyframe", False):
                    sender._RTCRtpSender__force_keyframe = False
                    if not frame.idr:  # an IDR frame answers it (the flag may be older than the wait for one)
                        self.lost_picture()
                packet = av.Packet(frame.data)
                packet.pts = pts
                packet.time_base = fractions.Fraction(1, _CLOCK_RATE)
                return packet
            video = av.VideoFrame.from_ndarray(frame, format="rgb24")
            video.pts = pts
            video.time_base = fractions.Fraction(1, _CLOCK_RATE)
            return video

    return AiortcFrameTrack


class WhepViewer:
    """A viewer member's outlet: its chunks' frames (raw, or the world's H.264 as access units) into its track;
    the world's end closes its peer."""

    def __init__(self, track: FrameTrack, on_end: Callable[[str], None]) -> None:
        self._track = track
        self._on_end = on_end
        self._init = b""  # H.264: the init segment of the stream this member is sent

    def post(self, messages: tuple[BaseModel, ...], binary: tuple[bytes, ...] = ()) -> None:
        for message in messages:
            if isinstance(message, ChunkMessage):
                if message.supersedes is not None:
                    self._track.drop(message.supersedes)
                info = message.frames
                if info.media == "raw" and binary:
                    shape = (info.height, info.width, 3)
                    self._track.push(message.seq, [np.frombuffer(blob, np.uint8).reshape(shape) for blob in binary])
                elif info.media == "h264" and binary:
                    start = info.init_bytes or 0
                    if start:
                        self._init = binary[0][:start]
                    fragment = binary[0][start:] if start else binary[0]  # the same bytes as other members'
                    if self._init:
                        self._track.push(message.seq, _access_units(self._init, fragment))
            elif isinstance(message, SessionClosed):
                self._on_end(f"the world ended ({message.reason})")
            elif isinstance(message, SessionFailed):
                self._on_end(f"the world failed ({message.code})")

    def detach(self) -> None:
        self._on_end("taken over")

    def hold_chunk(self, seq: int) -> None:
        self._track.hold(seq)

    def release_chunk(self, seq: int) -> None:
        self._track.release(seq)

    @property
    def backlog(self) -> int:
        return 0  # frames are dropped, never queued behind a slow peer

    def unsent(self) -> list[tuple[BaseModel, ...]]:
        return []


@functools.lru_cache(maxsize=16)
def _access_units(init: bytes, fragment: bytes) -> list[AccessUnit]:
    """A chunk's access units, made once for all the world's H.264 peers (they are sent the same fragment)."""
    return access_units(init, fragment)


@dataclass
class _Peer:
    resource: str
    session_id: str
    pc: Any
    member: Member
    outlet: WhepViewer
    track: FrameTrack


class WhepPeers:
    """The WHEP viewers of one server: offers answered, resources left, all closed at the server's stop."""

    def __init__(
        self,
        hosts: WorldHosts,
        *,
        ice_servers: Sequence[str] = (),
        max_frames: int | None = None,
        media: Literal["auto", "raw"] = "auto",
    ) -> None:
        self._hosts = hosts
        self._ice_servers = tuple(ice_servers)
        self._max_frames = max_frames
        self._media = media
        self._peers: dict[str, _Peer] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._peers)

    def authorize(self, session_id: str, token: str | None) -> None:
        """Whether ``token`` lets its bearer watch the world, as an offer would be refused (an ``OPTIONS`` before
        the offer, which is told the ICE servers: TURN credentials are not for anyone); :class:`WhepError` if not."""
        host, token = self._host(session_id, token)
        if not host.grants(token, Role.VIEWER):
            raise WhepError(403, "join_refused", "this token does not let you watch this world.")

    def _host(self, session_id: str, token: str | None) -> tuple[WorldHost, str]:
        if not token:
            raise WhepError(401, "unauthorized", "send the world's share token as the bearer token.")
        host = self._hosts.get(session_id)
        if host is None:
            raise WhepError(404, "unknown_session", f"no world {session_id!r} lives on this server.")
        return host, token

    async def offer(self, session_id: str, token: str | None, sdp: str) -> tuple[str, str]:
        """Answer a viewer's offer: (its resource id, the SDP answer); :class:`WhepError` when refused."""
        host, token = self._host(session_id, token)
        if len(sdp.encode()) > MAX_OFFER_BYTES or "m=video" not in sdp:
            raise WhepError(400, "bad_offer", "the offer must be an SDP offer with a video section (m=video).")
        load_aiortc()  # a server without the extra answers 501 before a member joins
        resource = secrets.token_urlsafe(16)
        spec = host.spec
        frames = self._max_frames or spec.frames_per_chunk + 2
        member_box: list[Member] = []

        def shown(seq: int) -> None:
            if member_box and not member_box[0].gone:
                host.ack(member_box[0], seq)

        def lost_picture() -> None:
            if member_box and not member_box[0].gone:
                host.lost_picture(member_box[0])

        h264 = self._media == "auto" and offers_h264(sdp)
        track = track_class()(spec.fps, frames, shown, on_gap=lost_picture, on_behind=host.want_keyframe)
        outlet = WhepViewer(track, lambda why: self._end(resource, why))
        member = host.join(token, Role.VIEWER, outlet, media="h264" if h264 else "raw")
        if member is None:
            raise WhepError(403, "join_refused", "this token does not let you watch this world.")
        member_box.append(member)
        pc = peer_connection(self._ice_servers)
        peer = self._peers[resource] = _Peer(resource, session_id, pc, member, outlet, track)

        @pc.on("connectionstatechange")  # type: ignore[untyped-decorator]
        async def changed() -> None:
            if pc.connectionState in ("failed", "closed"):
                self._end(resource, f"the peer connection {pc.connectionState}")

        try:
            answer = await answer_offer(pc, sdp, track, h264=h264)
        except Exception as error:
            await self._close(peer, "a bad offer")
            raise WhepError(400, "bad_offer", f"the offer could not be answered: {error}") from error
        return resource, answer

    async def leave(self, session_id: str, resource: str) -> None:
        peer = self._peers.get(resource)
        if peer is None or peer.session_id != session_id:
            raise WhepError(404, "unknown_resource", "no such WHEP viewer on this server.")
        await self._close(peer, "DELETE")

    async def aclose(self) -> None:
        for peer in list(self._peers.values()):
            await self._close(peer, "the server stops")
        for task in list(self._closing):
            with contextlib.suppress(BaseException):
                await task

    def stats(self, resource: str) -> dict[str, int | str]:
        peer = self._peers[resource]
        return {"sent": peer.track.sent, "dropped": peer.track.dropped, "media": peer.member.media}

    def _end(self, resource: str, why: str) -> None:
        peer = self._peers.get(resource)
        if peer is not None:
            task = asyncio.ensure_future(self._close(peer, why))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, peer: _Peer, why: str) -> None:
        if self._peers.pop(peer.resource, None) is None:
            return
        _log.info("WHEP viewer %s of session %s leaves: %s", peer.resource, peer.session_id, why)
        with contextlib.suppress(Exception):
            await peer.member.host.disconnected(peer.member, peer.outlet, clean=True)
        with contextlib.suppress(Exception):
            await peer.pc.close()
