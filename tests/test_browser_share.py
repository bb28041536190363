"""The player's share link in a real headless Chromium: a second page opens the same world as a viewer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from server_harness import RunningServer, start_server
from test_browser import canvas, open_page, wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


def test_a_share_link_opens_the_same_world_as_a_viewer(server: RunningServer) -> None:
    with open_page(server) as host:
        host.fill("#seed", "11")
        host.click("#start")
        wait_for(host, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        links = host.evaluate("() => window.worldserve.shareLinks")
        assert "role=viewer" in links["viewer"]
        assert "role=controller" in links["controller"]
        session_id = host.evaluate("() => window.worldserve.sessionId")
        assert f"join={session_id}" in links["viewer"]

        assert host.context.browser is not None
        viewer = host.context.browser.new_page()
        viewer.goto(links["viewer"])
        wait_for(viewer, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        assert viewer.evaluate("() => [window.worldserve.role, window.worldserve.sessionId]") == ["viewer", session_id]
        assert viewer.is_hidden("#apply-prompt")  # a viewer is not shown controls that would do nothing
        assert viewer.is_hidden("#reset")
        # Nothing is held: both pages show the same still view of the one world.
        assert np.array_equal(canvas(viewer), canvas(host))

        host.click("#close")
        wait_for(viewer, "window.worldserve.status === 'idle'")
