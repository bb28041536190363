"""The WebRTC video track's bookkeeping, without a peer: latency first (the oldest unsent frame goes), each
chunk acked as its first frame goes out or is passed over, and each chunk's first frame on the track told with
its index and RTP timestamp once the stream's random origin is known (``chunk.track``)."""

from __future__ import annotations

import numpy as np

from worldserve.server.webrtc import FrameTrack


def _frames(count: int, value: int) -> list[np.ndarray]:
    return [np.full((2, 2, 3), value + index, np.uint8) for index in range(count)]


async def test_each_chunks_first_frame_on_the_track_is_told_once_the_origin_is_known() -> None:
    shown: list[int] = []
    told: list[tuple[int, int, int]] = []
    track = FrameTrack(1000.0, 5, shown.append, lambda seq, index, rtp: told.append((seq, index, rtp)))
    track.push(0, _frames(4, 0))
    track.push(1, _frames(4, 10))  # 8 frames for 5 places: chunk 0's first three are dropped, unsent
    assert (track.dropped, shown) == (3, [0])  # passed over, as a lagging player would: acked
    frame, pts = await track.next_frame()
    assert int(frame[0, 0, 0]) == 3
    assert told == []
    track.sent_rtp(0)  # nothing went out yet: still unknown
    assert told == []
    origin = 4_294_967_000  # aiortc draws it at random; RTP timestamps wrap at 2**32
    track.sent_rtp((origin + pts) % 2**32)
    assert told == [(0, 3, (origin + pts) % 2**32)]  # told late, with its index in the chunk
    frame, pts = await track.next_frame()
    assert int(frame[0, 0, 0]) == 10
    assert told[1] == (1, 0, (origin + pts) % 2**32)
    assert shown == [0, 1]
    track.sent_rtp(12345)  # the origin, once known, stays
    for _ in range(3):
        await track.next_frame()
    assert len(told) == 2
    assert track.sent == 5
    track.push(2, _frames(4, 20))
    track.drop(2)  # superseded before any frame of it went: never told
    track.push(3, _frames(2, 30))
    frame, pts = await track.next_frame()
    assert int(frame[0, 0, 0]) == 30
    assert told[2] == (3, 0, (origin + pts) % 2**32)
