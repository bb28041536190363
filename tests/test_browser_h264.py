"""The player's H.264 playback (Media Source Extensions) in a real headless Chromium (Debian's).

The server runs the procedural model; the player asks for H.264 (its default where MSE plays
it), appends each chunk's fMP4 fragment to a ``<video>`` and draws every frame the video
presents onto its canvas. A script added before the player loads records each such draw (the
canvas's pixels, read back) with the player's epoch, chunk and frame within the chunk, so every
frame drawn is compared with the world's frame at the position the applied events put it (the
same replay as ``test_browser``), within :data:`~test_h264.H264_PSNR_DB`. A late viewer (a
share link) plays the same world; a browser without MSE falls back to JPEG.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from playwright.sync_api import Page

from runtime_models import carried_by, chunk_controls
from server_harness import RunningServer, start_server
from test_browser import SEED, SIZE, TIMEOUT_MS, open_page, page_controls, wait_for
from test_h264 import H264_PSNR_DB, UNRELATED_PSNR_DB, psnr
from worldserve.models.world import Motion, World, style_for_prompt, velocity
from worldserve.protocol import ControlInput

pytestmark = pytest.mark.timeout(600)

#: Records each frame the player draws on ``#screen`` (read back from the canvas) with the
#: player's epoch, chunk and frame of that chunk, and each chunk header and input event.
RECORDER = """
(() => {
  const log = { drawn: [], chunks: [], sent: [], dropped: [] };
  window.__h264Test = log;
  const original = CanvasRenderingContext2D.prototype.drawImage;
  CanvasRenderingContext2D.prototype.drawImage = function (...args) {
    const result = original.apply(this, args);
    if (this.canvas && this.canvas.id === "screen") {
      const { width, height } = this.canvas;
      const rgba = this.getImageData(0, 0, width, height).data;
      let binary = "";
      for (let i = 0; i < rgba.length; i += 4) binary += String.fromCharCode(rgba[i], rgba[i + 1], rgba[i + 2]);
      const entry = { pixels: btoa(binary), width, height };
      log.drawn.push(entry);
      queueMicrotask(() => {
        const p = window.worldserve;
        Object.assign(entry, { displayed: p.displayed, epoch: p.epoch, chunk: p.chunkIndex, frame: p.frameInChunk });
      });
    }
    return result;
  };
  const NativeWebSocket = window.WebSocket;
  window.WebSocket = class extends NativeWebSocket {
    constructor(...args) {
      super(...args);
      this.addEventListener("message", (event) => {
        if (typeof event.data !== "string") return;
        const message = JSON.parse(event.data);
        if (message.type === "chunk") log.chunks.push({ epoch: message.epoch, chunk: message.chunk_index,
                                                        applied: message.applied_event_ids, frames: message.frames });
        if (message.type === "input.dropped") log.dropped.push([message.event_ids, message.detail || ""]);
      });
    }
    send(data) {
      if (typeof data === "string") {
        const message = JSON.parse(data);
        if (message.type === "input.event") log.sent.push(message);
      }
      return super.send(data);
    }
  };
})();
"""


@dataclass(frozen=True, slots=True)
class Frame:
    displayed: int
    epoch: int
    chunk: int
    index: int  # the frame of its chunk
    pixels: npt.NDArray[np.uint8]


def drawn(page: Page) -> list[Frame]:
    out = []
    for entry in page.evaluate("() => window.__h264Test.drawn"):
        pixels = np.frombuffer(base64.b64decode(entry["pixels"]), np.uint8).reshape(entry["height"], entry["width"], 3)
        out.append(Frame(entry["displayed"], entry["epoch"], entry["chunk"], entry["frame"], pixels))
    return out


def expected_views(page: Page, start_prompt: str) -> dict[tuple[int, int], list[tuple[int, int, str]]]:
    """(epoch 0) chunk -> where each of its frames shows the world, by the events the chunks applied."""
    log = page.evaluate("() => window.__h264Test.sent")
    sent = {event["event_id"]: event for event in log}
    controls_of = page_controls(log)
    carried = carried_by(page.evaluate("() => window.__h264Test.dropped"))
    chunks = [c for c in page.evaluate("() => window.__h264Test.chunks") if c["epoch"] == 0]
    # A chunk made again (a preemption: the same chunk index, sent later) replaces the one before it.
    latest = {c["chunk"]: c for c in chunks}
    motion, prompt, controls = Motion(), start_prompt, dict[str, ControlInput]()
    views = {}
    for c in (latest[index] for index in sorted(latest)):
        for event_id in c["applied"]:
            prompt = sent[event_id].get("prompt", prompt)
        held = chunk_controls(controls, c["applied"], controls_of, carried)  # a key tapped: held in it
        positions = motion.advance(*velocity(held), c["frames"]["count"])
        views[(0, c["chunk"])] = [(x, y, style_for_prompt(prompt)) for x, y in positions]
    return views


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


def test_the_player_plays_h264_through_mse_at_the_models_frames(server: RunningServer) -> None:
    with open_page(server, query="", recorder=RECORDER) as page:
        page.fill("#prompt", "islands")
        page.fill("#seed", str(SEED))
        page.click("#start")
        wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 8")
        assert page.evaluate("() => window.worldserve.media") == "h264"
        assert page.evaluate("() => document.querySelector('video.mse') !== null")
        page.click("#screen")
        page.keyboard.down("KeyD")
        page.wait_for_function(
            "() => { const log = window.__h264Test; const d = log.sent.filter((e) => e.controls);"
            " return d.length && log.chunks.some((c) => c.applied.includes(d[0].event_id)); }",
            timeout=TIMEOUT_MS,
        )
        applied = page.evaluate(
            "() => { const log = window.__h264Test; const d = log.sent.filter((e) => e.controls)[0];"
            " return log.chunks.find((c) => c.applied.includes(d.event_id)).chunk; }"
        )
        wait_for(page, f"window.worldserve.chunkIndex > {applied + 2}")
        page.keyboard.up("KeyD")
        wait_for(page, "window.worldserve.displayed > 120")  # several seconds of video
        frames = [f for f in drawn(page) if f.epoch == 0]
        # Frames advance, in order, each drawn once.
        assert [f.displayed for f in frames] == list(range(frames[0].displayed, frames[0].displayed + len(frames)))
        order = [(f.chunk, f.index) for f in frames]
        assert order == sorted(order)
        assert len(set(order)) == len(order)
        assert frames[-1].chunk - frames[0].chunk >= 20
        # Every frame drawn is the world where the applied events put it, within the H.264 bound.
        views = expected_views(page, "islands")
        world, other = World(SEED), World(SEED + 1)
        moved = set()
        for f in frames:
            x, y, style = views[(0, f.chunk)][f.index]
            moved.add((x, y))
            truth = world.render(x, y, SIZE, SIZE, style)
            assert psnr(f.pixels, truth) >= H264_PSNR_DB, (f, (x, y))
            assert psnr(f.pixels, other.render(x, y, SIZE, SIZE, style)) <= UNRELATED_PSNR_DB
        assert len(moved) > 10  # holding D moved the view
        # The overlay names the media and a measured bitrate.
        assert page.text_content("#stat-media") == "h264"
        assert float(page.evaluate("() => window.worldserve.kbps")) > 0

        # A late viewer (the share link) enters the stream at a keyframe and plays the same world.
        links = page.evaluate("() => window.worldserve.shareLinks")
        assert page.context.browser is not None
        joined = page.evaluate("() => document.querySelector('video.mse').currentTime")
        viewer = page.context.browser.new_page()
        viewer.add_init_script(RECORDER)
        viewer.goto(links["viewer"])
        wait_for(viewer, "window.worldserve.status === 'live' && window.worldserve.displayed > 8")
        assert viewer.evaluate("() => window.worldserve.media") == "h264"
        stopped = views[max(views)][-1]
        still = world.render(stopped[0], stopped[1], SIZE, SIZE, stopped[2])
        for f in drawn(viewer)[-8:]:
            assert psnr(f.pixels, still) >= H264_PSNR_DB
        viewer.close()
        # The viewer's IDR frame reached the host's stream too: the host's buffer is cut there once
        # it has played a second past it, so what it holds stays short (played and unplayed). An earlier
        # cut (an IDR frame before the viewer came: a periodic one on a slow box) does not count.
        buffered = "(() => { const b = document.querySelector('video.mse').buffered; return b; })()"
        wait_for(page, f"{buffered}.length && {buffered}.start(0) >= {joined}")
        wait_for(page, f"(() => {{ const b = {buffered}; return b.end(b.length - 1) - b.start(0) < 4.0; }})()")


def test_without_media_source_extensions_the_player_falls_back_to_jpeg(server: RunningServer) -> None:
    with open_page(server, query="", recorder="window.MediaSource = undefined;" + RECORDER) as page:
        page.fill("#seed", str(SEED))
        page.click("#start")
        wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 8")
        assert page.evaluate("() => window.worldserve.media") == "jpeg"
        assert page.text_content("#stat-media") == "jpeg"
        still = World(SEED).render(0, 0, SIZE, SIZE, "islands")
        for f in drawn(page)[-4:]:
            assert psnr(f.pixels, still) >= H264_PSNR_DB


def test_a_viewer_without_media_source_extensions_watches_an_h264_world_in_jpeg(server: RunningServer) -> None:
    """The host plays H.264; a share link opened where MSE is missing joins with ``media: "jpeg"``
    and draws the same world's frames (JPEG), while the host's page goes on playing H.264."""
    with open_page(server, query="", recorder=RECORDER) as host:
        host.fill("#seed", str(SEED))
        host.click("#start")
        wait_for(host, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        assert host.evaluate("() => window.worldserve.media") == "h264"
        link = host.evaluate("() => window.worldserve.shareLinks")["viewer"]
        assert host.context.browser is not None
        viewer = host.context.browser.new_page()
        viewer.add_init_script("window.MediaSource = undefined;" + RECORDER)
        viewer.goto(link)
        wait_for(viewer, "window.worldserve.status === 'live' && window.worldserve.displayed > 8")
        assert viewer.evaluate("() => [window.worldserve.role, window.worldserve.media]") == ["viewer", "jpeg"]
        headers = viewer.evaluate("() => window.__h264Test.chunks")
        assert headers
        assert {header["frames"]["media"] for header in headers} == {"jpeg"}
        still = World(SEED).render(0, 0, SIZE, SIZE, "islands")
        for f in drawn(viewer)[-4:]:
            assert psnr(f.pixels, still) >= H264_PSNR_DB
        wait_for(host, "window.worldserve.displayed > 16")
        assert host.evaluate("() => window.worldserve.media") == "h264"
        assert {header["frames"]["media"] for header in host.evaluate("() => window.__h264Test.chunks")} == {"h264"}
