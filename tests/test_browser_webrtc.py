"""The page's own session over WebRTC in a real headless Chromium (``?transport=webrtc``): the protocol on a data
channel, the frames on a video track told their chunks by ``chunk.track``. It starts a world, plays it, steers it
(the key->screen figure taken from the track's frames, its parts summing to it), takes its world back when the
peer connection is lost, and closes it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from server_harness import RunningServer, start_server
from test_browser import open_page, wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--resume-grace-s", "30")
    yield running
    running.stop()


def _sessions(server: RunningServer) -> int:
    with urllib.request.urlopen(server.http + "/healthz", timeout=10) as reply:
        return int(json.loads(reply.read())["sessions"])


def test_the_page_plays_steers_resumes_and_closes_a_world_over_webrtc(server: RunningServer) -> None:
    with open_page(server, query="?transport=webrtc") as page:
        page.fill("#seed", "7")
        page.click("#start")
        wait_for(page, "window.worldserve.status === 'live' && window.worldserve.transport === 'webrtc'")
        assert page.evaluate("() => window.worldserve.media") == "webrtc"
        assert page.inner_text("#status") == "live (WebRTC)"
        wait_for(page, "window.worldserve.displayed > 16 && window.worldserve.seq >= 3")
        assert page.evaluate("() => document.querySelector('video.rtc').videoWidth") == 48

        # Steering: the chunk that applied the key is told on the track, its first frame shown gives the figure.
        page.click("#screen")
        page.keyboard.down("KeyW")
        wait_for(page, "window.worldserve.keyToPhotonMs !== null")
        page.keyboard.up("KeyW")
        parts = page.evaluate("() => window.worldserve.keyToPhotonParts")
        assert parts is not None
        total = parts.pop("total")
        assert total > 0
        assert sum(parts.values()) == pytest.approx(total, abs=1.0)
        assert parts["wait_tick"] >= 0
        assert parts["transfer"] > 0
        wait_for(page, "window.worldserve.webrtc && window.worldserve.webrtc.framesDecoded > 16")
        assert page.inner_text("#stat-transport").startswith("webrtc · rtt")

        # The peer connection is lost (no DELETE): the world is parked, and the page takes it back on a new one.
        session = page.evaluate("() => window.worldserve.sessionId")
        seq = page.evaluate("() => window.worldserve.seq")
        page.evaluate("() => window.worldserve.loseWebRTC()")
        wait_for(page, "window.worldserve.resumes === 1 && window.worldserve.status === 'live'")
        assert page.evaluate("() => window.worldserve.sessionId") == session
        wait_for(page, f"window.worldserve.seq > {seq + 3} && window.worldserve.transport === 'webrtc'")
        assert _sessions(server) == 1

        page.click("#close")
        wait_for(page, "window.worldserve.status === 'idle'")
    assert _sessions(server) == 0
