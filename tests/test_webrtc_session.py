"""A whole session over WebRTC against a real server: the ``/v1/world`` protocol on a data channel, the frames on
a video track. An aiortc peer starts a world, sees its chunk headers and its frames, steers it, drops its
peer connection and takes the world back with ``session.resume`` on a new one, then closes it."""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

aiortc = pytest.importorskip("aiortc")

from server_harness import RunningServer, missing_fields, start_server  # noqa: E402
from worldserve.server.messages import parse_server_message  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TOKEN = "webrtc-test-token"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--resume-grace-s", "30", token=TOKEN)
    yield running
    running.stop()


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any, str]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


class Peer:
    """A client of the session protocol over WebRTC (what a page or a WebRTC app would do)."""

    def __init__(self) -> None:
        self.pc = aiortc.RTCPeerConnection()
        self.channel = self.pc.createDataChannel("worldserve")
        self.pc.addTransceiver("video", direction="recvonly")
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.track: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.opened = asyncio.Event()
        self.ids = itertools.count(1)
        self.seen: list[dict[str, Any]] = []  # every message the data channel brought
        self.channel.on("message", self._received)
        self.channel.on("open", self.opened.set)
        self.pc.on("track", lambda track: self.track.done() or self.track.set_result(track))

    def _received(self, text: str) -> None:
        message = json.loads(text)
        self.seen.append(message)
        self.inbox.put_nowait(message)

    async def connect(self, server: RunningServer) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        headers = {"Content-Type": "application/sdp", "Authorization": f"Bearer {TOKEN}"}
        status, _, answer = await asyncio.to_thread(
            _post, server.http + "/v1/webrtc", self.pc.localDescription.sdp.encode(), headers
        )
        assert status == 201, answer
        await self.pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=answer, type="answer"))
        await asyncio.wait_for(self.opened.wait(), 20)

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        message_id = f"m{next(self.ids)}"
        self.channel.send(json.dumps({**message, "id": message_id}))
        while True:
            reply = await asyncio.wait_for(self.inbox.get(), 20)
            if reply.get("id") == message_id:
                return reply

    async def chunk(self) -> dict[str, Any]:
        """The next chunk header (acked, as a player acks what it shows)."""
        while True:
            message = await asyncio.wait_for(self.inbox.get(), 20)
            if message["type"] == "chunk":
                self.channel.send(json.dumps({"type": "chunk.ack", "seq": message["seq"]}))
                return message


async def test_a_session_over_webrtc_plays_steers_resumes_after_its_peer_drops_and_closes(
    server: RunningServer,
) -> None:
    peer = Peer()
    await peer.connect(server)
    started = await peer.request({"type": "session.start", "seed": 3, "options": {"media": "jpeg"}})
    assert started["type"] == "session.started"
    assert started["media"] == "raw"  # frames travel on the video track
    first = await peer.chunk()
    assert first["frames"]["count"] == 4
    video = await asyncio.wait_for(peer.track, 20)
    frame = await asyncio.wait_for(video.recv(), 20)
    assert frame.to_ndarray(format="rgb24").shape == (48, 48, 3)
    accepted = await peer.request(
        {
            "type": "input.event",
            "event_id": 1,
            "controls": [{"track": "keys", "schema": "worldserve.keys.v1", "data": {"held": ["W"]}}],
        }
    )
    assert accepted["type"] == "input.accepted"
    for _ in range(20):
        if 1 in (await peer.chunk())["applied_event_ids"]:
            break
    else:
        raise AssertionError("the event was never applied")
    last = (await peer.chunk())["seq"]

    await peer.pc.close()  # the peer connection drops (no DELETE): the member is parked
    again = Peer()
    await again.connect(server)
    resumed = await again.request(
        {
            "type": "session.resume",
            "session_id": started["session_id"],
            "token": started["resume_token"],
            "last_seq": last,
        }
    )
    assert resumed["type"] == "session.resumed", resumed
    after = await again.chunk()
    assert after["seq"] > last
    frame = await asyncio.wait_for((await asyncio.wait_for(again.track, 20)).recv(), 20)
    closed = await again.request({"type": "session.close"})
    assert closed == {**closed, "type": "session.closed", "reason": "closed"}
    await again.pc.close()
    for message in peer.seen + again.seen:  # the data channel speaks the published protocol, as a socket does
        assert missing_fields(message) == [], message
        parse_server_message(json.dumps(message))
    assert {"session.started", "chunk", "input.accepted", "session.resumed", "session.closed"} <= {
        message["type"] for message in peer.seen + again.seen
    }


