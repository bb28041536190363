"""A chunk's frames handed on in parts while its step runs: the runner, both local executors and the engine.

A model with ``spec.frame_parts`` gives each row's frames to the step's sink as it makes them (the Wan
families: a latent frame at a time). The runner turns them into :class:`ChunkPart` s, encoded part by part
in the session's JPEG or raw encoding; the worker sends them ahead of the step's reply; the engine hands
them to ``execute_tick``'s ``on_part`` before the chunk. The parts joined are the chunk, always.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from runtime_models import PartsModel, Truth, keys
from worldserve.media import EncodedFrames, FrameEncoding, encode
from worldserve.models import SessionOptions
from worldserve.protocol import TickRequest
from worldserve.runtime import (
    ChunkPart,
    Engine,
    EngineConfig,
    InprocExecutor,
    ModelRunner,
    MultiprocExecutor,
    Runtime,
    WorkerConfig,
)
from worldserve.runtime.messages import TickFailure, TickOutput

pytestmark = pytest.mark.timeout(300)


def _tick(sid: str, chunk: int, prompt: str | None = None) -> TickRequest:
    return TickRequest(sid, f"{sid}-{chunk}", chunk, prompt=prompt, controls=(keys("D"),))


def _joined(parts: list[ChunkPart], sid: str) -> list[ChunkPart]:
    return [part for part in parts if part.session_id == sid]


def test_the_runner_hands_on_parts_encoded_per_part_and_the_chunk_is_their_payloads() -> None:
    runner = ModelRunner(PartsModel(part=2))
    runner.admit("jpeg", SessionOptions(seed=1, encoding=FrameEncoding("jpeg")))
    runner.admit("array", SessionOptions(seed=2))
    runner.admit("h264", SessionOptions(seed=3, encoding=FrameEncoding.for_media("h264")))
    runner.admit("whole", SessionOptions(seed=1, encoding=FrameEncoding("jpeg")))  # "jpeg"'s world
    parts: list[ChunkPart] = []
    ticks = [_tick(sid, 0) for sid in ("jpeg", "array", "h264", "whole")]
    report = runner.step(ticks, parted={"jpeg", "array", "h264"}, on_part=parts.append)
    jpeg, array, h264, whole = report.results
    assert all(isinstance(result, TickOutput) for result in report.results)
    # H.264 is one stream per chunk: no parts. "whole" was not asked for. The others: 2 frames at a time.
    out = [(p.session_id, p.first, p.count) for p in parts]
    assert out == [("jpeg", 0, 2), ("array", 0, 2), ("jpeg", 2, 2), ("array", 2, 2)]
    assert isinstance(jpeg, TickOutput)
    assert isinstance(jpeg.frames, EncodedFrames)
    sent = [payload for part in _joined(parts, "jpeg") for payload in part.frames.payloads]  # type: ignore[union-attr]
    assert list(jpeg.frames.payloads) == sent  # encoded once, per part
    assert jpeg.frames.payloads == whole.frames.payloads  # type: ignore[union-attr]  # the same bytes as whole
    truth = Truth(2)
    assert isinstance(array, TickOutput)
    joined = np.concatenate([part.frames for part in _joined(parts, "array")])  # type: ignore[misc]
    assert np.array_equal(joined, array.frames)
    assert np.array_equal(joined, truth.next(None, [keys("D")]))
    assert isinstance(h264, TickOutput)
    assert isinstance(h264.frames, EncodedFrames)
    assert h264.frames.encoding.media == "h264"
    assert report.encode_s > 0.0


def test_a_step_that_fails_after_a_part_fails_those_sessions_instead_of_making_their_frames_twice() -> None:
    runner = ModelRunner(PartsModel(part=2))
    for sid in ("a", "b", "c"):
        runner.admit(sid, SessionOptions(seed=1))
    parts: list[ChunkPart] = []
    report = runner.step([_tick("a", 0, "cracked"), _tick("b", 0)], parted={"a", "b"}, on_part=parts.append)
    assert [(p.session_id, p.first) for p in parts] == [("a", 0), ("b", 0)]  # out before the step raised
    for result in report.results:
        assert isinstance(result, TickFailure)
        assert result.code == "model_error"
        assert "after frames of its chunk were sent" in result.message
    assert runner.resident_sessions() == ("c",)
    # A batch that fails before any part is out retries each tick alone: the good one's parts come once.
    runner.admit("d", SessionOptions(seed=1))
    parts.clear()
    report = runner.step([_tick("c", 0, "poison"), _tick("d", 0)], parted={"c", "d"}, on_part=parts.append)
    failed, done = report.results
    assert isinstance(failed, TickFailure)
    assert "poisoned" in failed.message
    assert isinstance(done, TickOutput)
    assert [(p.session_id, p.first) for p in parts] == [("d", 0), ("d", 2)]
    assert np.array_equal(np.concatenate([p.frames for p in parts]), done.frames)  # type: ignore[misc]


@pytest.mark.parametrize("executor", ["inprocess", "multiprocess"])
async def test_the_engine_hands_parts_to_the_tick_that_asked_before_its_chunk(executor: str) -> None:
    config = WorkerConfig("runtime_models:PartsModel", {"part": 1})
    workers = InprocExecutor(config) if executor == "inprocess" else MultiprocExecutor(config)
    engine = Engine(workers, EngineConfig(batch_wait_s=0.05))
    await engine.start()
    try:
        await engine.add_session("a", SessionOptions(seed=5, encoding=FrameEncoding("jpeg")))
        await engine.add_session("b", SessionOptions(seed=6))
        heard: list[tuple[ChunkPart, bool]] = []
        chunks: dict[str, Any] = {}

        async def run(sid: str, wants: bool) -> None:
            task = asyncio.ensure_future(
                engine.execute_tick(
                    _tick(sid, 0), (lambda part: heard.append((part, sid in chunks))) if wants else None
                )
            )
            chunks[sid] = await task

        await asyncio.gather(run("a", True), run("b", False))
        assert [(part.session_id, part.first, done) for part, done in heard] == [("a", i, False) for i in range(4)]
        chunk = chunks["a"]
        assert isinstance(chunk.frames, EncodedFrames)
        payloads = [payload for part, _ in heard for payload in part.frames.payloads]  # type: ignore[union-attr]
        assert list(chunk.frames.payloads) == payloads
        assert chunk.frames.payloads == encode(Truth(5).next(None, [keys("D")]), FrameEncoding("jpeg")).payloads
    finally:
        await engine.shutdown()


async def test_wan_causal_through_worker_processes_streams_each_latent_frame_of_its_chunks() -> None:
    """The real model in a real worker process: each chunk's 3 latent frames arrive as 3 parts of 4
    frames, ahead of the chunk, and join into it bit for bit."""
    pytest.importorskip("diffusers")
    config = WorkerConfig("wan-causal", {"config": "tiny", "threads": 1}, cpu_threads=1)
    engine = Engine(MultiprocExecutor(config), EngineConfig())
    await engine.start()
    try:
        await engine.add_session("w", SessionOptions(seed=3))
        for index in range(2):
            parts: list[ChunkPart] = []
            chunk = await engine.execute_tick(TickRequest("w", f"w-{index}", index), parts.append)
            assert [(part.first, part.count) for part in parts] == [(0, 4), (4, 4), (8, 4)]
            assert np.array_equal(np.concatenate([part.frames for part in parts]), chunk.frames)  # type: ignore[misc]
    finally:
        await engine.shutdown()


async def test_a_runtime_session_s_listener_hears_its_chunks_in_parts_and_stops_when_told() -> None:
    """``Runtime.listen_parts``: what a server would use, through the session's own ``next_chunk``."""
    async with Runtime(
        "runtime_models:PartsModel", executor="inprocess", model_options={"part": 2}, encode_frames="worker"
    ) as rt:
        session = await rt.create_session(seed=9, encoding=FrameEncoding("raw"))
        heard: list[ChunkPart] = []
        assert rt.listen_parts(session.session_id, heard.append)
        first = await session.next_chunk()
        assert [(p.chunk_index, p.first) for p in heard] == [(0, 0), (0, 2)]
        assert first.frames.payloads == tuple(b for p in heard for b in p.frames.payloads)  # type: ignore[union-attr]
        assert rt.listen_parts(session.session_id, None)
        await session.next_chunk()
        assert len(heard) == 2  # no listener: no parts
    async with Runtime("procedural", executor="inprocess") as rt:
        session = await rt.create_session()
        assert not rt.listen_parts(session.session_id, heard.append)  # a model that makes its chunks whole
