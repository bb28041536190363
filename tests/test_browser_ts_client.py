"""``@worldserve/client``'s browser parts in a real headless Chromium against a real server, the built package
imported as ES modules by a page (``make ts`` builds it; ``make test`` runs it first):

- ``WebRTCWorldClient`` (clients/ts/src/webrtc.ts) starts a world over ``/v1/webrtc``, shows its track in a
  <video> (acking each chunk as its first frame shows), steers it until the chunk that applied the key is
  shown, loses its peer connection and resumes, and closes;
- ``H264Player`` (clients/ts/src/h264.ts) plays an h264 session's chunks through Media Source Extensions,
  acking each as its first frame shows;
- ``WorldClient`` runs the protocol doc's example exchange over the browser's own WebSocket, as the Node tests do
  over ``ws``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_harness import RunningServer, start_server
from test_browser import open_page

DIST = Path(__file__).resolve().parent.parent / "clients" / "ts" / "dist" / "src"
PACKAGE = "http://package.test/"

#: The page's part: the package's own verbs, as a web developer would call them.
_SCRIPT = """async (url) => {
  const { WebRTCWorldClient, keys } = await import("http://package.test/webrtc.js").then(async (webrtc) => ({
    ...webrtc, ...(await import("http://package.test/client.js")),
  }));
  const client = new WebRTCWorldClient(url);
  await client.connect();
  const info = await client.start({ seed: 4 });
  const video = document.createElement("video");
  document.body.append(video);
  const shown = [];
  const firsts = []; // per chunk, whether its first frame shown is the one the server told (chunk.track)
  const onFrame = (seq, rtp) => {
    const mark = seq === null ? undefined : client.marks.get(seq);
    if (seq !== null && !shown.includes(seq)) firsts.push(mark !== undefined && Math.abs((rtp - mark) | 0) <= 90);
    shown.push(seq);
  };
  client.show(video, onFrame);
  const until = async (done) => {
    for (const deadline = performance.now() + 20000; !done() && performance.now() < deadline;) {
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    return done();
  };
  const first = [];
  for (let i = 0; i < 4; i++) first.push((await client.nextChunk(20000)).seq);
  const accepted = await client.sendEvent({ controls: [keys("W")] });
  let applied = null;
  for (let i = 0; i < 30 && applied === null; i++) {
    const chunk = await client.nextChunk(20000);
    if (chunk.appliedEventIds.includes(accepted.event_id)) applied = chunk.seq;
  }
  const appliedShown = await until(() => shown.includes(applied));
  const before = client.lastSeq;
  client.drop();
  const resumed = await client.resume();
  client.show(video, onFrame);
  const after = await client.nextChunk(20000);
  const afterShown = await until(() => shown.some((seq) => seq !== null && seq >= after.seq));
  await client.close();
  return {
    media: info.media, first, accepted: accepted.status, applied, appliedShown, before,
    resumed: resumed.type, after: after.seq, afterShown, payloads: after.payloads.length,
    width: video.videoWidth, firsts,
  };
}"""


def _serve(route: Any) -> None:
    """The package's built modules, served from another origin (CORS), as a CDN would."""
    route.fulfill(
        path=str(DIST / route.request.url.removeprefix(PACKAGE)),
        headers={"Access-Control-Allow-Origin": "*", "Content-Type": "text/javascript"},
    )


def _run(server: RunningServer, script: str) -> Any:
    """``script`` run by a page of ``server``, importing the package's built modules; its result."""
    if not (DIST / "index.js").exists():
        pytest.fail(f"{DIST / 'index.js'} is missing: `make ts` builds the package.")
    with open_page(server, query="") as page:
        page.route(PACKAGE + "**", _serve)
        return page.evaluate(script, server.ws)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--resume-grace-s", "30")
    yield running
    running.stop()


def test_the_packages_webrtc_client_plays_steers_resumes_and_closes_in_chromium(server: RunningServer) -> None:
    result = _run(server, _SCRIPT)
    assert result["media"] == "raw"  # frames on the track
    assert result["first"] == list(range(result["first"][0], result["first"][0] + 4))
    assert result["accepted"] == "accepted"
    assert result["applied"] is not None
    assert result["appliedShown"] is True  # the chunk that applied the key was shown, told by its RTP timestamp
    assert result["resumed"] == "session.resumed"
    assert result["after"] > result["before"]
    assert result["afterShown"] is True
    assert result["payloads"] == 0  # its frames are the track's
    assert result["width"] == 48
    # Each chunk's first frame shown is the one told as its first, unless the compositor or the jitter buffer
    # skipped that frame (on a loaded box that is 2 chunks in 6, and more: no share of them can be asserted). A
    # wrong mark (a wrong RTP origin, a chunk told another's timestamp) matches no frame at all, so one exact
    # match among the chunks is what tells the marks are the frames' own.
    firsts = result["firsts"]
    assert len(firsts) >= 5
    assert any(firsts), firsts
    assert server.health()["sessions"] == 0


_H264 = """async (url) => {
  const { WorldClient, H264Player } = await import("http://package.test/index.js");
  const client = new WorldClient(url, { autoAck: false });
  await client.connect();
  const info = await client.start({ seed: 6, media: "h264" });
  const video = document.createElement("video");
  document.body.append(video);
  const begun = [];
  const frames = []; // [seq, index] of each frame presented
  const player = new H264Player(video, info.model.fps, client, {
    onChunkShown: (seq) => begun.push(seq), onFrame: (seq, index) => frames.push([seq, index]),
  });
  const seqs = [];
  for (let i = 0; i < 16; i++) {
    const chunk = await client.nextChunk(20000);
    seqs.push(chunk.seq);
    player.push(chunk);
  }
  for (const deadline = performance.now() + 20000; player.shown.length < 12 && performance.now() < deadline;) {
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  const result = {
    media: info.media, seqs, shown: player.shown.slice(), failure: player.failure,
    width: video.videoWidth, time: video.currentTime, begun: begun.slice(), frames: frames.slice(),
    bufferedMs: player.bufferedMs(),
  };  // all read at one moment: the video goes on showing frames while the client closes
  await client.close();
  return result;
}"""


def test_the_packages_h264_player_plays_a_session_through_media_source_extensions(server: RunningServer) -> None:
    result = _run(server, _H264)
    assert result["media"] == "h264"
    assert result["failure"] is None
    assert result["width"] == 48
    shown = result["shown"]
    assert len(shown) >= 12  # chunks acked as their first frames showed, so the world went on (it is paced to acks)
    assert shown == sorted(shown)
    assert set(shown) <= set(result["seqs"])
    assert result["time"] > 0
    assert result["begun"] == shown  # the page's hook hears each chunk begun, as the client's ack
    frames = [tuple(f) for f in result["frames"]]
    assert len(frames) >= 12
    assert frames == sorted(frames)  # each frame heard once, in the stream's order, with its chunk and index
    assert len(set(frames)) == len(frames)
    assert {seq for seq, _ in frames} <= set(result["seqs"])
    assert all(0 <= index < 4 for _, index in frames)
    assert result["bufferedMs"] >= 0


_ICE = """async (url) => {
  const { WebRTCWorldClient } = await import("http://package.test/webrtc.js");
  const client = new WebRTCWorldClient(url);
  await client.connect();
  await client.start({ seed: 2 });
  const chunk = await client.nextChunk(20000);
  const servers = client["pc"].getConfiguration().iceServers;
  await client.close();
  return { servers, seq: chunk.seq };
}"""


def test_the_packages_webrtc_client_gathers_with_the_ice_servers_its_server_tells() -> None:
    """A server with STUN and TURN servers (--ice-server) tells them (OPTIONS, Link headers): the package's peer
    connection is made with them, as the page's are (both signal through the package). None answers here, so
    the world comes over the host candidates, as on a LAN."""
    server = start_server(
        "--model", "procedural", "--ice-server", "stun:127.0.0.1:3478",
        "--ice-server", "turn:ana:s3cret@127.0.0.1:3478?transport=tcp",
    )  # fmt: skip
    try:
        result = _run(server, _ICE)
    finally:
        server.stop()
    told = [(s["urls"], s.get("username") or None, s.get("credential") or None) for s in result["servers"]]
    assert told == [
        (["stun:127.0.0.1:3478"], None, None),  # Chromium gives an unset username and credential as ""
        (["turn:127.0.0.1:3478?transport=tcp"], "ana", "s3cret"),
    ]
    assert result["seq"] >= 0


#: The protocol doc's example exchange, as client.test.ts runs it in Node, here in the browser with its own
#: WebSocket: start, an event accepted then applied at a chunk boundary (its JPEG frames decoded), reset, close.
_EXCHANGE = """async (url) => {
  const { WorldClient, keys, decodeFrame } = await import("http://package.test/index.js");
  const world = new WorldClient(url);
  await world.connect();
  const info = await world.start({ prompt: "islands", seed: 3, media: "jpeg" });
  const accepted = await world.sendEvent({ controls: [keys("W", "D")] });
  const indices = [];
  let applied = null;
  for (let i = 0; i < 8 && applied === null; i++) {
    const chunk = await world.nextChunk(30000);
    indices.push(chunk.chunkIndex);
    if (chunk.appliedEventIds.includes(accepted.event_id)) applied = chunk;
  }
  const frame = await decodeFrame(applied.payloads[0], "jpeg", 48, 48);
  const raw = await decodeFrame(new Uint8Array([9, 8, 7, 1, 2, 3]), "raw", 2, 1);
  let refused = null;
  try { await decodeFrame(new Uint8Array(5), "raw", 2, 1); } catch (error) { refused = error.message; }
  const epoch = await world.reset();
  const fresh = await world.nextChunk(30000);
  await world.close();
  return {
    role: info.role, media: info.media, model: info.model.name, accepted: accepted.status, indices,
    frames: applied.payloads.length, count: applied.header.frames.count, size: [frame.width, frame.height],
    epoch, fresh: [fresh.epoch, fresh.chunkIndex],
    raw: [raw.constructor.name, raw.width, raw.height, [...raw.data]], refused,
  };
}"""


def test_the_packages_client_runs_the_protocol_docs_exchange_in_chromium(server: RunningServer) -> None:
    result = _run(server, _EXCHANGE)
    assert (result["role"], result["media"], result["model"], result["accepted"]) == (
        "host",
        "jpeg",
        "procedural",
        "accepted",
    )
    assert result["indices"] == list(range(len(result["indices"])))  # chunks in order, the event's among them
    assert result["frames"] == result["count"] == 4
    assert result["size"] == [48, 48]  # a JPEG frame, decoded by the browser
    assert result["raw"] == ["ImageData", 2, 1, [9, 8, 7, 255, 1, 2, 3, 255]]  # a raw frame, for putImageData
    assert result["refused"] == "a raw 2x1 frame is 6 bytes; got 5."
    assert result["epoch"] == 1
    assert result["fresh"] == [1, 0]
    assert server.health()["sessions"] == 0
