"""The page's own session over WebRTC in a real headless Chromium (``?transport=webrtc``): the protocol on a data
channel, the frames on a video track told their chunks by ``chunk.track``. It starts a world, plays it, steers it
(the key->screen figure taken from the track's frames, its parts summing to it), takes its world back when the
peer connection is lost, and closes it."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from server_harness import RunningServer, start_server
from test_browser import CANVAS_DRAWN, open_page, wait_for
from worldserve.tools.replay import replay


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--resume-grace-s", "30")
    yield running
    running.stop()


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
        # The overlay's jitter figures are Chromium's own receiver's; the view is recorded for the download.
        wait_for(page, "window.worldserve.webrtc.jitterBufferMs !== null")
        assert page.inner_text("#stat-jitter").endswith(" ms")
        assert page.inner_text("#stat-underruns") == str(page.evaluate("() => window.worldserve.webrtc.freezes"))
        wait_for(page, "window.worldserve.recordedBytes > 0")
        assert page.evaluate(CANVAS_DRAWN), "the track's frames were not drawn for the recording"

        # The peer connection is lost (no DELETE): the world is parked, and the page takes it back on a new one.
        session = page.evaluate("() => window.worldserve.sessionId")
        seq = page.evaluate("() => window.worldserve.seq")
        page.evaluate("() => window.worldserve.loseWebRTC()")
        wait_for(page, "window.worldserve.resumes === 1 && window.worldserve.status === 'live'")
        assert page.evaluate("() => window.worldserve.sessionId") == session
        wait_for(page, f"window.worldserve.seq > {seq + 3} && window.worldserve.transport === 'webrtc'")
        assert server.health()["sessions"] == 1
        # The server's chunk headers and chunk.track went first as copies too; the page read them from there.
        assert page.evaluate("() => window.worldserve.webrtcCopiesTaken") > 0

        page.click("#close")
        wait_for(page, "window.worldserve.status === 'idle'")
    assert server.health()["sessions"] == 0
    # Its acks and its key went first as copies on the package's fast channel, and the server read them from there.
    with urllib.request.urlopen(f"{server.http}/metrics", timeout=10) as response:
        taken = re.search(r'^worldserve_webrtc_copies_total\{used="taken"\} (\S+)$', response.read().decode(), re.M)
    assert taken is not None
    assert float(taken.group(1)) > 0


#: Installed on the page's <video>: every frame it shows, drawn to a canvas as it is shown, with its RTP timestamp.
_CAPTURE = """() => {
  const video = document.querySelector('video.rtc');
  const canvas = document.createElement('canvas');
  canvas.width = video.videoWidth;
  canvas.height = video.videoHeight;
  const context = canvas.getContext('2d', { willReadFrequently: true });
  window.captured = [];
  const grab = (now, meta) => {
    context.drawImage(video, 0, 0);
    const rgba = context.getImageData(0, 0, canvas.width, canvas.height).data;
    const rgb = [];
    for (let i = 0; i < rgba.length; i += 4) rgb.push(rgba[i], rgba[i + 1], rgba[i + 2]);
    window.captured.push({ rtp: meta.rtpTimestamp >>> 0, rgb });
    video.requestVideoFrameCallback(grab);
  };
  video.requestVideoFrameCallback(grab);
}"""


def test_the_frames_the_page_shows_over_webrtc_are_the_journals(tmp_path: Path) -> None:
    """Replay equals what was shown: each frame the page showed over WebRTC, told its chunk by its RTP timestamp,
    is (up to VP8's loss) that chunk's frame as the journal replays it, and no other chunk's."""
    journals = tmp_path / "journals"
    running = start_server("--model", "procedural", "--record-dir", str(journals))
    try:
        with open_page(running, query="?transport=webrtc") as page:
            page.fill("#seed", "9")
            page.click("#start")
            wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 8")
            page.evaluate(_CAPTURE)
            page.click("#screen")
            page.keyboard.down("KeyD")  # the view moves 2 px a frame: every frame differs from the last
            wait_for(page, "window.captured.length > 40")
            page.keyboard.up("KeyD")
            wait_for(page, "window.captured.length > 56")
            captured = page.evaluate("() => window.captured")
            # A frame is told its chunk once that is sure (a mark at or after it came): the last ones a moment later.
            rtps = json.dumps([frame["rtp"] for frame in captured])
            wait_for(page, f"{rtps}.every((rtp) => window.worldserve.webrtcShown.some((frame) => frame.rtp === rtp))")
            guessed = page.evaluate("() => window.worldserve.webrtcLabelsGuessed")
            told = {frame["rtp"]: frame for frame in page.evaluate("() => window.worldserve.webrtcShown")}
            page.click("#close")
            wait_for(page, "window.worldserve.status === 'idle'")
    finally:
        running.stop()
    (journal,) = journals.glob("*.jsonl")
    replayed = asyncio.run(replay(journal)).frames.astype(np.int16)
    per_chunk = 4
    moving = 0
    for shown in captured:
        frame = told.get(shown["rtp"])
        assert frame is not None, "a frame shown was told no chunk"
        image = np.asarray(shown["rgb"], np.int16).reshape(replayed.shape[1:])
        distance = np.abs(replayed - image).reshape(len(replayed), -1).mean(axis=1)
        own = distance[frame["chunk"] * per_chunk : (frame["chunk"] + 1) * per_chunk]
        assert own.min() < 12.0, (frame, own, guessed)  # its own chunk's frame, up to the encoder's loss
        assert own.min() <= distance.min() + 0.5, (frame, own, int(distance.argmin()))  # and no other's
        gaps = np.abs(np.diff(replayed[frame["chunk"] * per_chunk : (frame["chunk"] + 1) * per_chunk], axis=0))
        moving += bool(gaps.reshape(per_chunk - 1, -1).mean(axis=1).min() > 6.0)
    assert moving >= 16, moving  # enough frames of moving chunks (adjacent frames ~9 apart, VP8 ~4 off its own)


#: The page's canvas (each frame of the track is drawn there): the mean of its top and its bottom 64 rows.
_TOP_AND_BOTTOM = """() => {
  const canvas = document.getElementById('screen');
  const g = canvas.getContext('2d');
  const mean = (y) => {
    const rgba = g.getImageData(0, y, canvas.width, 64).data;
    let sum = 0;
    for (let i = 0; i < rgba.length; i += 4) sum += rgba[i];
    return sum / (rgba.length / 4);
  };
  return [mean(0), mean(canvas.height - 64)];
}"""


def test_a_start_image_larger_than_a_data_channel_message_starts_the_world_over_webrtc(tmp_path: Path) -> None:
    """Chromium sends at most 256 KiB a data channel message; a 512x512 start image's PNG is more. The page sends
    the start in pieces, the server joins them, and the world shown is the image (dark at the top, light below)."""
    from PIL import Image

    rows = np.linspace(0, 255, 512)[:, None, None]
    grain = np.random.default_rng(5).integers(0, 24, (512, 512, 3))  # fine grain: a PNG too big to shrink
    picture = tmp_path / "start.png"
    Image.fromarray(np.clip(rows + grain, 0, 255).astype(np.uint8)).save(picture)
    running = start_server("--model", "procedural", "--model-option", "height=512", "--model-option", "width=512")
    try:
        with open_page(running, query="?transport=webrtc") as page:
            page.set_input_files("#start-image", str(picture))
            wait_for(page, "document.getElementById('log').textContent.includes('fitted to 512')")
            page.click("#start")
            wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
            top, bottom = page.evaluate(_TOP_AND_BOTTOM)
            assert top < 60 < 200 < bottom, (top, bottom)
            page.click("#close")
            wait_for(page, "window.worldserve.status === 'idle'")
    finally:
        running.stop()
