"""The client's video receiver lets each frame go as soon as it is whole (``webrtc_receiver.py``): at its marker
bit, not when the next frame's first packet comes (aiortc's own buffer), and every whole frame at once after a
resent packet fills a hole (aiortc's lets one go per later packet, so its backlog never drains). Checked on the
buffer with hand-made packets, beside aiortc's own buffer fed the same, and on a real aiortc peer connection."""

from __future__ import annotations

import asyncio
import fractions

import numpy as np
import pytest

aiortc = pytest.importorskip("aiortc")

from aiortc.jitterbuffer import JitterBuffer  # noqa: E402
from aiortc.rtp import RtpPacket  # noqa: E402

from worldserve.webrtc_receiver import LiveJitterBuffer, use_live_frames  # noqa: E402


def _packet(seq: int, timestamp: int, *, marker: bool, data: bytes = b"x") -> RtpPacket:
    packet = RtpPacket(payload_type=96, sequence_number=seq, timestamp=timestamp, marker=int(marker))
    packet._data = data  # type: ignore[attr-defined]  # what the receiver's depayloader sets
    return packet


def test_a_frame_goes_at_its_last_packet_not_at_the_next_frames_first() -> None:
    live, aiortcs = LiveJitterBuffer(), JitterBuffer(capacity=512, is_video=True)
    for buffer in (live, aiortcs):
        assert buffer.add(_packet(100, 9000, marker=False, data=b"a"))[1] is None
    frame = live.add(_packet(101, 9000, marker=True, data=b"b"))[1]
    assert frame is not None
    assert frame.data == b"ab"
    assert frame.timestamp == 9000
    assert aiortcs.add(_packet(101, 9000, marker=True, data=b"b"))[1] is None  # aiortc's waits a frame for nothing
    assert not live.ready


def test_a_resend_that_fills_a_hole_lets_every_whole_frame_behind_it_go_at_once_in_order() -> None:
    live, aiortcs = LiveJitterBuffer(), JitterBuffer(capacity=512, is_video=True)
    assert live.add(_packet(10, 1000, marker=True, data=b"0"))[1].data == b"0"  # type: ignore[union-attr]
    assert aiortcs.add(_packet(10, 1000, marker=True, data=b"0"))[1] is None
    for buffer in (live, aiortcs):
        # 11 is lost; 12..14 come, each a whole frame
        for seq in (12, 13, 14):
            assert buffer.add(_packet(seq, 1000 + (seq - 10) * 5625, marker=True, data=bytes([seq])))[1] is None
    first = live.add(_packet(11, 1000 + 5625, marker=True, data=b"\x0b"))[1]  # the resend
    assert first is not None
    assert first.data == b"\x0b"
    assert [frame.data for frame, _ in live.ready] == [b"\x0c", b"\x0d", b"\x0e"]
    assert [payload_type for _, payload_type in live.ready] == [96, 96, 96]
    # aiortc's own lets the frame before the hole go only now, and keeps the four whole ones behind it: one goes
    # per later packet, so a frame per packet keeps them four frames late for good
    one = aiortcs.add(_packet(11, 1000 + 5625, marker=True, data=b"\x0b"))[1]
    assert one is not None
    assert one.data == b"0"
    for seq, late in ((15, b"\x0b"), (16, b"\x0c"), (17, b"\x0d")):
        assert aiortcs.add(_packet(seq, 1000 + (seq - 10) * 5625, marker=True))[1].data == late  # type: ignore[union-attr]


def test_without_marker_bits_a_frame_goes_when_the_next_frame_begins_as_before() -> None:
    live = LiveJitterBuffer()
    assert live.add(_packet(1, 500, marker=False, data=b"a"))[1] is None
    assert live.add(_packet(2, 500, marker=False, data=b"b"))[1] is None
    frame = live.add(_packet(3, 6125, marker=False, data=b"c"))[1]
    assert frame is not None
    assert frame.data == b"ab"


class _Frames(aiortc.VideoStreamTrack):  # type: ignore[misc]
    """Sends ``count`` frames, then none (a sender that pauses): nothing comes behind the last one."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.left = count

    async def recv(self) -> object:
        from av import VideoFrame

        if self.left == 0:
            await asyncio.Future()  # forever
        self.left -= 1
        pts, time_base = await self.next_timestamp()
        frame = VideoFrame.from_ndarray(np.full((48, 64, 3), 40 * self.left, np.uint8), format="rgb24")
        frame.pts, frame.time_base = pts, time_base
        return frame


async def test_a_real_receiver_decodes_the_last_frame_sent_with_no_frame_behind_it() -> None:
    """On aiortc's own receiver: its internals the swap needs are where use_live_frames puts its buffer, and the
    last frame a paused sender sent is decoded (aiortc's own receiver keeps it until another frame comes)."""
    sender, receiver = aiortc.RTCPeerConnection(), aiortc.RTCPeerConnection()
    try:
        sender.addTrack(_Frames(5))
        transceiver = receiver.addTransceiver("video", direction="recvonly")
        buffer = use_live_frames(transceiver.receiver)
        assert transceiver.receiver._RTCRtpReceiver__jitter_buffer is buffer
        tracks: asyncio.Queue[object] = asyncio.Queue()
        receiver.on("track", tracks.put_nowait)
        await receiver.setLocalDescription(await receiver.createOffer())
        await sender.setRemoteDescription(receiver.localDescription)
        await sender.setLocalDescription(await sender.createAnswer())
        await receiver.setRemoteDescription(sender.localDescription)
        got = []
        async with asyncio.timeout(20):
            track = await tracks.get()
            for _ in range(5):
                frame = await track.recv()  # type: ignore[attr-defined]
                got.append(frame.pts)
        assert len(got) == 5
        assert got == sorted(got)
        assert fractions.Fraction(1, 90000) == frame.time_base
    finally:
        await sender.close()
        await receiver.close()
