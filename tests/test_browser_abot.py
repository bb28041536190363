"""The browser player on ``abot-world`` (tiny, random weights) in a real headless Chromium.

The page shows the model's eight keys, and the arrow keys look (I J K L) for a model that takes the
look keys, as ABot-World's own page maps them. The server journals the session, so the keys each chunk
was made under (the tick's snapshot: what reached the model) are compared with what the page pressed:
the chunk that applied W with the up arrow held W and I.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page

from server_harness import RunningServer, start_server
from test_browser import ARTIFACTS, Recording, open_page, wait_for
from test_browser_matrix import controls_of

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def journals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("journals")


@pytest.fixture(scope="module")
def server(journals: Path) -> Iterator[RunningServer]:
    running = start_server(
        "--model", "abot-world", "--threads-per-worker", "1", "--record-dir", str(journals), timeout=240.0
    )
    yield running
    running.stop()


@pytest.fixture
def page(server: RunningServer) -> Iterator[Page]:
    with open_page(server) as opened:
        yield opened


def test_the_player_shows_its_eight_keys_and_the_arrows_look(page: Page, journals: Path) -> None:
    recording = Recording(page)
    page.click("#start")
    wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 2")
    legend = page.eval_on_selector_all("#controls-legend kbd", "(keys) => keys.map((k) => k.dataset.key)")
    assert legend == ["W", "A", "S", "D", "I", "J", "K", "L"]
    assert "arrows to look" in (page.get_attribute("#screen", "aria-label") or "")
    page.click("#screen")
    page.keyboard.down("KeyW")
    page.keyboard.down("ArrowUp")
    pressed = recording.sent_event("(e) => e.controls.some((c) => c.track === 'keys' && c.data.held.join() === 'W,I')")
    # Held keys are state: a newer keys event supersedes one still queued, so each is let apply first.
    _, pressed_chunk = recording.applied_in(pressed["event_id"])
    page.keyboard.up("ArrowUp")
    page.keyboard.down("ArrowLeft")
    turned = recording.sent_event("(e) => e.controls.some((c) => c.track === 'keys' && c.data.held.join() === 'W,J')")
    _, turned_chunk = recording.applied_in(turned["event_id"])
    page.keyboard.up("ArrowLeft")
    page.keyboard.up("KeyW")
    recording.wait_drawn(0, turned_chunk)
    page.click("#close")
    wait_for(page, "window.worldserve.status === 'idle'")
    journal = next(journals.glob("*.jsonl"))
    assert controls_of(journal, pressed_chunk)["keys"] == {"held": ("W", "I")}
    assert controls_of(journal, turned_chunk)["keys"] == {"held": ("W", "J")}
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-player-abot-world.png"))
