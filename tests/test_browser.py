"""The browser player in a real headless Chromium (Debian's), driven by Playwright.

The server runs the procedural model with raw frames, so every frame the page shows
can be matched exactly against the world rendered at some view position: holding a
key must move that position the right way, a prompt must switch the palette, and a
reset must bring back the start view.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from playwright.sync_api import Page, sync_playwright

from server_harness import RunningServer, start_server
from worldserve.models.world import World

CHROMIUM = os.environ.get("WORLDSERVE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
SEED = 11
SIZE = 48


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


@contextlib.contextmanager
def open_page(server: RunningServer) -> Iterator[Page]:
    """The player page of ``server`` in Debian's headless Chromium."""
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}; `make test` installs Debian's chromium package.")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_page()
        page.goto(server.http + "/")
        yield page
        browser.close()


@pytest.fixture
def page(server: RunningServer) -> Iterator[Page]:
    with open_page(server) as opened:
        yield opened


def canvas(page: Page) -> npt.NDArray[np.uint8]:
    data = page.evaluate(
        "() => { const c = document.getElementById('screen');"
        " return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }"
    )
    return np.asarray(data, dtype=np.uint8).reshape(SIZE, SIZE, 4)[..., :3]


def locate(frame: npt.NDArray[np.uint8], style: str, xs: range, ys: range) -> tuple[int, int] | None:
    """The view position whose rendering equals ``frame`` exactly, if any."""
    world = World(SEED)
    for y in ys:
        for x in xs:
            if np.array_equal(world.render(x, y, SIZE, SIZE, style), frame):
                return (x, y)
    return None


def wait_for(page: Page, condition: str, timeout: float = 20.0) -> None:
    page.wait_for_function(condition, timeout=timeout * 1000)


def test_player_moves_switches_style_and_resets(page: Page) -> None:
    page.fill("#prompt", "islands")
    page.fill("#seed", str(SEED))
    page.click("#start")
    wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
    # No keys held: the view stays at the start position.
    assert locate(canvas(page), "islands", range(0, 1), range(0, 1)) == (0, 0)

    page.click("#screen")
    page.keyboard.down("KeyD")
    positions = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        found = locate(canvas(page), "islands", range(0, 400, 2), range(0, 1))
        assert found is not None, "the canvas shows something that is not the world"
        positions.append(found[0])
        time.sleep(0.1)
    page.keyboard.up("KeyD")
    assert positions[-1] > positions[0] + 10, positions  # D moves the view right
    assert positions == sorted(positions), positions  # and never back

    wait_for(page, "window.worldserve.displayed > 0")
    time.sleep(0.6)
    stopped = locate(canvas(page), "islands", range(0, 600, 2), range(0, 1))
    assert stopped is not None
    page.fill("#prompt", "a snowy tundra")
    page.click("#apply-prompt")
    time.sleep(1.2)
    assert locate(canvas(page), "snow", range(stopped[0], stopped[0] + 1), range(0, 1)) == stopped

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-player.png"))

    page.click("#reset")
    wait_for(page, "window.worldserve.epoch === 1 && window.worldserve.chunkIndex === 0")
    time.sleep(0.3)
    # After a reset the world starts over: start view, start prompt's style.
    assert locate(canvas(page), "islands", range(0, 1), range(0, 1)) == (0, 0)

    # Dragging grabs the world: pulling it to the right pans the camera left.
    box = page.locator("#screen").bounding_box()
    assert box is not None
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    for step in range(1, 13):
        page.mouse.move(x + step * 12, y)
        time.sleep(0.05)
    page.mouse.up()
    time.sleep(1.2)
    dragged = locate(canvas(page), "islands", range(-300, 1), range(0, 1))
    assert dragged is not None
    assert dragged[0] < -4, dragged
    time.sleep(0.6)
    assert locate(canvas(page), "islands", range(dragged[0], dragged[0] + 1), range(0, 1)) == dragged  # stopped
