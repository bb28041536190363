"""A chunk's frames in parts through the real page, in Debian's headless Chromium.

The server runs a model that makes each chunk in parts (``runtime_models:PartsModel``: the procedural
world handed on a frame at a time, a pause between parts), so the page (which asks for parts in JPEG and
raw) plays each chunk's first frames before the chunk itself comes. Every frame it draws is checked against
the world where the applied events put it, each once and in order; the page acks each chunk and takes its
key-to-screen figure from its first part.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from server_harness import RunningServer, start_server
from test_browser import SEED, Recording, assert_in_chunk_order, assert_replayed, open_page, wait_for

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(
        "--model", "runtime_models:PartsModel", "--model-option", "part=1", "--model-option", "pause_s=0.02",
        test_models=True,
    )  # fmt: skip
    yield running
    running.stop()


@pytest.mark.parametrize("query", ["?media=raw", "?media=raw&parts=0"])
def test_the_page_plays_each_chunk_as_its_parts_come_every_frame_once_at_its_place(
    server: RunningServer, query: str
) -> None:
    with open_page(server, query) as page:
        recording = Recording(page)
        page.fill("#prompt", "islands")
        page.fill("#seed", str(SEED))
        page.click("#start")
        wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        page.click("#screen")
        for turn in range(6):  # taps, so that chunks apply keys and the page measures key to screen
            key = "KeyD" if turn % 2 == 0 else "KeyA"
            page.keyboard.down(key)
            page.wait_for_timeout(150)
            page.keyboard.up(key)
            page.wait_for_timeout(350)
        shown = page.evaluate("() => window.worldserve.chunkIndex")
        recording.wait_drawn(0, shown + 2)
        drawn = recording.drawn()
        assert_in_chunk_order(drawn)
        assert_replayed(recording, drawn, "islands")
        parts = page.evaluate("() => window.worldserve.parts")
        photons = page.evaluate("() => window.worldserve.keyToPhotonLog")
        assert photons, "no key-to-screen figure"
        if "parts=0" in query:
            assert parts == 0
            return
        assert parts >= 4 * (shown + 2)  # every frame of every chunk came in a part
        for figure in photons:  # each figure's parts, taken from the first part's instants, sum to it
            named = [figure[name] for name in ("wait_tick", "step", "encode", "transfer", "decode", "buffer")]
            assert abs(sum(named) - figure["total"]) < 1e-6
            assert figure["encode"] == 0  # the first part left as it was made and encoded
        # acked as each chunk's first frame showed, once the chunk came: the server kept sending
        assert page.evaluate("() => window.worldserve.status") == "live"
