"""aiortc's video receiver made to hand each frame to its decoder as soon as the frame is whole.

aiortc's receiver (pinned 1.16) reassembles frames in a jitter buffer that lets a frame go only when a packet of
the *next* frame arrives, and only one frame per packet: every frame waits a frame period (62 ms at 16 fps) for
nothing, and once a resent packet fills a hole behind several whole frames, the backlog never drains (each new
packet lets one old frame go), so a session's delay grows by a frame after each loss and never comes back. A
browser's receiver has neither: a frame is whole at its last packet (RTP's marker bit, which aiortc's and every
sender set on a frame's last packet), and every whole frame goes to the decoder at once.

``use_live_frames(receiver)`` swaps the receiver's buffer for :class:`LiveJitterBuffer`, which releases a frame at
its marker bit (or, from a sender without one, at the next frame's first packet, as before) and queues every
further whole frame, and it hands those to the receiver's decoder right after the packet that completed them, in
order. It reads four of the receiver's internals (its jitter buffer, codecs, timestamp mapper and decoder queue);
``tests/test_webrtc_receiver.py`` fails loudly if an aiortc upgrade moves them.

Owns: frame reassembly on the client's video receiver. Must not know: chunks, the session protocol.
Needs the ``webrtc`` extra.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from aiortc.jitterbuffer import JitterBuffer, JitterFrame

__all__ = ["LiveJitterBuffer", "use_live_frames"]

#: aiortc's own video buffer size, in packets.
_CAPACITY = 512


class LiveJitterBuffer(JitterBuffer):
    """A video jitter buffer that lets every whole frame go at once: :meth:`add` returns the first (as aiortc's
    receiver expects) and :attr:`ready` holds the rest, each with its packets' payload type."""

    def __init__(self) -> None:
        super().__init__(capacity=_CAPACITY, is_video=True)
        self.ready: deque[tuple[JitterFrame, int]] = deque()

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        # The packets in order from the oldest kept, up to the first still missing: a frame is whole at its
        # marker bit, or when a packet of another frame follows it.
        origin = self._origin
        if origin is None:
            return None
        whole: list[tuple[list[Any], int]] = []  # each whole frame's packets, and where it ends
        packets: list[Any] = []
        for count in range(self.capacity):
            packet = self._packets[(origin + count) % self.capacity]
            if packet is None:
                break
            if packets and packet.timestamp != packets[0].timestamp:
                whole.append((packets, count))
                packets = []
            packets.append(packet)
            if packet.marker:
                whole.append((packets, count + 1))
                packets = []
        if not whole:
            return None
        self.remove(whole[-1][1])
        frames = [
            (JitterFrame(b"".join(p._data for p in group), group[0].timestamp), group[0].payload_type)
            for group, _ in whole
        ]
        self.ready.extend(frames[1:])
        return frames[0][0]


def use_live_frames(receiver: Any) -> LiveJitterBuffer:
    """Make an aiortc video ``receiver`` (before its track starts) decode each frame as soon as it is whole."""
    buffer = LiveJitterBuffer()
    receiver._RTCRtpReceiver__jitter_buffer = buffer
    handle = receiver._handle_rtp_packet

    async def handle_then_release(packet: Any, arrival_time_ms: int) -> None:
        await handle(packet, arrival_time_ms=arrival_time_ms)  # the packet, and the first frame it completed
        while buffer.ready:  # then every further frame it completed, in order
            frame, payload_type = buffer.ready.popleft()
            codec = receiver._RTCRtpReceiver__codecs.get(payload_type)
            if codec is None or receiver._RTCRtpReceiver__decoder_thread is None:
                continue
            frame.timestamp = receiver._RTCRtpReceiver__timestamp_mapper.map(frame.timestamp)
            receiver._RTCRtpReceiver__decoder_queue.put((codec, frame))

    receiver._handle_rtp_packet = handle_then_release
    return buffer
