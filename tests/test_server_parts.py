"""A chunk's frames in parts through the real server and client: ``session.start``'s ``options.parts``.

The server runs a model that makes each chunk in parts (``runtime_models:PartsModel``, the procedural
world handed on a frame at a time, with a pause between parts); a client that asked for parts hears each
part (``chunk.part``) before its chunk, and the chunk then carries only what it did not have: what the
client assembles is, frame for frame, what a client that did not ask is sent whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from runtime_models import Truth
from server_harness import RunningServer, start_server
from worldserve.client import ClientPart, WorldClient, WorldError

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(
        "--model", "runtime_models:PartsModel", "--model-option", "part=1", "--model-option", "pause_s=0.05",
        "--workers", "1", test_models=True,
    )  # fmt: skip
    yield running
    running.stop()


@pytest.mark.parametrize("media", ["raw", "jpeg"])
async def test_a_client_that_asks_hears_each_chunk_in_parts_and_assembles_what_others_get_whole(
    server: RunningServer, media: str
) -> None:
    async with WorldClient(server.ws) as parted, WorldClient(server.ws) as whole:
        heard: list[ClientPart] = []
        parted.on_part = heard.append
        info = await parted.start("islands", seed=4, media=media, parts=True)
        assert info.model["frame_parts"] is True
        await whole.start("islands", seed=4, media=media)
        truth = Truth(4, "islands")
        for index in range(3):
            mine, theirs = await parted.next_chunk(timeout=30), await whole.next_chunk(timeout=30)
            assert (mine.chunk_index, theirs.chunk_index) == (index, index)
            parts = [part for part in heard if part.seq == mine.seq]
            assert [part.first for part in parts] == [0, 1, 2, 3]  # a frame at a time, in order, before the chunk
            assert all(part.received_at <= mine.received_at for part in parts)
            assert (mine.parted, theirs.parted) == (4, 0)
            assert mine.first_part_at == parts[0].received_at
            assert np.array_equal(np.concatenate([part.frames for part in parts]), mine.frames)
            assert np.array_equal(mine.frames, theirs.frames)
            expected = truth.next(None, ())
            if media == "raw":  # exact: the world the model makes
                assert np.array_equal(mine.frames, expected)


async def test_a_chunk_whose_frames_are_out_is_not_cancelled(server: RunningServer) -> None:
    async with WorldClient(server.ws) as client:
        first_part = asyncio.Event()
        client.on_part = lambda part: first_part.set() if part.chunk_index == 1 and part.first == 0 else None
        await client.start(seed=1, media="raw", parts=True)
        await client.next_chunk(timeout=30)
        await asyncio.wait_for(first_part.wait(), 30)  # chunk 1's first frame is out; 3 more to come, 50 ms apart
        with pytest.raises(WorldError) as refused:
            await client.cancel_chunk()
        assert refused.value.code == "nothing_to_cancel"
        assert "first frames were sent already" in str(refused.value)
        chunk = await client.next_chunk(timeout=30)
        assert (chunk.chunk_index, chunk.parted) == (1, 4)  # it came as it was, whole
