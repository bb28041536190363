"""The browser player on ``abot-world`` (tiny, random weights) in a real headless Chromium.

The page shows the model's eight keys, and the arrow keys look (I J K L) for a model that takes the
look keys, as ABot-World's own page maps them. The server journals the session, so the keys each chunk
was made under (the tick's snapshot: what reached the model) are compared with what the page pressed:
the chunk that applied W with the up arrow held W and I. The world starts from reference images chosen
as files named after the model's views (all or none), which the journal's start holds.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.sync_api import Page

from server_harness import RunningServer, start_server
from test_browser import ARTIFACTS, Recording, wait_for
from test_browser_matrix import controls_of
from worldserve.runtime.journal import read_journal

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(journals: Path) -> Iterator[RunningServer]:
    running = start_server(
        "--model", "abot-world", "--threads-per-worker", "1", "--record-dir", str(journals), timeout=240.0
    )
    yield running
    running.stop()


def test_the_player_shows_its_eight_keys_and_the_arrows_look(page: Page, journals: Path) -> None:
    recording = Recording(page)
    wait_for(page, "!document.getElementById('references-row').hidden")
    assert "head, left" in page.inner_text("#references-label")
    views = {name: _picture(seed) for seed, name in enumerate(("head", "left"))}
    page.set_input_files("#references", [_file("head.png", views["head"])])  # one view of two: refused on Start
    page.click("#start")
    wait_for(page, "document.getElementById('notice').textContent.includes('missing left')")
    assert page.evaluate("window.worldserve.status") == "idle"
    page.set_input_files("#references", [_file(f"{name}.png", picture) for name, picture in views.items()])
    wait_for(page, "window.worldserve.referencesReady")
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
    references = read_journal(journal).start.options.references
    assert len(references) == 2
    for got, (name, sent) in zip(references, views.items(), strict=True):  # scaled to 64x64, sent as JPEG
        shown = np.frombuffer(got, dtype=np.uint8).reshape(64, 64, 3).astype(np.int16)
        wanted = np.asarray(_image(sent).resize((64, 64)), dtype=np.int16)
        assert np.abs(shown - wanted).mean() < 6, name
    assert controls_of(journal, pressed_chunk)["keys"] == {"held": ("W", "I")}
    assert controls_of(journal, turned_chunk)["keys"] == {"held": ("W", "J")}
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-player-abot-world.png"))


def _picture(seed: int) -> bytes:
    """A 96x96 PNG of smooth colour (JPEG keeps it close), different per seed."""
    from PIL import Image

    y, x = np.mgrid[0:96, 0:96].astype(np.float32) / 95.0
    phase = 1.0 + seed
    channels = [np.sin(phase * 3.0 * x + i) * 0.5 + 0.5 for i in range(2)] + [y]
    array = (np.stack(channels, axis=-1) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _image(png: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


def _file(name: str, data: bytes) -> Any:
    return {"name": name, "mimeType": "image/png", "buffer": data}
