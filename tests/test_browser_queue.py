"""The player on a full server, in a real headless Chromium: the newcomer waits in line, told its place.

One worker with one session slot: while a first page plays, a second page's Start waits in
line ("you are #1 in line, about N s", N from the length of a world that already ended),
the first keeps playing, and the second goes live when the first closes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from server_harness import RunningServer, start_server
from test_browser import open_page, wait_for

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--workers", "1", "--max-sessions-per-worker", "1")
    yield running
    running.stop()


def test_a_newcomer_waits_in_line_and_goes_live_when_the_player_leaves(server: RunningServer) -> None:
    with open_page(server) as first:
        first.click("#start")
        wait_for(first, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        first.click("#close")  # one world ended: the server has a session length to estimate with
        wait_for(first, "window.worldserve.status === 'idle'")
        first.click("#start")
        wait_for(first, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")

        assert first.context.browser is not None
        second = first.context.browser.new_page()
        second.goto(server.http + "/")
        second.click("#start")
        wait_for(second, "window.worldserve.status === 'queued'")
        badge = second.inner_text("#status")
        assert re.fullmatch(r"you are #1 in line, about \d+ s", badge), badge
        assert not second.is_disabled("#close")  # Close leaves the line
        shown = first.evaluate("() => window.worldserve.displayed")
        wait_for(first, f"window.worldserve.displayed > {shown + 8} && window.worldserve.status === 'live'")

        first.click("#close")
        wait_for(second, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        assert "in line" in second.inner_text("#log")
