"""The browser player on the default model, the trained tinyworld, in a real headless Chromium.

tinyworld's frames cannot be matched exactly against the world, so the page is checked
with the evaluation's own measures on the frames the player draws, one by one and in
order (recorded as in ``test_browser``): phase correlation between consecutive frames
(holding D moves the view right, by the key's 2 px a frame) and the style classifier (a
prompt switches the style from the second chunk after the one that applied it, the
evaluation's bar). Nothing is sampled on a clock, so the machine's speed does not matter.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page

from server_harness import RunningServer, start_server
from test_browser import ARTIFACTS, Recording, assert_in_chunk_order, keys_event, wait_for
from worldserve.models.tinyworld.eval import StyleClassifier, phase_shift

#: CPU-bound model work: generous, so that a slow or busy CPU (e.g. float32 without AVX-512) passes too.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(timeout=300.0)  # no --model: the default
    yield running
    running.stop()


def test_player_on_tinyworld_moves_and_switches_style(page: Page) -> None:
    recording = Recording(page)
    page.fill("#prompt", "desert dunes")
    page.fill("#seed", "1000321")
    page.click("#start")
    wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")

    page.click("#screen")
    page.keyboard.down("KeyD")
    _, pressed = recording.applied_in(recording.sent_event(keys_event("D"))["event_id"])
    recording.wait_drawn(0, pressed + 2)
    page.keyboard.up("KeyD")
    _, released = recording.applied_in(recording.sent_event(keys_event(""))["event_id"])
    recording.wait_drawn(0, released + 1)
    drawn = recording.drawn()
    assert_in_chunk_order(drawn)
    # Each step between consecutive frames drawn, by the chunk of the later frame: still before
    # D took effect and after its release; while it is held, right every frame (by the key's 2 px
    # nearly always: the evaluation's exact-step rate is 98%).
    steps = [(b.chunk, phase_shift(a.frame, b.frame)) for a, b in itertools.pairwise(drawn)]
    held = [shift for chunk, shift in steps if pressed <= chunk < released]
    assert len(held) >= 3 * 4, (pressed, released, steps)
    assert all(dx > 0 for dx, _ in held), (pressed, released, steps)  # D moves the view right
    assert held.count((2, 0)) >= 0.9 * len(held), (pressed, released, steps)
    assert all(shift == (0, 0) for chunk, shift in steps if not pressed <= chunk < released), steps

    classifier = StyleClassifier.fit(range(2000, 2006), views=6)
    page.fill("#prompt", "a snowy tundra")
    page.click("#apply-prompt")
    _, switched = recording.applied_in(recording.sent_event("(e) => e.prompt === 'a snowy tundra'")["event_id"])
    recording.wait_drawn(0, switched + 2)
    drawn = recording.drawn()
    assert_in_chunk_order(drawn)
    # The style before the chunk that applied the prompt, and the new one from the second chunk
    # after it on (where the evaluation sets its bar).
    named = [(d.chunk, classifier.predict(d.frame)) for d in drawn]
    assert all(name == "desert" for chunk, name in named if chunk < switched), (switched, named)
    after = [name for chunk, name in named if chunk > switched]
    assert len(after) >= 4, (switched, named)
    assert all(name == "snow" for name in after), (switched, named)

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-player-tinyworld.png"))
