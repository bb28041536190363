"""H.264 (fragmented MP4) as a third media: the encoder stream and its fragments, the runner
encoding a session's one stream (keyframes on request, across a reset, after a cancelled
chunk), the world giving every member a decodable stream (late joiners, skipping viewers,
resumed connections start at an IDR frame with the init segment), and the journal untouched.

Frames are compared with the procedural world's exact frames by PSNR: H.264 here is yuv420p,
so the world's one-pixel colour detail (2x2 trees, sharp palette edges) loses its chroma
resolution; :data:`H264_PSNR_DB` is the bound (measured 26-29 dB), and another seed's world
scores far below it (:data:`UNRELATED_PSNR_DB`), so a stream of the wrong frames cannot pass.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from runtime_models import Truth, keys
from server_harness import RunningServer, start_server
from worldserve import SessionEvent, TickRequest
from worldserve.client import WorldClient
from worldserve.h264 import (
    DEFAULT_H264_QUALITY,
    H264Decoder,
    H264Encoder,
    access_units,
    crf_for_quality,
    default_bitrate_kbps,
    h264_settings,
    split_boxes,
)
from worldserve.media import EncodedFrames, FrameEncoder, FrameEncoding, decode_frames, encode
from worldserve.models import SessionOptions, load_model
from worldserve.models.base import ModelSpec
from worldserve.models.world import Motion, World
from worldserve.protocol import ChunkMetadata
from worldserve.runtime import ModelRunner, Runtime
from worldserve.runtime.chunk import Chunk
from worldserve.runtime.messages import TickOutput
from worldserve.server.config import ServerConfig
from worldserve.server.host import Role, WorldHost, WorldHosts
from worldserve.server.messages import ChunkMessage, ChunkSkipped
from worldserve.server.metrics import ServerMetrics
from worldserve.session import Session, SessionManager
from worldserve.tools.replay import replay

pytestmark = pytest.mark.timeout(120)

#: Decoded H.264 frames are at least this close to the model's (PSNR over RGB).
H264_PSNR_DB = 24.0
#: ... while another seed's world is at most this close: the bound tells frames apart.
UNRELATED_PSNR_DB = 16.0
H264 = FrameEncoding.for_media("h264")


def psnr(a: npt.NDArray[np.uint8], b: npt.NDArray[np.uint8]) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def moving_world(seed: int, frames: int, size: int = 48) -> npt.NDArray[np.uint8]:
    """The procedural world panning right and down, ``frames`` frames."""
    world, motion = World(seed), Motion()
    return np.stack([world.render(*motion.advance(2.0, 0.5, 1)[0], size, size, "islands") for _ in range(frames)])


def test_each_chunk_is_one_fragment_of_its_own_frames_and_keyframes_carry_the_init() -> None:
    frames = moving_world(3, 16)
    encoder = H264Encoder(h264_settings(48, 48, 16.0, DEFAULT_H264_QUALITY, None))
    made = [encoder.encode(frames[i : i + 4]) for i in range(0, 16, 4)]
    assert [m.keyframe for m in made] == [True, False, False, False]  # the first chunk starts the stream
    assert [m.frames for m in made] == [4, 4, 4, 4]
    assert [kind for kind, _ in split_boxes(made[0].init)] == ["ftyp", "moov"]
    assert all(m.init == b"" for m in made[1:])
    for m in made:
        assert [kind for kind, _ in split_boxes(m.fragment)] == ["moof", "mdat"]  # exactly one fragment
    encoder.keyframe()
    again = encoder.encode(frames[:4])
    assert again.keyframe
    assert again.init == made[0].init  # the same codec parameters: the same init segment
    # Decoded in order, every chunk gives back exactly its own frames (no frame held back).
    decoder = H264Decoder()
    decoded = [decoder.decode(m.fragment, m.init) for m in made]
    assert [len(d) for d in decoded] == [4, 4, 4, 4]
    assert psnr(np.concatenate(decoded), frames) >= H264_PSNR_DB
    assert psnr(np.concatenate(decoded), moving_world(4, 16)) <= UNRELATED_PSNR_DB
    encoder.close()


def test_access_units_are_each_frame_in_annex_b_and_decode_to_the_fragments_frames() -> None:
    """What a WebRTC track sends of the world's stream: one Annex B access unit a frame, an IDR frame led by the
    SPS and PPS, decoding (from the IDR frame, with no init segment) to exactly the frames the fMP4 decodes to."""
    import av

    frames = moving_world(5, 12)
    encoder = H264Encoder(h264_settings(48, 48, 16.0, DEFAULT_H264_QUALITY, None))
    made = [encoder.encode(frames[i : i + 4]) for i in range(0, 12, 4)]
    init = made[0].init
    units = [access_units(init, m.fragment) for m in made]
    assert [[unit.idr for unit in chunk] for chunk in units] == [[True, False, False, False]] + [[False] * 4] * 2
    for chunk in units:
        for unit in chunk:
            assert unit.data.startswith((b"\x00\x00\x00\x01", b"\x00\x00\x01"))
    reference = H264Decoder()
    want = np.concatenate([reference.decode(m.fragment, m.init) for m in made])
    decoder = av.CodecContext.create("h264", "r")  # Annex B alone: the parameter sets come in the stream
    packets = [av.Packet(unit.data) for chunk in units for unit in chunk]
    got = [f.to_ndarray(format="rgb24") for packet in packets for f in decoder.decode(packet)]
    got += [f.to_ndarray(format="rgb24") for f in decoder.decode(None)]
    assert np.array_equal(np.stack(got), want)
    encoder.close()


def test_a_decoder_can_start_only_at_a_keyframe_and_then_follows_the_stream() -> None:
    frames = moving_world(8, 24)
    encoder = H264Encoder(h264_settings(48, 48, 16.0, DEFAULT_H264_QUALITY, None))
    first = encoder.encode(frames[:4])
    second = encoder.encode(frames[4:8])
    late = H264Decoder()
    with pytest.raises(ValueError, match="init segment"):
        late.decode(second.fragment)
    with pytest.raises(ValueError, match="IDR"):
        late.decode(second.fragment, first.init)  # the init alone is not enough: it needs a keyframe
    encoder.keyframe()  # what a late joiner's world asks for
    third = encoder.encode(frames[8:12])
    fourth = encoder.encode(frames[12:16])
    assert third.keyframe
    assert not fourth.keyframe
    follower = H264Decoder()
    for chunk in (first, second, third, fourth):
        follower_frames = follower.decode(chunk.fragment, chunk.init)
    assert psnr(late.decode(third.fragment, third.init), frames[8:12]) >= H264_PSNR_DB
    assert np.array_equal(late.decode(fourth.fragment), follower_frames)  # then it decodes what everyone does
    # A chunk that was made but never delivered: the next one starts at an IDR frame in its place.
    lost = encoder.encode(frames[16:20])
    assert not lost.keyframe
    encoder.rollback(4)
    replacement = encoder.encode(frames[16:20])
    assert replacement.keyframe
    assert psnr(follower.decode(replacement.fragment, replacement.init), frames[16:20]) >= H264_PSNR_DB


def test_settings_and_options_are_checked() -> None:
    assert (crf_for_quality(100), crf_for_quality(65), crf_for_quality(1)) == (0, 18, 51)
    assert default_bitrate_kbps(48, 48, 16.0) == 128  # the floor
    assert default_bitrate_kbps(832, 480, 16.0) == 1917  # 0.3 bits per pixel per frame
    assert h264_settings(48, 48, 16.0, 90, 500).bitrate_kbps == 500
    with pytest.raises(ValueError, match="even"):
        h264_settings(47, 48, 16.0, 90, None)
    assert FrameEncoding.for_media("h264") == FrameEncoding("h264", 65)
    assert FrameEncoding.for_media("jpeg") == FrameEncoding("jpeg", 90)
    with pytest.raises(ValueError, match="h264 only"):
        FrameEncoding("jpeg", 90, bitrate_kbps=300)
    with pytest.raises(ValueError, match="bitrate_kbps"):
        FrameEncoding("h264", 65, bitrate_kbps=8)
    assert not FrameEncoding("h264", 65, 300).same_bytes(FrameEncoding("h264", 65, 400))
    with pytest.raises(ValueError, match="stream"):
        encode(moving_world(1, 4), H264)  # a stream needs a FrameEncoder
    encoder = FrameEncoder(H264, 48, 48, 16.0)
    chunk = encoder.encode(moving_world(1, 4))
    assert (chunk.count, len(chunk.payloads), chunk.keyframe) == (4, 1, True)
    assert chunk.nbytes == len(chunk.payloads[0]) + len(chunk.init)
    assert psnr(decode_frames(chunk), moving_world(1, 4)) >= H264_PSNR_DB  # a keyframe chunk decodes alone
    with pytest.raises(ValueError, match="alone"):
        decode_frames(encoder.encode(moving_world(1, 4)))
    encoder.close()


def _tick(session: str, chunk: int, *, reset: bool = False, **fields: Any) -> TickRequest:
    return TickRequest(session, f"{session}-{chunk}-{reset}", chunk, reset=reset, **fields)


def test_the_runner_keeps_one_stream_per_session_with_keyframes_where_a_viewer_can_start() -> None:
    runner = ModelRunner(load_model("procedural"), encode_threads=2)
    runner.admit("a", SessionOptions(seed=1, encoding=H264))
    runner.admit("b", SessionOptions(seed=2, encoding=H264))
    truth = {"a": Truth(1), "b": Truth(2)}
    decoders = {"a": H264Decoder(), "b": H264Decoder()}

    def step(*ticks: TickRequest) -> dict[str, EncodedFrames]:
        report = runner.step(list(ticks))
        out = {}
        for tick, result in zip(ticks, report.results, strict=True):
            assert isinstance(result, TickOutput)
            assert isinstance(result.frames, EncodedFrames)
            made = truth[tick.session_id].next(tick.prompt, tick.controls)
            decoded = decoders[tick.session_id].decode(result.frames.payloads[0], result.frames.init)
            assert psnr(decoded, made) >= H264_PSNR_DB
            out[tick.session_id] = result.frames
        return out

    first = step(_tick("a", 0), _tick("b", 0))
    assert first["a"].keyframe
    assert first["b"].keyframe
    moved = (keys("D"),)
    second = step(_tick("a", 1, applied_event_ids=(1,), controls=moved), _tick("b", 1))
    assert not second["a"].keyframe
    assert not second["b"].keyframe
    assert runner.request_keyframe("a")
    assert not runner.request_keyframe("nobody")
    third = step(_tick("a", 2, applied_event_ids=(1,), controls=moved), _tick("b", 2))
    assert third["a"].keyframe
    assert third["a"].init == first["a"].init
    assert not third["b"].keyframe  # the other session's stream is untouched
    # A reset starts the world over; its stream goes on (a viewer keeps its decoder) from an IDR frame.
    truth["a"] = Truth(1)
    after_reset = step(_tick("a", 0, reset=True), _tick("b", 3))
    assert after_reset["a"].keyframe
    assert not after_reset["b"].keyframe
    # A cancelled chunk is rolled out of the stream as well as out of the state.
    runner.step([_tick("a", 1, applied_event_ids=(2,), controls=moved)])
    assert runner.rollback_ar_diffusion_session("a", 1)
    redone = step(_tick("a", 1))
    assert redone["a"].keyframe


async def test_the_journal_keeps_provenance_not_encodings_and_replays(tmp_path: Path) -> None:
    async with Runtime("procedural", executor="inprocess", record_dir=str(tmp_path)) as runtime:
        session = await runtime.create_session(prompt="islands", seed=6, encoding=H264)
        decoder = H264Decoder()
        live = []
        for index in range(4):
            if index == 1:
                await session.accept_event(SessionEvent(1, controls=(keys("S"),)))
            chunk = await session.next_chunk()
            assert isinstance(chunk.frames, EncodedFrames)
            live.append(decoder.decode(chunk.frames.payloads[0], chunk.frames.init))
        await runtime.close_session(session.session_id)
    journal = tmp_path / f"{session.session_id}.jsonl"
    assert "h264" not in journal.read_text()
    replayed = await replay(journal, executor="inprocess")
    assert replayed.frames.shape == (16, 48, 48, 3)
    assert psnr(np.concatenate(live), replayed.frames) >= H264_PSNR_DB  # the exact frames, as H.264 showed them


# -- over a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Any:
    running = start_server("--model", "procedural", "--workers", "1", "--resume-grace-s", "30")
    yield running
    running.stop()


async def _decoded_like_the_world(client: WorldClient, truth: Truth, chunks: int) -> list[Any]:
    got = []
    for _ in range(chunks):
        chunk = await client.next_chunk(timeout=30)
        assert chunk.frames.shape == (4, 48, 48, 3)
        assert psnr(chunk.frames, truth.next(None, ())) >= H264_PSNR_DB
        got.append(chunk)
    return got


@pytest.mark.parametrize("encode_at", ["worker", "server"])
async def test_an_h264_session_decodes_to_the_models_frames(encode_at: str) -> None:
    running = start_server("--model", "procedural", "--executor", "inprocess", "--encode-frames", encode_at)
    try:
        async with WorldClient(running.ws) as client:
            info = await client.start(seed=7, media="h264", quality=70, bitrate_kbps=400)
            assert info.media == "h264"
            await _decoded_like_the_world(client, Truth(7), 3)
            await client.close()
    finally:
        running.stop()
    assert "Traceback" not in running.log()


async def test_a_late_viewer_and_a_resumed_connection_get_a_playable_stream(server: RunningServer) -> None:
    async with WorldClient(server.ws) as host:
        info = await host.start(seed=9, media="h264", share_viewers=True)
        assert info.viewer_token is not None
        truth = Truth(9)
        await _decoded_like_the_world(host, truth, 3)
        viewer = WorldClient(server.ws)
        await viewer.connect()
        await viewer.join(info.session_id, info.viewer_token)
        joined_seq = viewer.last_seq
        # The viewer's first chunk starts with an IDR frame and the init segment; it plays from there.
        hosted = await _decoded_like_the_world(host, truth, 4)
        seen = [await viewer.next_chunk(timeout=30) for _ in range(2)]
        # ... and it is asked for at the join: the chunk in flight then, at most, is withheld, so the
        # viewer waits at most two steps, however slow they are (a black view of ~4.5 s was two slow steps)
        assert seen[0].seq <= joined_seq + 2, (joined_seq, seen[0].seq, viewer.skipped)
        by_seq = {chunk.seq: chunk for chunk in hosted}
        for chunk in seen:
            if chunk.seq in by_seq:
                assert np.array_equal(chunk.frames, by_seq[chunk.seq].frames)  # one stream, decoded alike
        # The host drops its socket and resumes: its decoder goes on with the replayed chunks.
        await host.drop()
        await asyncio.sleep(0.3)
        await host.resume()
        hosted += await _decoded_like_the_world(host, truth, 3)
        assert host.skipped == []
        # A viewer that comes back after a gap (the chunks it missed are no longer buffered) restarts at
        # an IDR frame: the init segment comes with it, and its decoder starts the stream again.
        await viewer.drop()
        gaps = len(viewer.skipped)
        hosted += await _decoded_like_the_world(host, truth, 10)  # more than --replay-chunks (8)
        await viewer.resume()
        late = await viewer.next_chunk(timeout=30)
        while len(viewer.skipped) == gaps or late.seq <= viewer.skipped[-1][1]:  # what it had before the drop
            late = await viewer.next_chunk(timeout=30)
        hosted += await _decoded_like_the_world(host, truth, 3)
        by_seq = {chunk.seq: chunk for chunk in hosted}
        assert np.array_equal(late.frames, by_seq[late.seq].frames)
        await viewer.disconnect()
        await host.close()


async def test_a_client_without_a_decoder_resumes_with_keyframe_and_plays_from_its_first_chunk(
    server: RunningServer,
) -> None:
    """`session.resume {keyframe: true}`: a client that lost its decoder (a restarted process, another
    device) takes the session over; the stream starts again for it at an IDR frame with the init
    segment in front, so its very first chunk decodes, and the chunks before it are `chunk.skipped`."""
    async with WorldClient(server.ws) as first:
        info = await first.start(seed=12, media="h264")
        truth = Truth(12)
        await _decoded_like_the_world(first, truth, 3)
        await first.drop()
    # A new client, with no decoder, takes the session over from where the first one was: no gap.
    taker = WorldClient(server.ws)
    resumed = await taker.resume(info, last_seq=first.last_seq)  # keyframe: asked, it has no decoder
    assert resumed.session_id == info.session_id
    chunk = await taker.next_chunk(timeout=30)  # decodes only if it starts the stream again
    assert chunk.frames.shape == (4, 48, 48, 3)
    skipped = sum(to - since + 1 for since, to in taker.skipped)
    assert chunk.seq == first.last_seq + 1 + skipped  # every chunk after last_seq is skipped or played
    for _ in range(skipped):
        truth.next(None, ())  # the world's chunks this client did not get
    assert psnr(chunk.frames, truth.next(None, ())) >= H264_PSNR_DB
    await _decoded_like_the_world(taker, truth, 2)
    await taker.close()
    await taker.disconnect()


# -- the world's side, without sockets (tests/test_host.py's style) ---------------------------


class _H264Backend:
    """A tick consumer whose "worker" encodes 16x16 frames as H.264, and honours keyframe requests."""

    spec = ModelSpec(
        name="fake", frames_per_chunk=2, fps=1000.0, height=16, width=16, controls=(), max_batch_size=1, state_bytes=1
    )

    def __init__(self) -> None:
        self.encoder = FrameEncoder(H264, 16, 16, 1000.0)
        self.asked = 0
        self.made: list[EncodedFrames] = []

    async def execute_tick(self, tick: TickRequest) -> Chunk:
        await asyncio.sleep(0.001)
        frames = np.full((2, 16, 16, 3), (len(self.made) * 37) % 256, np.uint8)
        encoded = self.encoder.encode(frames)
        self.made.append(encoded)
        return Chunk(encoded, ChunkMetadata.from_tick(tick), 0, 1, 0.0, 0.0, 0.0)

    def chunk_metadata(self, output: Chunk) -> ChunkMetadata:
        return output.metadata

    async def reset_session(self, session_id: str) -> None:
        return None

    async def close_session(self, session_id: str) -> None:
        return None

    def request_keyframe(self, session_id: str) -> bool:
        self.asked += 1
        self.encoder.keyframe()
        return True

    def mark_in_use(self, session_id: str, seconds: float) -> None:
        return None  # one world, never evicted here


async def test_members_that_cannot_follow_the_stream_wait_for_an_idr_frame_with_the_init() -> None:
    backend = _H264Backend()
    session: Session[Chunk] = Session("s1", tick_consumer=backend, lifecycle=backend, max_pending_events=8)
    metrics = ServerMetrics(SessionManager(tick_consumer=backend, lifecycle=backend, max_pending_events=8))
    host = WorldHost(
        session, backend=backend, config=ServerConfig(max_lag_chunks=2), metrics=metrics, registry=WorldHosts(),
        media="h264", share_viewers=True,
    )  # fmt: skip
    a, v = _Recorder(), _Recorder()
    me = host.attach_host(a)
    host.start()

    async def until(outlet: _Recorder, count: int) -> list[ChunkMessage]:
        async with asyncio.timeout(10):
            while len(outlet.of(ChunkMessage)) < count:
                host.ack(me, host.seq)  # the host plays everything at once
                await asyncio.sleep(0.001)
        return outlet.of(ChunkMessage)

    first = (await until(a, 3))[0]
    assert first.frames.keyframe
    assert first.frames.init_bytes
    assert first.frames.sizes == [len(a.binary[0][0])]
    assert a.binary[0][0][4:8] == b"ftyp"  # the init segment in front of the fragment
    assert [m.frames.init_bytes for m in a.of(ChunkMessage)[1:]] == [0, 0]  # the host follows the stream
    assert backend.asked == 0
    viewer = host.join(host.viewer_token or "", Role.VIEWER, v)
    assert viewer is not None
    assert backend.asked == 1  # asked for an IDR frame at once
    got = await until(v, 1)
    assert got[0].frames.keyframe
    assert got[0].frames.init_bytes
    H264Decoder().decode(v.binary[0][0][got[0].frames.init_bytes :], v.binary[0][0][: got[0].frames.init_bytes])
    # The viewer stops acking: it lags, skips, and then can only go on from another IDR frame.
    count = len(v.of(ChunkMessage))
    before = backend.asked
    await until(a, len(a.of(ChunkMessage)) + 6)
    assert len(v.of(ChunkMessage)) < count + 6
    host.ack(viewer, v.of(ChunkMessage)[-1].seq + viewer.seq_base)
    resumed = len(v.of(ChunkMessage))
    await until(v, resumed + 2)
    back = v.of(ChunkMessage)[resumed]
    assert back.frames.keyframe
    assert back.frames.init_bytes
    assert backend.asked > before
    assert v.of(ChunkSkipped)[-1].to_seq == back.seq - 1
    # Everything the host got decodes in order as one stream.
    decoder = H264Decoder()
    for header, (binary,) in zip(a.of(ChunkMessage), a.binary, strict=True):
        init = binary[: header.frames.init_bytes or 0]
        assert len(decoder.decode(binary[len(init) :], init)) == 2
    await host.shutdown("test")


class _RawWorkerBackend(_H264Backend):
    """A worker that encodes raw frames, and H.264 too as an extra encoding from the second chunk after the world
    asks for it (until then, the world encodes H.264 itself from the raw frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = FrameEncoder(FrameEncoding.for_media("raw"), 16, 16, 1000.0)
        self.extra: FrameEncoder | None = None
        self.asked_extra_at: int | None = None

    async def execute_tick(self, tick: TickRequest) -> Chunk:
        await asyncio.sleep(0.001)
        frames = np.full((2, 16, 16, 3), (len(self.made) * 37) % 256, np.uint8)
        encoded = self.raw.encode(frames)
        if self.asked_extra_at is not None and len(self.made) >= self.asked_extra_at + 2:
            if self.extra is None:
                self.extra = FrameEncoder(H264, 16, 16, 1000.0)  # its stream starts with an IDR frame
            encoded = replace(encoded, alternates=(self.extra.encode(frames),))
        self.made.append(encoded)
        return Chunk(encoded, ChunkMetadata.from_tick(tick), 0, 1, 0.0, 0.0, 0.0)

    def set_extra_encodings(self, session_id: str, encodings: tuple[FrameEncoding, ...]) -> bool:
        assert [encoding.media for encoding in encodings] == ["h264"]
        self.asked_extra_at = len(self.made)
        return True

    def request_keyframe(self, session_id: str) -> bool:
        self.asked += 1
        if self.extra is None:
            return False  # not made here yet
        self.extra.keyframe()
        return True


async def test_a_lost_picture_asks_the_worker_once_it_makes_the_stream_the_world_began() -> None:
    """A raw world's H.264 viewer: the world encodes its first H.264 chunks itself until the worker makes them
    (an extra encoding). A picture the viewer loses after that is asked of the worker's encoder: the next IDR
    frame comes within two chunks, not at the next periodic keyframe (the world's own encoder, no longer used,
    was asked until stop 41: a WHEP viewer then waited ~10 s)."""
    backend = _RawWorkerBackend()
    session: Session[Chunk] = Session("s1", tick_consumer=backend, lifecycle=backend, max_pending_events=8)
    metrics = ServerMetrics(SessionManager(tick_consumer=backend, lifecycle=backend, max_pending_events=8))
    host = WorldHost(
        session, backend=backend, config=ServerConfig(), metrics=metrics, registry=WorldHosts(),
        media="raw", share_viewers=True,
    )  # fmt: skip
    a, v = _Recorder(), _Recorder()
    me = host.attach_host(a)
    host.start()

    async def until(count: int) -> list[ChunkMessage]:
        async with asyncio.timeout(10):
            while len(v.of(ChunkMessage)) < count:
                host.ack(me, host.seq)
                if viewer.acked_seq < host.seq:
                    host.ack(viewer, host.seq)
                await asyncio.sleep(0.001)
        return v.of(ChunkMessage)

    await asyncio.sleep(0.01)
    viewer = host.join(host.viewer_token or "", Role.VIEWER, v, media="h264")
    assert viewer is not None
    got = await until(6)
    assert backend.extra is not None  # the worker makes the H.264 stream now
    assert got[0].frames.keyframe  # the world's own first chunk
    assert len([m for m in got if m.frames.keyframe]) == 2  # and the worker's first
    host.lost_picture(viewer)
    asked, sent = backend.asked, len(got)
    assert asked >= 1
    got = await until(sent + 1)
    assert got[sent].frames.keyframe
    assert got[sent].seq <= got[sent - 1].seq + 2
    await host.shutdown("test")


class _Recorder:
    def __init__(self) -> None:
        self.posted: list[Any] = []
        self.binary: list[tuple[bytes, ...]] = []

    def post(self, messages: tuple[Any, ...], binary: tuple[bytes, ...] = ()) -> None:
        self.posted.extend(messages)
        if binary:
            self.binary.append(binary)

    def detach(self) -> None:
        return None

    def unsent(self) -> list[tuple[Any, ...]]:
        return []

    @property
    def backlog(self) -> int:
        return 0

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for m in self.posted if isinstance(m, kind)]
