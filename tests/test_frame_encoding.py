"""Workers hand back encoded frames: the runner encodes a session's frames when its options ask,
the payloads cross every executor intact (shared memory, the pipe), and the server sends them
as they are. Compared against the server's own encoding of the model's exact frames (Pillow's
JPEG is deterministic for identical input) and the procedural model's known frames."""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import pytest

from runtime_models import Truth
from server_harness import JPEG_MEAN_ERROR, check_frames_and_events, start_server
from worldserve import ChunkMetadata, TickRequest
from worldserve.media import EncodedFrames, FrameEncoding, decode_frames, encode, encode_frames
from worldserve.models import SessionOptions, load_model
from worldserve.runtime import ModelRunner, Runtime, RuntimeConfig
from worldserve.runtime.framebuf import FrameBuffer
from worldserve.runtime.messages import StepReport, TickFailure, TickOutput

pytestmark = pytest.mark.timeout(60)

JPEG = FrameEncoding("jpeg", 80)
RAW = FrameEncoding("raw")
JPEG_TOLERANCE = JPEG_MEAN_ERROR


def tick(session: str, chunk: int) -> TickRequest:
    return TickRequest(session, f"{session}-{chunk}", chunk)


def test_frame_encoding_is_checked_and_raw_ignores_the_quality() -> None:
    with pytest.raises(ValueError, match="unknown media"):
        FrameEncoding("png")
    with pytest.raises(ValueError, match="quality"):
        FrameEncoding("jpeg", 0)
    with pytest.raises(ValueError, match="FrameEncoding"):
        SessionOptions(encoding="jpeg")  # type: ignore[arg-type]
    assert FrameEncoding("raw", 10).same_bytes(FrameEncoding("raw", 90))
    assert not FrameEncoding("jpeg", 10).same_bytes(FrameEncoding("jpeg", 90))
    assert not JPEG.same_bytes(RAW)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_runner_encodes_only_the_sessions_that_asked_and_times_it_apart(threads: int) -> None:
    runner = ModelRunner(load_model("procedural"), encode_threads=threads)
    runner.admit("jpeg", SessionOptions(seed=1, encoding=JPEG))
    runner.admit("raw", SessionOptions(seed=2, encoding=RAW))
    runner.admit("array", SessionOptions(seed=3))
    truths = {"jpeg": Truth(1), "raw": Truth(2), "array": Truth(3)}
    for chunk in range(2):
        report = runner.step([tick(sid, chunk) for sid in truths])
        made = {sid: truth.next(None, ()) for sid, truth in truths.items()}
        jpeg, raw, array = (result.frames for result in report.results if isinstance(result, TickOutput))
        assert isinstance(jpeg, EncodedFrames)
        assert (jpeg.encoding, jpeg.width, jpeg.height, jpeg.count) == (JPEG, 48, 48, 4)
        assert list(jpeg.payloads) == encode_frames(made["jpeg"], "jpeg", 80)  # what the server would send
        decoded = decode_frames(jpeg).astype(np.int16)
        assert np.abs(decoded - made["jpeg"]).mean() < JPEG_TOLERANCE
        assert isinstance(raw, EncodedFrames)
        assert np.array_equal(decode_frames(raw), made["raw"])  # raw passes through exactly
        assert isinstance(array, np.ndarray)
        assert np.array_equal(array, made["array"])
        assert report.encode_s > 0
    alone = runner.step([tick("array", 2)])
    assert alone.encode_s == 0.0
    with pytest.raises(ValueError, match="encode_threads"):
        ModelRunner(load_model("procedural"), encode_threads=0)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_chunk_that_fails_to_encode_fails_only_its_own_session(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import worldserve.media as media_module

    doomed = FrameEncoding("jpeg", 77)

    def encoder_that_breaks_on_quality_77(frames: np.ndarray, encoding: FrameEncoding) -> EncodedFrames:
        if encoding == doomed:
            raise OSError("encoder broke")
        return encode(frames, encoding)

    runner = ModelRunner(load_model("procedural"), encode_threads=threads)
    runner.admit("bad", SessionOptions(seed=1, encoding=doomed))
    runner.admit("good", SessionOptions(seed=2, encoding=JPEG))
    runner.admit("array", SessionOptions(seed=3))
    monkeypatch.setattr(media_module, "encode", encoder_that_breaks_on_quality_77)  # what each session's encoder calls
    report = runner.step([tick("bad", 0), tick("good", 0), tick("array", 0)])
    failed, encoded, array = report.results
    assert isinstance(failed, TickFailure)
    assert failed.code == "bad_output"
    assert "could not be encoded as jpeg" in failed.message
    assert isinstance(encoded, TickOutput)
    assert isinstance(encoded.frames, EncodedFrames)
    assert list(encoded.frames.payloads) == encode_frames(Truth(2).next(None, ()), "jpeg", 80)
    assert isinstance(array, TickOutput)
    assert isinstance(array.frames, np.ndarray)
    assert "bad" not in runner.resident_sessions()  # computed past what was delivered: released
    again = runner.step([tick("bad", 1), tick("good", 1)])
    assert isinstance(again.results[0], TickFailure)
    assert isinstance(again.results[1], TickOutput)


def test_encoded_outputs_ride_the_pipe_beside_the_slots() -> None:
    shape = (4, 48, 48, 3)
    parent = FrameBuffer.create(shape, max_slots=1)
    assert parent is not None
    worker = FrameBuffer.attach(parent.name, parent.slots, shape)
    frames = Truth(5).next(None, ())
    encoded = TickOutput(encode(frames, JPEG), ChunkMetadata("a", "r", 0))
    array = TickOutput(frames.copy(), ChunkMetadata("b", "r", 0))
    failure = TickFailure("evicted", "gone")
    # Two encoded outputs and one array: only the array needs the buffer's one slot.
    packed = worker.pack(StepReport((encoded, array, failure, encoded), compute_s=0.25, encode_s=0.5))
    assert packed is not None
    unpacked = parent.unpack(packed)
    assert (unpacked.compute_s, unpacked.encode_s) == (0.25, 0.5)
    assert unpacked.results[0] == encoded
    assert unpacked.results[3] == encoded
    assert unpacked.results[2] == failure
    moved = unpacked.results[1]
    assert isinstance(moved, TickOutput)
    assert isinstance(moved.frames, np.ndarray)
    assert np.array_equal(moved.frames, frames)
    worker.close()
    parent.close()


def test_encode_frames_flag_and_where_auto_encodes() -> None:
    parser = argparse.ArgumentParser()
    RuntimeConfig.add_cli_arguments(parser)
    assert RuntimeConfig.from_cli_arguments(parser.parse_args([])).encode_frames == "auto"
    flags = parser.parse_args(["--encode-frames", "worker"])
    assert RuntimeConfig.from_cli_arguments(flags).encodes_in_worker
    for executor in ("ray", "multiprocess", "inprocess"):  # auto: measured better everywhere (docs/deploy.md)
        assert RuntimeConfig(executor=executor).encodes_in_worker
        assert not RuntimeConfig(executor=executor, encode_frames="server").encodes_in_worker
    with pytest.raises(ValueError, match="encode_frames"):
        RuntimeConfig(encode_frames="gpu")


@pytest.mark.parametrize(
    ("executor", "buffer"), [("inprocess", None), ("multiprocess", None), ("multiprocess", 0)], ids=str
)
async def test_workers_hand_back_the_bytes_the_server_would_have_made(executor: str, buffer: int | None) -> None:
    """Mixed batches (encoded, raw and array sessions in one step) through each executor; with
    ``frame_buffer_bytes=0`` the multiprocess step crosses the pipe whole, pickled."""
    options = {} if buffer is None else {"frame_buffer_bytes": buffer}
    config = RuntimeConfig(model="procedural", executor=executor, encode_frames="worker", batch_wait_s=0.3, **options)
    async with Runtime(config=config) as rt:
        jpeg = await rt.create_session(seed=1, encoding=JPEG)
        raw = await rt.create_session(seed=2, encoding=RAW)
        plain = await rt.create_session(seed=3)
        truths = [Truth(1), Truth(2), Truth(3)]
        for _ in range(2):
            chunks = await asyncio.gather(jpeg.next_chunk(), raw.next_chunk(), plain.next_chunk())
            made = [truth.next(None, ()) for truth in truths]
            assert max(chunk.batch_size for chunk in chunks) > 1  # at least two of them shared a step
            assert isinstance(chunks[0].frames, EncodedFrames)
            assert list(chunks[0].frames.payloads) == encode_frames(made[0], "jpeg", JPEG.quality)
            assert isinstance(chunks[1].frames, EncodedFrames)
            assert list(chunks[1].frames.payloads) == encode_frames(made[1], "raw")
            assert np.array_equal(chunks[2].array(), made[2])
            assert not chunks[2].array().flags.writeable
            assert chunks[0].encode_s > 0
            with pytest.raises(TypeError, match="encoded by the worker"):
                chunks[0].array()


async def test_encoding_on_the_server_keeps_arrays_for_every_session() -> None:
    async with Runtime("procedural", executor="inprocess", encode_frames="server") as rt:
        session = await rt.create_session(seed=1, encoding=JPEG)
        chunk = await session.next_chunk()
        assert np.array_equal(chunk.array(), Truth(1).next(None, ()))
        assert chunk.encode_s == 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("encode_at", ["worker", "server"])
async def test_server_over_processes_sends_valid_frames_and_loses_and_duplicates_no_event(encode_at: str) -> None:
    server = start_server(
        "--model", "procedural", "--workers", "2", "--executor", "multiprocess", "--encode-frames", encode_at
    )  # fmt: skip
    await check_frames_and_events(server)