async def test_a_bad_offer_or_no_token_is_refused_with_a_clear_error(server: RunningServer) -> None:
    url = server.http + "/v1/webrtc"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, _, body = await asyncio.to_thread(_post, url, b"v=0", {**auth, "Content-Type": "application/sdp"})
    assert (status, json.loads(body)["error"]["code"]) == (400, "bad_offer")
    status, _, body = await asyncio.to_thread(_post, url, b"v=0", {"Content-Type": "application/sdp"})
    assert status == 401
    status, _, body = await asyncio.to_thread(_post, url, b"v=0", {**auth, "Content-Type": "text/plain"})
    assert status == 415


async def test_the_python_client_over_webrtc_tells_each_frame_its_chunk_and_resumes(server: RunningServer) -> None:
    """``WebRTCWorldClient`` plays a world shared with a WebSocket viewer sent raw frames. Every frame the track
    brings is told its chunk (``chunk.track``): a chunk's first frame on the track is nearest the viewer's frame of
    that chunk at the index told, never a neighbour's. A dropped peer connection resumes with ``resume()``."""
    from worldserve.client import WorldClient, keys
    from worldserve.webrtc_client import WebRTCWorldClient

    viewed: dict[int, Any] = {}
    checked = 0
    async with WebRTCWorldClient(server.ws, token=TOKEN) as client:
        info = await client.start(seed=5, share_viewers=True)
        assert info.media == "raw"
        assert info.viewer_token
        async with WorldClient(server.ws, token=TOKEN) as viewer:
            await viewer.join(info.session_id, info.viewer_token, media="raw")

            async def watch() -> None:
                while True:
                    chunk = await viewer.next_chunk()
                    viewed[chunk.seq] = chunk.frames.astype(np.int16)

            watching = asyncio.create_task(watch())
            await client.send_event(controls=[keys("W")])  # held: every frame moves
            chunks = [await client.next_chunk(timeout=20) for _ in range(16)]
            await client.drop()  # the peer connection is lost: the member is parked
            resumed = await client.resume()
            assert resumed.session_id == info.session_id
            after = await client.next_chunk(timeout=20)
            assert after.seq > chunks[-1].seq
            await asyncio.sleep(0.5)
            watching.cancel()
        for chunk in chunks:
            made = viewed.get(chunk.seq)
            if made is None or chunk.frames.shape[0] == 0:
                continue
            gaps = [float(np.abs(made[i] - made[j]).mean()) for i in range(len(made)) for j in range(i)]
            if min(gaps, default=0.0) < 8.0:
                continue  # frames too alike to tell apart
            distance = [float(np.abs(chunk.frames[0].astype(np.int16) - frame).mean()) for frame in made]
            assert int(np.argmin(distance)) == chunk.first_frame, (
                chunk.seq,
                chunk.first_frame,
                distance,
                client.frames_guessed,
            )
            checked += 1
        await client.close()
    assert checked >= 5, checked  # enough moving chunks were told apart to mean something
    assert [chunk.seq for chunk in chunks] == list(range(chunks[0].seq, chunks[0].seq + len(chunks)))


