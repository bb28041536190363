"""The shared-memory frame buffer between a worker process and its parent."""

from __future__ import annotations

import os

import numpy as np
import pytest

from runtime_models import Truth
from worldserve import ChunkMetadata
from worldserve.runtime import MultiprocExecutor, Runtime
from worldserve.runtime.framebuf import FrameBuffer
from worldserve.runtime.messages import StepReport, TickFailure, TickOutput

SHAPE = (2, 4, 4, 3)


def output(value: int, chunk: int) -> TickOutput:
    return TickOutput(np.full(SHAPE, value, np.uint8), ChunkMetadata("s", f"r{chunk}", chunk))


def test_frames_cross_through_the_slots_and_failures_keep_their_place() -> None:
    parent = FrameBuffer.create(SHAPE, max_slots=3)
    assert parent is not None
    worker = FrameBuffer.attach(parent.name, parent.slots, SHAPE)
    failure = TickFailure("evicted", "gone")
    report = StepReport((output(1, 0), failure, output(2, 1)), compute_s=0.5)
    packed = worker.pack(report)
    assert packed is not None
    assert packed.results[1] == failure
    assert all(not isinstance(item, TickOutput) for item in packed.results)  # no frames left in the reply
    unpacked = parent.unpack(packed)
    worker.pack(StepReport((output(9, 2), output(9, 3)), compute_s=0.0))  # the next step reuses the slots
    assert unpacked.compute_s == 0.5
    assert unpacked.results[1] == failure
    first, third = unpacked.results[0], unpacked.results[2]
    assert isinstance(first, TickOutput)
    assert isinstance(third, TickOutput)
    assert (first.frames == 1).all()  # copied out: untouched by the reuse
    assert (third.frames == 2).all()
    assert third.metadata.chunk_index == 1
    worker.close()
    parent.close()
    if os.path.isdir("/dev/shm"):
        assert not os.path.exists(f"/dev/shm/{parent.name.lstrip('/')}")


def test_what_does_not_fit_is_left_to_the_pipe() -> None:
    parent = FrameBuffer.create(SHAPE, max_slots=64, budget_bytes=2 * int(np.prod(SHAPE)))
    assert parent is not None
    assert parent.slots == 2
    assert parent.pack(StepReport((output(1, 0), output(1, 1), output(1, 2)), 0.0)) is None  # too many
    odd = TickOutput(np.zeros((1, 4, 4, 3), np.uint8), ChunkMetadata("s", "r", 0))
    assert parent.pack(StepReport((odd,), 0.0)) is None  # another shape
    parent.close()
    assert FrameBuffer.create(SHAPE, max_slots=4, budget_bytes=10) is None


@pytest.mark.timeout(30)
async def test_the_pipe_fallback_serves_the_same_frames() -> None:

    for budget, slots in ((0, 0), (10**6, 64)):
        async with Runtime("procedural", frame_buffer_bytes=budget) as rt:
            executor = rt.engine.executor
            assert isinstance(executor, MultiprocExecutor)
            assert executor.shared_frame_slots(0) == min(slots, budget // (4 * 48 * 48 * 3))
            sessions = [await rt.create_session(seed=seed) for seed in (1, 2)]
            for seed, session in zip((1, 2), sessions, strict=True):
                assert np.array_equal((await session.next_chunk()).frames, Truth(seed).next(None, ()))
