"""The server on its default model, the trained tinyworld, over real sockets.

A ``worldserve serve`` process started without ``--model``: a client starts a session,
holds a key and sees the view move that way, switches the prompt and sees the style change,
and leaves; the shipped weights, the worker process and the transport all run for real.
"""

from __future__ import annotations

import itertools
import json
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from server_harness import RunningServer, start_server
from worldserve.client import ClientChunk, WorldClient, keys
from worldserve.models.tinyworld.eval import StyleClassifier, phase_shift

#: CPU-bound model work: generous, so that a slow or busy CPU (e.g. float32 without AVX-512) passes too.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--workers", "1", timeout=300.0)
    yield running
    running.stop()


async def chunks_after(client: WorldClient, event_id: int, count: int) -> list[ClientChunk]:
    """The chunk that applies ``event_id`` and the ``count - 1`` chunks after it."""
    collected: list[ClientChunk] = []
    for _ in range(60):
        chunk = await client.next_chunk(timeout=60)
        if collected or event_id in chunk.applied_event_ids:
            collected.append(chunk)
        if len(collected) == count:
            return collected
    raise AssertionError(f"event {event_id} was not applied within 60 chunks")


def test_tinyworld_is_the_default_model(server: RunningServer) -> None:
    with urllib.request.urlopen(f"{server.http}/v1/models", timeout=10) as response:
        models = json.loads(response.read())["data"]
    assert [m["name"] for m in models] == ["tinyworld"]
    assert (models[0]["height"], models[0]["width"], models[0]["frames_per_chunk"]) == (48, 48, 4)


async def test_a_session_on_tinyworld_follows_keys_and_prompt(server: RunningServer) -> None:
    async with WorldClient(server.ws) as client:
        info = await client.start(prompt="desert dunes", seed=1_000_123)
        assert info.model["name"] == "tinyworld"
        first = await client.next_chunk(timeout=60)
        assert first.frames.shape == (4, 48, 48, 3)
        assert first.frames.dtype == np.uint8

        # Hold D: the view moves right (+x), frame after frame, and stays put in y.
        moving = await client.send_event(controls=[keys("D")])
        chunks = await chunks_after(client, moving.event_id, 3)
        frames = np.concatenate([c.frames for c in chunks])
        shifts = [phase_shift(a, b) for a, b in itertools.pairwise(frames)]
        rightward = [dx > 0 and dy == 0 for dx, dy in shifts]
        assert np.mean(rightward) >= 0.75, shifts

        # Let go, and switch the style: from the second chunk after the switch, it is snow.
        classifier = StyleClassifier.fit(range(2000, 2006), views=6)
        assert [classifier.predict(f) for f in first.frames].count("desert") >= 3
        switch = await client.send_event(prompt="snowy tundra", controls=[keys()])
        after = await chunks_after(client, switch.event_id, 4)
        named = [classifier.predict(f) for c in after[1:] for f in c.frames]
        assert named.count("snow") >= 0.75 * len(named), named
        still = [phase_shift(a, b) for c in after[1:] for a, b in itertools.pairwise(c.frames)]
        assert [s == (0, 0) for s in still].count(True) >= 0.75 * len(still), still
        await client.close()