def _copies(server: RunningServer) -> dict[str, float]:
    request = urllib.request.Request(f"{server.http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    found = {"taken": 0.0, "unused": 0.0}
    for line in text.splitlines():
        for used in found:
            if line.startswith(f'worldserve_webrtc_copies_total{{used="{used}"}}'):
                found[used] = float(line.rsplit(" ", 1)[1])
    return found


async def test_short_messages_go_on_the_fast_channel_too_both_ways_and_each_is_read_once(server: RunningServer) -> None:
    """The Python client sends each short message first as a copy on its unordered, never-resent channel, and so
    does the server. Against a real server: every event is accepted once (never as a duplicate of its other copy),
    applied in exactly one chunk or dropped as superseded, and both sides took copies (on loopback a copy sent
    first is read first)."""
    from worldserve.client import keys
    from worldserve.webrtc_client import WebRTCWorldClient

    before = _copies(server)
    applied: list[int] = []
    accepted: list[int] = []
    async with WebRTCWorldClient(server.ws, token=TOKEN, ack_on_show=True) as client:
        await client.start(seed=2)
        for turn in range(12):
            acceptance = await client.send_event(controls=[keys("W" if turn % 2 else "A")])
            assert acceptance.status == "accepted", acceptance
            accepted.append(acceptance.event_id)
            for chunk in [await client.next_chunk(timeout=20) for _ in range(turn % 3)]:
                applied.extend(chunk.applied_event_ids)
        while not set(accepted) <= set(applied) | {i for d in client.dropped for i in d.event_ids}:
            applied.extend((await client.next_chunk(timeout=20)).applied_event_ids)
        # The server's copies too: its replies, chunk headers and chunk.track, read from the first copy to come.
        taken = client.fast_taken
        await client.close()
    dropped = [i for d in client.dropped for i in d.event_ids]
    assert all(d.reason == "superseded" for d in client.dropped), client.dropped
    assert sorted(applied + dropped) == sorted(set(applied + dropped)), (applied, dropped)  # none twice
    assert set(applied) | set(dropped) == set(accepted)
    after = _copies(server)
    assert after["taken"] - before["taken"] >= 12, (before, after)  # its events at least, read from their copies
    assert taken >= 12, taken  # the replies to them at least


async def test_the_bench_measures_key_to_photon_over_webrtc(server: RunningServer) -> None:
    """``worldserve bench --transport webrtc``'s client: each applied event's key-to-photon, its parts summing to
    the total, to the first frame of its chunk decoded from the track; every event accounted for."""
    from worldserve.tools.loadtest import run_bench

    result = await run_bench(server.ws, clients=1, duration=2.0, token=TOKEN, settle=5.0, transport="webrtc")
    report = result.reports[0]
    assert not report.errors, report.error_messages
    assert (report.lost, report.applied_twice, report.seq_gaps) == (0, 0, 0)
    assert report.accepted > 0
    assert result.k2p
    assert all(sample.sums(result.offset) for sample in result.k2p)
    assert all(sample.shown >= sample.sent for sample in result.k2p)
    assert len(result.ages) > 0
    assert result.transport == "webrtc"


async def test_a_client_whose_track_stalls_nacks_again_and_asks_for_a_keyframe(server: RunningServer) -> None:
    """What ``WebRTCWorldClient`` does when no frame comes (a packet lost for good): NACK again every packet still
    missing and send a picture loss indication, through aiortc's own receiver (the internals it reads: a test of
    the pinned aiortc). The RTCP it sends is read off the wire."""
    from aiortc.rtp import RTCP_PSFB_PLI, RTCP_RTPFB_NACK, RtcpPacket, RtcpPsfbPacket, RtcpRtpfbPacket

    from worldserve.webrtc_client import _ask_again

    peer = Peer()
    await peer.connect(server)
    await peer.request({"type": "session.start", "seed": 2})
    receiver = next(t.receiver for t in peer.pc.getTransceivers() if t.kind == "video")
    sent: list[Any] = []  # the RTCP packets the receiver sends from now on
    transport = receiver.transport
    send = transport._send_rtp

    async def spy(data: bytes) -> None:
        if len(data) > 1 and 192 <= data[1] <= 223:  # RTCP (RFC 5761): packet types 192-223
            sent.extend(RtcpPacket.parse(data))
        await send(data)

    transport._send_rtp = spy
    try:
        await peer.chunk()
        video = await asyncio.wait_for(peer.track, 20)
        await asyncio.wait_for(video.recv(), 20)
        missing = receiver._RTCRtpReceiver__nack_generator.missing
        missing.add(4242)  # a packet lost for good, as the receiver counts it
        sent.clear()
        await _ask_again(receiver)
        nacks = [p for p in sent if isinstance(p, RtcpRtpfbPacket) and p.fmt == RTCP_RTPFB_NACK]
        plis = [p for p in sent if isinstance(p, RtcpPsfbPacket) and p.fmt == RTCP_PSFB_PLI]
        assert [4242 in nack.lost for nack in nacks] == [True]
        assert len(plis) == 1
        assert nacks[0].media_ssrc == plis[0].media_ssrc == receiver.getSynchronizationSources()[0].source
    finally:
        transport._send_rtp = send
        await peer.pc.close()


async def test_a_chunks_first_frame_sent_on_the_track_is_told_to_the_connection() -> None:
    """In process: ``WebRTCSessions`` with a real aiortc peer. The connection writes a chunk to the data channel
    socket as it would to a WebSocket; as the track sends the chunk's first frame, the socket tells the connection
    (``on_started``: the world's preemption may not replace that chunk any more), once per chunk."""
    from worldserve.server.webrtc_session import DataChannelSocket, WebRTCSessions

    sockets: asyncio.Queue[DataChannelSocket] = asyncio.Queue()
    started: list[int] = []

    async def serve(socket: DataChannelSocket) -> None:
        socket.on_started = started.append  # what the app sets: Connection.frames_started
        sockets.put_nowait(socket)
        while (await socket.receive())["type"] != "websocket.disconnect":
            pass

    sessions = WebRTCSessions(serve, lambda: 16.0, frames=lambda: 6, max_message_bytes=1 << 20)
    peer = Peer()
    try:
        await peer.pc.setLocalDescription(await peer.pc.createOffer())
        _, answer = await sessions.offer(peer.pc.localDescription.sdp)
        await peer.pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=answer, type="answer"))
        async with asyncio.timeout(20):
            socket = await sockets.get()
            for seq in (7, 8):
                await socket.send_text(
                    json.dumps(
                        {"type": "chunk", "seq": seq, "frames": {"height": 32, "width": 32, "count": 2}},
                        separators=(",", ":"),  # as the server writes it (wire_json)
                    )
                )
                for _ in range(2):
                    await socket.send_bytes(np.full((32, 32, 3), seq * 20, np.uint8).tobytes())
            while len(started) < 2:  # noqa: ASYNC110 - the track's sender pulls its frames at 16 fps
                await asyncio.sleep(0.01)
        assert started == [7, 8]
    finally:
        await peer.pc.close()
        await sessions.aclose()


