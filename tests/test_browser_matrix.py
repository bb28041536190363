"""The browser player on ``matrix-game-2`` (tiny, random weights) in a real headless Chromium.

The page learns the served model's spec, asks for a start image (the model is image-to-world) and fits
the chosen file to the model's frame size; it shows the variant's own keys; a click on the view captures
the mouse (pointer lock) and its movement turns the camera. The server journals the session, so the
controls each chunk was made under (the tick's snapshot: what reached the model) are compared with what
the page pressed and moved: the chunk that applied the page's key event holds that key, and the one that
applied its last mouse event holds that turn.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import Page

from server_harness import RunningServer, start_server
from test_browser import ARTIFACTS, Recording, open_page, wait_for
from worldserve.runtime.journal import read_journal

pytestmark = pytest.mark.timeout(600)


def png(width: int, height: int) -> bytes:
    """A start image of another size than the model's (the page fits it)."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[: height // 2] = (120, 170, 230)
    pixels[height // 2 :] = (70, 110, 50)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(journals: Path) -> Iterator[RunningServer]:
    running = start_server(
        "--model", "matrix-game-2", "--threads-per-worker", "1", "--record-dir", str(journals), timeout=240.0
    )
    yield running
    running.stop()


def controls_of(journal: Path, chunk: int) -> dict[str, dict[str, object]]:
    """The controls the model made ``chunk`` under, as the server journaled its tick."""
    line = next(c for c in read_journal(journal).chunks if c.chunk_index == chunk)
    return {c.track: dict(c.data) for c in line.controls}


def test_the_player_starts_from_an_image_shows_the_variants_keys_and_captures_the_mouse(
    page: Page, journals: Path
) -> None:
    recording = Recording(page)
    wait_for(page, "document.getElementById('start-image-label').textContent.includes('starts from one')")
    page.click("#start")  # no image yet: the page says so and starts nothing
    wait_for(page, "document.getElementById('notice').textContent.includes('starts a world from an image')")
    assert page.evaluate("window.worldserve.status") == "idle"
    page.set_input_files(
        "#start-image", files=[{"name": "world.png", "mimeType": "image/png", "buffer": png(160, 120)}]
    )
    wait_for(page, "window.worldserve.startImageReady")
    page.click("#start")
    wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 2")
    legend = page.eval_on_selector_all("#controls-legend kbd", "(keys) => keys.map((k) => k.dataset.key)")
    assert legend == ["W", "S", "A", "D"]  # the universal variant's keys
    assert page.evaluate("window.worldserve.allowedKeys") == ["W", "S", "A", "D"]
    assert page.is_hidden("#prompt")  # prompts are ignored: none is offered

    page.click("#screen")  # captures the mouse
    wait_for(page, "window.worldserve.pointerLocked")
    page.keyboard.down("KeyW")
    pressed = recording.sent_event("(e) => e.controls.some((c) => c.track === 'keys' && c.data.held.join() === 'W')")
    box = page.locator("#screen").bounding_box()
    assert box is not None
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    for step in range(1, 16):  # a steady turn to the right and a little up
        page.mouse.move(x + 12 * step, y - 3 * step)
        page.wait_for_timeout(20)
    turned = recording.sent_event("(e) => e.controls.some((c) => c.track === 'mouse' && c.data.yaw > 0)")
    page.wait_for_timeout(300)  # still: the page sends the stop
    stopped = recording.sent_event(
        "(e) => e.controls.some((c) => c.track === 'mouse' && c.data.yaw === 0 && c.data.pitch === 0)"
    )
    _, key_chunk = recording.applied_in(pressed["event_id"])
    _, stop_chunk = recording.applied_in(stopped["event_id"])
    turn = next(c["data"] for c in turned["controls"] if c["track"] == "mouse")
    assert turn["yaw"] > 0  # right, as the pointer moved
    assert turn["pitch"] > 0  # and up
    page.keyboard.up("KeyW")
    recording.wait_drawn(0, stop_chunk)
    page.evaluate("document.exitPointerLock()")  # what Esc does: the pointer is free again
    wait_for(page, "!window.worldserve.pointerLocked")
    page.click("#close")
    wait_for(page, "window.worldserve.status === 'idle'")

    journal = next(journals.glob("*.jsonl"))
    assert controls_of(journal, key_chunk)["keys"] == {"held": ("W",)}
    # Every mouse turn the page sent reached the model: each chunk's snapshot is the latest one applied.
    sent = page.evaluate("window.__worldserveTest.sent")
    chunks = page.evaluate("window.__worldserveTest.chunks")
    latest: dict[str, object] | None = None
    checked = 0
    for chunk in sorted(chunks, key=lambda c: c["chunk"]):
        for event in sent:
            if event["event_id"] in chunk["applied"]:
                for control in event["controls"]:
                    if control["track"] == "mouse":
                        latest = control["data"]
        if latest is not None:
            assert controls_of(journal, chunk["chunk"])["mouse"] == latest, chunk
            checked += 1
    assert checked >= 2
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-player-matrix-game.png"))


def test_before_start_the_page_shows_this_models_controls_and_no_prompt(page: Page) -> None:
    """Known from the server before any Start: no prompt field (no text encoder: the spec's
    ``takes_prompt`` is false), hints and help for a captured mouse (not tinyworld's drag), and a file
    that is not an image is named as such, not taken for a missing start image."""
    wait_for(page, "document.getElementById('start-image-label').textContent.includes('starts from one')")
    assert page.evaluate("fetch('/v1/models').then((r) => r.json()).then((m) => m.data[0].takes_prompt)") is False
    assert page.inner_text("#model-name").startswith("matrix-game-2")
    for selector in ("#prompt", "#apply-prompt", "#default-hint"):
        assert page.is_hidden(selector), selector
    legend = page.inner_text("#controls-legend")
    assert "the mouse turns the camera" in legend
    assert "Esc" in legend
    page.click("#toggle-help")
    help_text = page.inner_text("#help")
    assert "capture the mouse" in help_text
    assert "Esc" in help_text
    assert "drag" not in help_text  # tinyworld's pan
    assert page.eval_on_selector_all("#help-model kbd", "(keys) => keys.map((k) => k.textContent)")[:4] == [
        "W",
        "S",
        "A",
        "D",
    ]
    page.click("#toggle-help")

    page.set_input_files("#start-image", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hello"}])
    wait_for(page, "document.getElementById('notice').textContent.includes('not an image')")
    page.click("#start")
    notice = page.inner_text("#notice")
    assert "notes.txt is not an image this browser can read" in notice, notice
    assert "choose a start image first" not in notice
    assert page.evaluate("window.worldserve.status") == "idle"


@pytest.fixture(scope="module")
def temple_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    journals = tmp_path_factory.mktemp("temple")
    running = start_server(
        "--model",
        "matrix-game-2",
        "--model-option",
        "variant=templerun",
        "--threads-per-worker",
        "1",
        "--record-dir",
        str(journals),
        timeout=240.0,
    )
    yield running, journals
    running.stop()


def test_the_player_shows_temple_runs_keys_one_at_a_time_and_leaves_the_mouse_alone(
    temple_server: tuple[RunningServer, Path],
) -> None:
    server, journals = temple_server
    with open_page(server) as page:
        recording = Recording(page)
        wait_for(page, "document.getElementById('start-image-label').textContent.includes('starts from one')")
        page.set_input_files(
            "#start-image", files=[{"name": "run.png", "mimeType": "image/png", "buffer": png(80, 48)}]
        )
        wait_for(page, "window.worldserve.startImageReady")
        page.click("#start")
        wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 2")
        legend = page.eval_on_selector_all("#controls-legend kbd", "(keys) => keys.map((k) => k.dataset.key)")
        assert legend == ["W", "S", "Z", "C", "A", "D"]
        page.click("#screen")
        page.keyboard.down("KeyZ")  # turn left ...
        recording.sent_event("(e) => e.controls.some((c) => c.track === 'keys' && c.data.held.join() === 'Z')")
        page.keyboard.down("KeyC")  # ... and while it is held, turn right: one action at a time, the latest
        turned = recording.sent_event("(e) => e.controls.some((c) => c.track === 'keys' && c.data.held.join() === 'C')")
        _, chunk = recording.applied_in(turned["event_id"])
        assert not page.evaluate("window.worldserve.pointerLocked")  # no mouse to capture
        sent = page.evaluate("window.__worldserveTest.sent")
        assert all(c["track"] == "keys" and len(c["data"]["held"]) <= 1 for e in sent for c in e["controls"])
        recording.wait_drawn(0, chunk)
        page.click("#close")
        wait_for(page, "window.worldserve.status === 'idle'")
    journal = next(journals.glob("*.jsonl"))
    assert controls_of(journal, chunk) == {"keys": {"held": ("C",)}}
