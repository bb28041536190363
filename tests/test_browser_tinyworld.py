"""The browser player on the default model, the trained tinyworld, in a real headless Chromium.

tinyworld's frames cannot be matched exactly against the world, so the page is checked
with the evaluation's own measures: phase correlation between the frames the canvas shows
(holding D moves the view right) and the style classifier (a prompt switches the style).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page

from server_harness import RunningServer, start_server
from test_browser import ARTIFACTS, canvas, open_page, wait_for
from worldserve.models.tinyworld.eval import StyleClassifier, phase_shift


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(timeout=120.0)  # no --model: the default
    yield running
    running.stop()


@pytest.fixture
def page(server: RunningServer) -> Iterator[Page]:
    with open_page(server) as opened:
        yield opened


def test_player_on_tinyworld_moves_and_switches_style(page: Page) -> None:
    page.fill("#prompt", "desert dunes")
    page.fill("#seed", "1000321")
    page.click("#start")
    wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")

    page.click("#screen")
    page.keyboard.down("KeyD")
    time.sleep(0.5)  # the key event reaches a chunk boundary
    frames = []
    for _ in range(12):
        frames.append(canvas(page))
        time.sleep(0.1)
    page.keyboard.up("KeyD")
    shifts = [phase_shift(a, b) for a, b in itertools.pairwise(frames)]
    moved = [s for s in shifts if s != (0, 0)]  # the canvas may not have changed between two looks
    assert len(moved) >= 4, shifts
    assert all(dx > 0 for dx, _ in moved), shifts  # D moves the view right

    classifier = StyleClassifier.fit(range(2000, 2006), views=6)
    assert classifier.predict(canvas(page)) == "desert"
    page.fill("#prompt", "a snowy tundra")
    page.click("#apply-prompt")
    time.sleep(1.5)
    named = []
    for _ in range(5):
        named.append(classifier.predict(canvas(page)))
        time.sleep(0.1)
    assert named.count("snow") >= 4, named

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-player-tinyworld.png"))