class _Channel:
    """Just what DataChannelSocket reads of a data channel: its handlers, and what it is sent (also to ``log``, a
    list that channels may share, to tell the order of sends across them)."""

    readyState = "open"

    def __init__(self, log: list[tuple[int, str]] | None = None) -> None:
        self.handlers: dict[str, Any] = {}
        self.sent: list[str] = []
        self._log = log

    def on(self, event: str, handler: Any) -> None:
        self.handlers[event] = handler

    def send(self, data: str) -> None:
        self.sent.append(data)
        if self._log is not None:
            self._log.append((id(self), data))


async def test_a_long_message_in_binary_pieces_ended_by_an_empty_text_is_read_as_one() -> None:
    """Chromium sends at most 256 KiB a data channel message: a longer one (a start with its images) comes as its
    UTF-8 bytes in binary pieces and an empty text. The socket joins them; over its limit it drops them as they
    come and says so; pieces not ended by an empty text are binary, as the connection refuses it."""
    from worldserve.server.webrtc import FrameTrack
    from worldserve.server.webrtc_session import DataChannelSocket

    socket = DataChannelSocket(FrameTrack(16.0, 6, lambda seq: None), max_message_bytes=1000)
    channel = _Channel()
    socket.attach(channel)
    received = channel.handlers["message"]
    text = json.dumps({"type": "ping", "id": "p1", "pad": "ä" * 300}, ensure_ascii=False)  # pieces split its "ä"s
    data = text.encode()
    for start in range(0, len(data), 101):
        received(data[start : start + 101])
    received("")
    assert (await socket.receive()) == {"type": "websocket.receive", "text": text}
    received('{"type":"ping","id":"p2"}')  # a short one as before
    assert (await socket.receive())["text"] == '{"type":"ping","id":"p2"}'
    for _ in range(11):
        received(b"x" * 100)  # 1100 bytes: over the limit
    received("")
    assert (await socket.receive()) == {"type": "websocket.receive", "oversize": 1100}
    received(b"abc")
    received('{"type":"ping","id":"p3"}')  # pieces never ended
    assert (await socket.receive()) == {"type": "websocket.receive", "bytes": b"abc"}
    assert (await socket.receive())["text"] == '{"type":"ping","id":"p3"}'


