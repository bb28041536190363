"""Tick gathering through a real server: staggered clients on one worker end up in one batch.

A ``worldserve serve --model procedural`` process with one worker; clients start at
different times (so each one's own pacing would keep them out of phase) and the test
reads what the chunks say: after warm-up every chunk came from a step of all sessions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from server_harness import RunningServer, start_server
from worldserve.client import WorldClient, keys

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--workers", "1")
    yield running
    running.stop()


async def _play(
    url: str, delay: float, seed: int, everyone: asyncio.Event, started: list[int], finished: list[int]
) -> list[int]:
    """Start after ``delay``; once everyone has started, skip 4 chunks and report 8 chunks' batch
    sizes; keep playing until everyone has reported."""
    await asyncio.sleep(delay)
    async with WorldClient(url) as client:
        await client.start(seed=seed)
        started.append(seed)
        await client.send_event(event_id=1, controls=[keys("W")])
        while not everyone.is_set():
            await client.next_chunk(timeout=10)
            if len(started) == 3:
                everyone.set()
        for _ in range(4):  # warm-up: the last joiner's first chunks
            await client.next_chunk(timeout=10)
        sizes = [(await client.next_chunk(timeout=10)).batch_size for _ in range(8)]
        finished.append(seed)
        while len(finished) < 3:
            await client.next_chunk(timeout=10)
        await client.close()
        return sizes


async def test_staggered_sessions_on_one_worker_batch_together(server: RunningServer) -> None:
    everyone = asyncio.Event()
    started: list[int] = []
    finished: list[int] = []
    sizes = await asyncio.gather(
        *(_play(server.ws, delay, seed, everyone, started, finished) for seed, delay in enumerate([0.0, 0.33, 0.71]))
    )
    assert sizes == [[3] * 8] * 3, sizes
