"""The player's share link in a real headless Chromium: a second page opens the same world as a viewer."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from server_harness import RunningServer, start_server
from test_browser import CANVAS_DRAWN, canvas, open_page, wait_for


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

        # Joined by a link, the page plays the host's world: no Seed, Start image or Start (which left it
        # for a world of its own without a word), only a leave that says what it does.
        for selector in ("#start", "#seed", "#start-image"):
            assert viewer.is_hidden(selector), selector
        assert viewer.is_visible("#leave-shared")
        assert "goes on when you leave" in viewer.inner_text("#joined")

        controller = host.context.browser.new_page()
        controller.goto(links["controller"])
        wait_for(controller, "window.worldserve.status === 'live' && window.worldserve.role === 'controller'")
        assert controller.is_hidden("#start")
        assert controller.inner_text("#joined-role") == "controller"
        controller.click("#leave-shared")  # leaves its membership only; the world goes on
        wait_for(controller, "window.worldserve.status === 'idle' && window.worldserve.sessionId === null")
        assert controller.is_visible("#start")
        assert controller.inner_text("#start") == "Start"
        assert controller.is_visible("#seed")
        assert "left the shared world" in controller.inner_text("#notice")
        shown = host.evaluate("() => window.worldserve.displayed")
        wait_for(host, f"window.worldserve.status === 'live' && window.worldserve.displayed > {shown + 4}")

        host.click("#close")
        wait_for(viewer, "window.worldserve.status === 'idle'")
        assert viewer.is_visible("#start")  # the world is gone: Start is offered again


def test_the_page_names_the_model_on_load_and_has_an_icon(server: RunningServer) -> None:
    with open_page(server) as page:
        responses: list[tuple[str, int]] = []
        page.on("response", lambda response: responses.append((response.url, response.status)))
        page.reload()
        # Before any Start: the served model's name and frame, from the server.
        wait_for(page, "document.getElementById('model-name').textContent.startsWith('procedural · 48\u00d748')")
        icon = page.get_attribute("link[rel=icon]", "href")
        assert icon is not None
        assert page.evaluate(f"fetch({icon!r}).then((r) => [r.status, r.headers.get('content-type')])") == [
            200,
            "image/svg+xml",
        ]
        with urllib.request.urlopen(server.http + "/favicon.ico", timeout=10) as reply:  # asked for by others
            assert reply.status == 200
            assert reply.headers["content-type"] == "image/svg+xml"
        assert [r for r in responses if r[1] >= 400] == []


def test_a_viewer_link_with_transport_webrtc_watches_over_webrtc(server: RunningServer) -> None:
    """The page as a WHEP viewer (?transport=webrtc): the world's frames in a video, the overlay's transport
    with its round trip and loss from getStats(); leaving deletes its WHEP resource, the world goes on."""
    with open_page(server) as host:
        host.fill("#seed", "12")
        host.click("#start")
        wait_for(host, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        link = host.evaluate("() => window.worldserve.shareLinks")["viewer"]
        assert host.context.browser is not None
        viewer = host.context.browser.new_page()
        viewer.goto(link + "&transport=webrtc")
        wait_for(viewer, "window.worldserve.status === 'live' && window.worldserve.transport === 'webrtc'")
        wait_for(viewer, "window.worldserve.webrtc && window.worldserve.webrtc.framesDecoded > 16")
        stats = viewer.evaluate("() => window.worldserve.webrtc")
        assert stats["lossPercent"] == 0
        assert stats["rttMs"] is not None
        assert viewer.inner_text("#stat-transport").startswith("webrtc · rtt")
        assert viewer.evaluate("() => document.querySelector('video.rtc').videoWidth") == 48
        assert viewer.evaluate("() => window.worldserve.role") == "viewer"
        # Chromium's receiver's figures in the overlay; the view drawn to the canvas and recorded for the download.
        wait_for(viewer, "window.worldserve.webrtc.jitterBufferMs !== null")
        assert viewer.inner_text("#stat-jitter").endswith(" ms")
        wait_for(viewer, "window.worldserve.recordedBytes > 0")
        assert viewer.evaluate(CANVAS_DRAWN), "the track's frames were not drawn for the recording"
        viewer.click("#leave-shared")
        wait_for(viewer, "window.worldserve.status === 'idle' && window.worldserve.transport === 'websocket'")
        shown = host.evaluate("() => window.worldserve.displayed")
        wait_for(host, f"window.worldserve.status === 'live' && window.worldserve.displayed > {shown + 4}")