async def test_a_start_image_larger_than_a_data_channel_message_starts_the_world_over_webrtc() -> None:
    """A 512x512 start image (its start message over 256 KiB, more than a data channel message may be) starts a
    world over WebRTC: the Python client sends it in pieces, the server joins them, and the world's first frame
    is the image (up to VP8's loss)."""
    from worldserve.webrtc_client import WebRTCWorldClient

    running = start_server(
        "--model", "procedural", "--model-option", "height=512", "--model-option", "width=512", token=TOKEN
    )
    try:
        rows = np.linspace(0, 255, 512, dtype=np.float64)[:, None, None]
        grain = np.random.default_rng(3).integers(0, 24, (512, 512, 3))  # fine grain: a PNG too big to shrink
        image = np.clip(rows + grain + np.array([0, 60, 120]), 0, 255).astype(np.uint8)
        async with WebRTCWorldClient(running.ws, token=TOKEN) as client:
            await client.start(seed=1, image=image)
            chunk = await client.next_chunk(timeout=30)
            assert chunk.frames.shape[1:] == (512, 512, 3)
            difference = np.abs(chunk.frames[0].astype(np.int16) - image).mean()
            assert difference < 20, difference
            await client.close()
    finally:
        running.stop()


def _merging_socket() -> tuple[Any, Any, Any]:
    """A socket with both channels attached: (socket, the main channel's handler, the fast channel's)."""
    from worldserve.server.webrtc import FrameTrack
    from worldserve.server.webrtc_session import DataChannelSocket

    socket = DataChannelSocket(FrameTrack(16.0, 6, lambda seq: None), max_message_bytes=1 << 16)
    main, fast = _Channel(), _Channel()
    socket.attach(main)
    socket.attach_fast(fast)
    return socket, main.handlers["message"], fast.handlers["message"]


async def test_the_server_sends_each_short_message_first_as_a_copy_on_the_fast_channel() -> None:
    """The other way: what the server sends goes as the client sends, a copy of each short message first on the
    client's fast channel, prefixed with its index among the main channel's messages; a long one only on the main
    channel. A client's ChannelMerge fed both, copies first, reads the server's stream once, in order."""
    from worldserve.fast_channel import FAST_COPY_CHARS, ChannelMerge
    from worldserve.server.webrtc import FrameTrack
    from worldserve.server.webrtc_session import DataChannelSocket

    log: list[tuple[int, str]] = []
    main, fast = _Channel(log), _Channel(log)
    socket = DataChannelSocket(FrameTrack(16.0, 6, lambda seq: None), max_message_bytes=1 << 16)
    socket.attach(main)
    await socket.send_text('{"type":"session.started"}')  # before the fast channel opened: no copy
    socket.attach_fast(fast)
    short = json.dumps({"type": "event.accepted", "event_id": 1})
    long = json.dumps({"type": "session.state", "pad": "z" * FAST_COPY_CHARS})
    await socket.send_text(short)
    await socket.send_text(long)
    socket.track_told(4, 0, 1234)
    told = main.sent[-1]
    assert json.loads(told) == {"type": "chunk.track", "seq": 4, "frame": 0, "rtp": 1234}
    assert main.sent == ['{"type":"session.started"}', short, long, told]
    assert fast.sent == [f"1:{short}", f"3:{told}"]
    assert [data for _, data in log][1:] == [f"1:{short}", short, long, f"3:{told}", told]  # each copy first
    assert socket.fast_sent == 2
    merge = ChannelMerge()
    read = [*merge.copy(fast.sent[0]), *merge.copy(fast.sent[1])]
    assert read == []  # copies wait for message 0
    for message in main.sent:
        read += merge.main(message)
    assert read == main.sent
    assert (merge.taken, merge.unused) == (2, 0)


def _read_now(socket: Any) -> list[str]:
    """Every message the connection could read now, in order."""
    read = []
    while not socket._incoming.empty():
        read.append(socket._incoming.get_nowait()["text"])
    return read


def test_a_fast_copy_is_read_in_its_place_once_whichever_copy_comes_first() -> None:
    """The fast channel's copy of main message k ("k:<text>") is read as soon as every message before k has come,
    and the main channel's own copy is then passed over; a copy that comes after its main copy is not used; copies
    ahead of a gap wait for it; malformed copies are not used."""
    socket, main, fast = _merging_socket()
    messages = [json.dumps({"type": "chunk.ack", "seq": i}) for i in range(6)]
    fast(f"0:{messages[0]}")  # first, by its copy
    main(messages[0])  # its main copy: passed over
    main(messages[1])  # first by its main copy
    fast(f"1:{messages[1]}")  # late: not used
    fast(f"3:{messages[3]}")  # ahead of a gap (2): waits
    assert _read_now(socket) == messages[:2]
    main(messages[2])  # the gap closes: 2 then 3
    assert _read_now(socket) == messages[2:4]
    main(messages[3])  # passed over: read from its copy
    fast("x:{}")
    fast("5")
    fast(b"4:{}")
    main(messages[4])
    main(messages[5])
    assert _read_now(socket) == messages[4:]
    assert (socket.fast_taken, socket.fast_unused) == (2, 4)


