"""A cancelled ``WorldClient.next_chunk`` stops, and the chunk it was about to hand over is not lost.

On Python 3.11 ``asyncio.wait_for`` returns the inner result when a cancel lands in the same loop
turn the item arrives: the cancel is swallowed, and a player task such as ``while True: await
client.next_chunk()`` runs on after ``task.cancel()`` (a hang seen in CI, test_member_media). Every
interleaving of the chunk's arrival, the ack's send and the cancel is tried here, one loop turn at a
time: the task always ends cancelled, and the next call gets the chunk.

The client is a unit here: no server; its chunk queue is fed directly, and a socket whose ``send``
takes a loop turn stands in for the websocket so that a cancel can land while a chunk is acked.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from worldserve.client import ClientChunk, WorldClient


class _Socket:
    """What next_chunk's ack touches of a websocket: ``send``, which yields once before it lands."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, text: str) -> None:
        await asyncio.sleep(0)
        self.sent.append(json.loads(text))


def _chunk(seq: int) -> ClientChunk:
    return ClientChunk(
        seq=seq,
        epoch=0,
        chunk_index=seq,
        request_id=f"r{seq}",
        applied_event_ids=(),
        frames=np.zeros((1, 2, 2, 3), np.uint8),
        timings={},
        batch_size=1,
        applied_latency_ms=(),
        received_at=0.0,
    )


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


@pytest.mark.parametrize("timeout", [None, 30.0])
@pytest.mark.parametrize("acking", [False, True])
async def test_a_cancel_always_stops_next_chunk_and_never_loses_the_chunk(acking: bool, timeout: float | None) -> None:
    outcomes = set()
    for before in range(6):
        for after in range(6):
            client = WorldClient("ws://unused")
            socket = _Socket()
            if acking:
                client._ws = socket  # type: ignore[assignment]
            waiting = asyncio.create_task(client.next_chunk(timeout=timeout))
            await _turns(before)
            client._chunks.put_nowait(_chunk(7))
            await _turns(after)
            if waiting.done():  # handed over before the cancel: nothing to lose
                assert waiting.result().seq == 7
                outcomes.add("returned")
                continue
            assert waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            outcomes.add("cancelled")
            again = await client.next_chunk(timeout=1)
            assert again.seq == 7, (before, after)
            if acking:
                assert {message["seq"] for message in socket.sent} == {7}  # acked, maybe twice
    assert outcomes == {"returned", "cancelled"}  # both sides of the race were reached


async def test_a_player_task_cancelled_as_chunks_stream_in_stops() -> None:
    """The shape of test_member_media's host: a task reading chunks forever, cancelled mid-stream."""
    for offset in range(8):
        client = WorldClient("ws://unused")
        client._ws = _Socket()  # type: ignore[assignment]
        got: list[int] = []

        async def play(client: WorldClient = client, got: list[int] = got) -> None:
            while True:
                got.append((await client.next_chunk(timeout=30)).seq)

        player = asyncio.create_task(play())
        for seq in range(20):
            client._chunks.put_nowait(_chunk(seq))
            await _turns(1 + (seq + offset) % 3)
        player.cancel()
        async with asyncio.timeout(5):  # the lost cancel: the task would wait for chunk 20 forever
            with pytest.raises(asyncio.CancelledError):
                await player
        rest = [(await client.next_chunk(timeout=1)).seq for _ in range(20 - len(got))]
        assert got + rest == list(range(20))  # each chunk handed over once, in order
