"""The WebRTC video track's bookkeeping, without a peer: latency first (the oldest unsent frame goes), each
chunk acked as its first frame goes out or is passed over, and each chunk's first frame on the track told with
its index and RTP timestamp once the stream's random origin is known (``chunk.track``); encoded frames (the
world's H.264 stream) dropped only up to an IDR frame (one asked for when none is held), or all of them past
twice the bound and an IDR frame awaited."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from worldserve.h264 import AccessUnit
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


def _units(count: int, chunk: int, idr: bool) -> list[AccessUnit]:
    return [AccessUnit(bytes([chunk, index]), idr and index == 0) for index in range(count)]


async def test_encoded_frames_are_dropped_up_to_the_newest_idr_frame_held() -> None:
    """An encoded frame needs those before it: over the bound, the track goes on from the newest IDR frame it
    holds (the frames before it passed over, their chunks acked), and asks for no keyframe."""
    shown: list[int] = []
    gaps: list[None] = []
    track = FrameTrack(1000.0, 6, shown.append, on_gap=lambda: gaps.append(None))
    track.push(0, _units(4, 0, idr=True))
    track.push(1, _units(4, 1, idr=True))  # 8 frames for 6 places: chunk 0 goes whole, not its first two
    assert (track.dropped, shown, gaps) == (4, [0], [])
    frame, _ = await track.next_frame()
    assert frame == AccessUnit(bytes([1, 0]), True)
    assert shown == [0, 1]


async def test_without_an_idr_frame_to_go_on_from_one_is_asked_for_and_past_twice_the_bound_all_go() -> None:
    """Over the bound with no IDR frame past the first, the frames wait (two chunks that came together are no
    reason to lose the picture) and an IDR frame to skip ahead to is asked for, once; it comes, and the track
    goes on from it. Past twice the bound, all go and nothing does until an IDR frame."""
    shown: list[int] = []
    gaps: list[None] = []
    behind: list[None] = []
    track = FrameTrack(1000.0, 6, shown.append, on_gap=lambda: gaps.append(None), on_behind=lambda: behind.append(None))
    track.push(0, _units(4, 0, idr=True))
    await track.next_frame()
    track.push(1, _units(4, 1, idr=False))  # 7 held: chunk 0's IDR frame went already
    assert (len(gaps), len(behind), track.dropped, shown) == (0, 1, 0, [0])
    track.push(2, _units(2, 2, idr=False))  # 9: still asked once
    assert (len(gaps), len(behind), track.dropped) == (0, 1, 0)
    track.push(3, _units(4, 3, idr=True))  # the IDR frame asked for: the track skips ahead to it
    assert (len(gaps), track.dropped, shown) == (0, 9, [0, 1, 2])
    assert (await track.next_frame())[0] == AccessUnit(bytes([3, 0]), True)
    track.push(4, _units(4, 4, idr=False))
    track.push(5, _units(4, 5, idr=False))  # 11 held, none to skip to: asked again (the last one came)
    assert (len(gaps), len(behind)) == (0, 2)
    track.push(6, _units(2, 6, idr=False))  # 13, past twice the bound: all go, and the stream waits
    assert (len(gaps), track.dropped, shown) == (1, 22, [0, 1, 2, 3, 4, 5, 6])
    track.push(7, _units(4, 7, idr=False))  # undecodable without the frames dropped: passed over too
    assert (len(gaps), track.dropped, shown) == (1, 26, [0, 1, 2, 3, 4, 5, 6, 7])
    track.push(8, _units(4, 8, idr=True))
    assert (await track.next_frame())[0] == AccessUnit(bytes([8, 0]), True)


async def test_a_lost_picture_drops_what_is_held_and_waits_for_an_idr_frame() -> None:
    shown: list[int] = []
    gaps: list[None] = []
    track = FrameTrack(1000.0, 8, shown.append, on_gap=lambda: gaps.append(None))
    track.push(0, _units(4, 0, idr=True))
    await track.next_frame()
    track.push(1, _units(2, 1, idr=False))
    track.lost_picture()  # the peer said so (RTCP PLI): what it would get next cannot be decoded
    assert (len(gaps), track.dropped, shown) == (1, 5, [0, 1])
    track.push(2, _units(4, 2, idr=True))
    assert (await track.next_frame())[0] == AccessUnit(bytes([2, 0]), True)


async def test_an_aiortc_track_sends_encoded_frames_as_packets_and_turns_a_pli_into_a_keyframe_request() -> None:
    """aiortc's sender packetises an ``av.Packet`` as it is; a PLI or FIR only sets the flag its own encoder would
    read (pinned aiortc's private name): the track reads it and asks the world for an IDR frame."""
    import av

    from worldserve.server.webrtc import track_class

    gaps: list[None] = []
    track = track_class()(1000.0, 8, lambda seq: None, on_gap=lambda: gaps.append(None))
    track.sender = type("Sender", (), {"_RTCRtpSender__force_keyframe": False})()
    track.push(0, _units(2, 0, idr=True))
    packet = await track.recv()
    assert isinstance(packet, av.Packet)
    assert (bytes(packet), packet.time_base) == (bytes([0, 0]), Fraction(1, 90_000))
    track.sender._RTCRtpSender__force_keyframe = True  # what aiortc does on an RTCP PLI
    await track.recv()
    assert (len(gaps), track.sender._RTCRtpSender__force_keyframe) == (1, False)
    # A PLI read as the IDR frame goes (sent while the track waited for one): that frame answers it.
    track.sender._RTCRtpSender__force_keyframe = True
    track.push(1, _units(2, 1, idr=True))
    assert bytes(await track.recv()) == bytes([1, 0])
    assert (len(gaps), track.sender._RTCRtpSender__force_keyframe) == (1, False)
    assert bytes(await track.recv()) == bytes([1, 1])  # and the frames after it go


async def test_frames_dropped_while_the_track_waits_for_their_time_are_not_sent() -> None:
    """A frame waits for its time; a chunk superseded (or a picture lost) meanwhile takes it away: the track
    waits for the next one instead of failing (aiortc's sender would stop the track)."""
    import asyncio

    track = FrameTrack(10.0, 8, lambda seq: None)
    track.push(0, _frames(2, 0))
    await track.next_frame()
    await track.next_frame()  # the next frame is due a period (0.1 s) after this one
    track.push(1, _frames(2, 10))
    waiting = asyncio.create_task(track.next_frame())  # chunk 1's first frame is due in 0.1 s
    await asyncio.sleep(0)
    track.drop(1)
    await asyncio.sleep(0.2)  # its time passes with nothing to send
    track.push(2, _frames(1, 20))
    frame, _ = await waiting
    assert int(frame[0, 0, 0]) == 20


async def test_a_chunk_held_while_it_is_undone_waits_and_then_goes_or_is_dropped() -> None:
    """A preemption awaiting its worker holds the chunk it undoes: none of its frames goes out, the frames before
    it do. Released (the undo failed) they go; dropped (its replacement came), or passed by a later chunk (a reset
    since), they never do. A chunk begun already is not held."""
    import asyncio

    track = FrameTrack(1000.0, 16, lambda seq: None)
    track.push(0, _frames(1, 0))
    track.push(1, _frames(2, 10))
    track.hold(1)
    assert int((await track.next_frame())[0][0, 0, 0]) == 0
    waiting = asyncio.create_task(track.next_frame())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # held: its first frame is not sent
    track.release(1)
    assert int((await waiting)[0][0, 0, 0]) == 10
    track.hold(1)  # begun: too late to hold
    assert int((await track.next_frame())[0][0, 0, 0]) == 11

    track.push(2, _frames(2, 20))
    track.hold(2)
    waiting = asyncio.create_task(track.next_frame())
    await asyncio.sleep(0.05)
    track.drop(2)  # its replacement's header came
    track.push(3, _frames(1, 30))
    assert int((await waiting)[0][0, 0, 0]) == 30

    track.push(4, _frames(1, 40))
    track.hold(4)
    track.push(5, _frames(1, 50))  # undone, then a reset: the next chunk drops it
    assert int((await track.next_frame())[0][0, 0, 0]) == 50