def test_copies_never_reorder_or_split_a_long_message_in_pieces() -> None:
    """Main messages 0-2 are a long message's two binary pieces and the empty text that ends it; a copy of message
    3 that comes before them waits, and is read after the joined message."""
    socket, main, fast = _merging_socket()
    long = json.dumps({"type": "ping", "pad": "y" * 300})
    fast('3:{"type":"chunk.ack","seq":1}')
    main(long.encode()[:200])
    main(long.encode()[200:])
    assert _read_now(socket) == []
    main("")
    assert _read_now(socket) == [long, '{"type":"chunk.ack","seq":1}']
    main('{"type":"chunk.ack","seq":1}')
    assert _read_now(socket) == []


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(data=st.data(), count=st.integers(1, 40))
def test_whatever_copies_come_and_in_whatever_order_the_connection_reads_the_main_stream_once(
    data: st.DataObject, count: int
) -> None:
    """Adversarial: the main channel brings its messages in order; the fast channel brings copies of any of them,
    any number of times (also none), in any order, interleaved anyhow with the main channel. The connection reads
    the main stream exactly: every message once, in order."""
    from worldserve.fast_channel import FAST_HELD

    socket, main, fast = _merging_socket()
    messages = [json.dumps({"type": "input.event", "event_id": i}) for i in range(count)]
    copies = data.draw(st.lists(st.integers(0, count - 1), max_size=3 * count), label="copies")
    arrivals = [("main", i) for i in range(count)] + [("fast", i) for i in copies]
    order = data.draw(st.permutations(range(len(arrivals))), label="order")
    mains = iter(range(count))
    for position in order:  # the main channel's arrivals keep their own order, whatever the interleaving
        kind, index = arrivals[position]
        if kind == "main":
            main(messages[next(mains)])
        else:
            fast(f"{index}:{messages[index]}")
        assert socket.merge.held <= FAST_HELD
    assert _read_now(socket) == messages
    assert not socket.merge.held  # nothing left waiting
    assert socket.fast_taken + socket.fast_unused == len(copies)  # each copy taken or passed over, once
    assert socket.fast_taken <= len(set(copies))


def test_the_python_client_tells_a_frame_its_chunk_only_once_that_is_sure_or_its_hold_ran_out() -> None:
    """A frame decoded before its chunk's ``chunk.track`` (zero playout delay shows it at once) must not be told the
    chunk before: it waits until a mark at or after it is known, or for ``_HOLD_S`` at most, and then it is counted
    as guessed. Frames keep the order they were decoded in."""
    import time

    from worldserve import webrtc_client
    from worldserve.webrtc_client import WebRTCWorldClient, _Shown

    client = WebRTCWorldClient("ws://127.0.0.1:9/v1/world")
    image = np.zeros((2, 2, 3), np.uint8)
    now = time.monotonic()
    client._marks[0] = 1000  # chunk 0 starts at RTP 1000, its frames every 100 ticks
    client._held = [_Shown(1000, now, image), _Shown(1100, now, image), _Shown(1200, now, image)]
    client._tell()
    # chunk 0's first frame is sure (its own mark); the next two could still be chunk 1's (its mark on its way)
    assert [shown.rtp for shown in client._shown[0]] == [1000]
    assert [shown.rtp for shown in client._held] == [1100, 1200]
    client._marks[1] = 1200  # chunk 1's mark: 1100 is chunk 0's, 1200 chunk 1's first frame
    client._tell()
    assert [shown.rtp for shown in client._shown[0]] == [1000, 1100]
    assert [shown.rtp for shown in client._shown[1]] == [1200]
    assert client.frames_guessed == 0
    assert not client._held
    # a frame past the last mark, held longer than the hold: told the chunk known then, and counted
    client._held = [_Shown(1300, now - webrtc_client._HOLD_S - 0.01, image), _Shown(1400, now, image)]
    client._tell()
    assert [shown.rtp for shown in client._shown[1]] == [1200, 1300]
    assert [shown.rtp for shown in client._held] == [1400]
    assert client.frames_guessed == 1
    assert webrtc_client._HOLD_S >= 1.0  # as long as the TypeScript client's HOLD_MS: a loaded box delays marks
