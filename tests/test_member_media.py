"""Each member of a world picks its media (issue 30): a viewer without H.264 joins an H.264 world.

Through a real server (``--model procedural``): an H.264 host shares its world with JPEG and raw
viewers; each gets its own media, equal (raw) or close (JPEG, H.264) to the world's frames; each
chunk is encoded once per media in use (``worldserve_chunk_encodings``), not once per member, and a
media nobody uses any more stops being encoded. The runner's part (one encoder per media, the
others as ``alternates``, ``set_extra_encodings``) is checked on its own too.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.request

import numpy as np
import pytest

from runtime_models import Truth
from server_harness import JPEG_MEAN_ERROR, RunningServer, start_server
from test_h264 import H264_PSNR_DB, psnr
from worldserve.client import ClientChunk, WorldClient, WorldError
from worldserve.media import EncodedFrames, FrameEncoding, decode_frames
from worldserve.models import SessionOptions, load_model
from worldserve.protocol import TickRequest
from worldserve.runtime import ModelRunner, Runtime
from worldserve.runtime.messages import TickOutput


def _truth(seed: int, chunks: int) -> list[np.ndarray]:
    truth = Truth(seed)
    return [truth.next(None, ()) for _ in range(chunks)]


def _encodings(server: RunningServer) -> dict[str, float]:
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^worldserve_chunk_encodings_total\{media="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {media: float(value) for media, value in found}


async def _chunks(client: WorldClient, count: int) -> list[ClientChunk]:
    return [await client.next_chunk(timeout=30) for _ in range(count)]


class _Playing:
    """The host plays on (reads and acks its chunks) while the test reads its viewers."""

    def __init__(self, host: WorldClient) -> None:
        self.host = host
        self.got: list[ClientChunk] = []
        self._task = asyncio.create_task(self._play())

    async def _play(self) -> None:
        while True:
            self.got.append(await self.host.next_chunk(timeout=30))

    async def chunks(self, count: int) -> list[ClientChunk]:
        """Wait for ``count`` more host chunks; the ones it got meanwhile."""
        start = len(self.got)
        while len(self.got) < start + count:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        return self.got[start:]

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@pytest.mark.parametrize(
    ("executor", "encode_at"), [("inprocess", "worker"), ("multiprocess", "worker"), ("inprocess", "server")]
)
async def test_jpeg_and_raw_viewers_watch_an_h264_world_encoded_once_per_media(executor: str, encode_at: str) -> None:
    running = start_server("--model", "procedural", "--executor", executor, "--encode-frames", encode_at)
    try:
        world = _truth(5, 200)
        async with WorldClient(running.ws) as host:
            info = await host.start(seed=5, media="h264", share_viewers=True)
            assert info.viewer_token is not None
            for chunk in await _chunks(host, 2):
                assert psnr(chunk.frames, world[chunk.chunk_index]) >= H264_PSNR_DB
            viewers = {}
            for name, media in (("jpeg-1", "jpeg"), ("jpeg-2", "jpeg"), ("raw", "raw")):
                viewer = viewers[name] = WorldClient(running.ws)
                await viewer.connect()
                joined = await viewer.join(info.session_id, info.viewer_token, media=media)
                assert joined.media == media
            playing = _Playing(host)
            before = _encodings(running)
            for name, viewer in viewers.items():
                for chunk in await _chunks(viewer, 3):
                    made = world[chunk.chunk_index]
                    assert chunk.frames.shape == made.shape
                    if name == "raw":
                        assert np.array_equal(chunk.frames, made)
                    else:
                        assert np.abs(chunk.frames.astype(np.int16) - made).mean() < JPEG_MEAN_ERROR
            await playing.chunks(1)
            for chunk in playing.got:  # the host's stream went on decoding, untouched
                assert psnr(chunk.frames, world[chunk.chunk_index]) >= H264_PSNR_DB
            after = _encodings(running)
            h264 = after["h264"] - before["h264"]
            # Two JPEG viewers, one JPEG encoding per chunk: never more JPEG encodings than H.264 ones.
            assert h264 >= 3
            assert 0 < after["jpeg"] - before["jpeg"] <= h264
            assert 0 < after["raw"] - before["raw"] <= h264
            # Both JPEG viewers leave: JPEG stops being encoded; raw goes on for the raw viewer.
            await viewers.pop("jpeg-1").close()
            await viewers.pop("jpeg-2").close()
            await playing.chunks(3)  # a chunk already under way may still carry JPEG
            settled = _encodings(running)
            await playing.chunks(4)
            await _chunks(viewers["raw"], 2)
            later = _encodings(running)
            await playing.stop()
            assert later["jpeg"] == settled["jpeg"]
            assert later["h264"] > settled["h264"]
            assert later["raw"] > settled["raw"]
            await viewers["raw"].close()
            await host.close()
    finally:
        running.stop()
    assert "Traceback" not in running.log()


async def test_a_viewer_resumes_in_another_media() -> None:
    running = start_server("--model", "procedural", "--executor", "inprocess")
    try:
        world = _truth(6, 200)
        async with WorldClient(running.ws) as host:
            info = await host.start(seed=6, media="h264", share_viewers=True)
            assert info.viewer_token is not None
            viewer = WorldClient(running.ws)
            await viewer.connect()
            await viewer.join(info.session_id, info.viewer_token, media="raw")
            playing = _Playing(host)
            for chunk in await _chunks(viewer, 2):
                assert np.array_equal(chunk.frames, world[chunk.chunk_index])
            await viewer.drop()
            resumed = await viewer.resume(media="jpeg")
            assert resumed.media == "jpeg"
            for chunk in await _chunks(viewer, 3):
                assert np.abs(chunk.frames.astype(np.int16) - world[chunk.chunk_index]).mean() < JPEG_MEAN_ERROR
            await playing.stop()
            for chunk in playing.got:
                assert psnr(chunk.frames, world[chunk.chunk_index]) >= H264_PSNR_DB
            await viewer.close()
            await host.close()
    finally:
        running.stop()
    assert "Traceback" not in running.log()


def test_the_runner_encodes_each_chunk_once_per_media_and_drops_a_media_left_out() -> None:
    model = load_model("procedural")
    spec = model.spec
    runner = ModelRunner(model)
    h264, jpeg, raw = FrameEncoding.for_media("h264"), FrameEncoding.for_media("jpeg"), FrameEncoding.for_media("raw")
    runner.admit("a", SessionOptions(seed=3, encoding=h264, extra_encodings=(jpeg,)))
    world = _truth(3, 4)

    def step(chunk: int) -> EncodedFrames:
        (result,) = runner.step([TickRequest(session_id="a", request_id=f"r{chunk}", chunk_index=chunk)]).results
        assert isinstance(result, TickOutput)
        assert isinstance(result.frames, EncodedFrames)
        return result.frames

    made = step(0)
    assert made.encoding.media == "h264"
    assert made.keyframe
    assert [other.encoding.media for other in made.alternates] == ["jpeg"]
    versions = made.versions()
    assert set(versions) == {"h264", "jpeg"}
    assert np.abs(decode_frames(versions["jpeg"]).astype(np.int16) - world[0]).mean() < JPEG_MEAN_ERROR
    assert psnr(decode_frames(versions["h264"]), world[0]) >= H264_PSNR_DB
    assert made.nbytes == sum(version.nbytes for version in versions.values())

    assert runner.set_extra_encodings("a", (raw,))
    made = step(1)
    assert [other.encoding.media for other in made.alternates] == ["raw"]
    assert not made.keyframe  # the H.264 stream goes on
    assert np.array_equal(decode_frames(made.versions()["raw"]), world[1])

    assert runner.set_extra_encodings("a", ())
    assert step(2).alternates == ()
    assert not runner.set_extra_encodings("nobody", (raw,))
    assert spec.frames_per_chunk == world[0].shape[0]


def test_extra_encodings_need_an_encoding_and_one_per_media() -> None:
    jpeg = FrameEncoding.for_media("jpeg")
    with pytest.raises(ValueError, match="need an encoding"):
        SessionOptions(extra_encodings=(jpeg,))
    with pytest.raises(ValueError, match="one encoding per media"):
        SessionOptions(encoding=jpeg, extra_encodings=(FrameEncoding.for_media("jpeg", 50),))
    assert SessionOptions(encoding=jpeg).encodings == (jpeg,)


async def test_an_unknown_media_on_join_is_refused() -> None:
    running = start_server("--model", "procedural", "--executor", "inprocess")
    try:
        async with WorldClient(running.ws) as host:
            info = await host.start(seed=1, media="jpeg", share_viewers=True)
            assert info.viewer_token is not None
            viewer = WorldClient(running.ws)
            await viewer.connect()
            with pytest.raises(WorldError) as refused:
                await viewer.join(info.session_id, info.viewer_token, media="png")
            assert refused.value.code == "invalid_message"
            await viewer.disconnect()
            await host.close()
            await asyncio.sleep(0)
    finally:
        running.stop()


async def test_the_runtime_keeps_a_sessions_extra_media_across_a_reset() -> None:
    """``Runtime.set_extra_encodings`` reaches the session's worker (its next chunk carries the media)
    and is kept in the session's options: the chunks after a reset still carry it."""
    h264, jpeg = FrameEncoding.for_media("h264"), FrameEncoding.for_media("jpeg")
    async with Runtime("procedural", executor="multiprocess", workers=1) as runtime:
        session = await runtime.create_session(seed=4, encoding=h264)
        first = await session.next_chunk()
        assert isinstance(first.frames, EncodedFrames)
        assert first.frames.alternates == ()
        assert runtime.set_extra_encodings(session.session_id, (jpeg,))
        chunk = await session.next_chunk()
        assert isinstance(chunk.frames, EncodedFrames)
        assert set(chunk.frames.versions()) == {"h264", "jpeg"}
        await session.reset()
        chunk = await session.next_chunk()
        assert isinstance(chunk.frames, EncodedFrames)
        assert chunk.frames.keyframe
        assert set(chunk.frames.versions()) == {"h264", "jpeg"}
        world = _truth(4, 1)
        assert (
            np.abs(decode_frames(chunk.frames.versions()["jpeg"]).astype(np.int16) - world[0]).mean() < JPEG_MEAN_ERROR
        )
        assert runtime.set_extra_encodings(session.session_id, ())
        chunk = await session.next_chunk()
        assert isinstance(chunk.frames, EncodedFrames)
        assert chunk.frames.alternates == ()
        await runtime.close_session(session.session_id)
