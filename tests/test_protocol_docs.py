"""What docs/protocol.md says about the wire, read off the wire of a real ``worldserve serve``.

Each test names the statement it checks. The messages are read raw (``websockets``), in the
order the server wrote them, so an order the docs state is checked as written. Nothing here
waits on a clock: every wait is for a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from server_harness import RunningServer, missing_fields, start_server

KEYS = "worldserve.keys.v1"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--resume-grace-s", "60")
    yield running
    running.stop()


class Wire:
    """One raw connection: sends JSON, reads text messages in order (a chunk's binary frames are read
    with it), optionally acking each chunk as it arrives. Each message read must carry every field the
    published schema requires of its type (docs/protocol.md: always present, ``null`` or not)."""

    def __init__(self, ws: ClientConnection, *, ack: bool = True) -> None:
        self.ws = ws
        self.ack = ack
        self.seen: list[dict[str, Any]] = []
        self._ids = 0

    @classmethod
    async def open(cls, server: RunningServer, *, ack: bool = True) -> Wire:
        return cls(await websockets.connect(server.ws, max_size=None), ack=ack)

    async def send(self, message: dict[str, Any]) -> str:
        self._ids += 1
        message_id = f"m{self._ids}"
        await self.ws.send(json.dumps({**message, "id": message_id}))
        return message_id

    async def next(self) -> dict[str, Any]:
        while True:
            raw = await asyncio.wait_for(self.ws.recv(), 60)
            if isinstance(raw, bytes):
                raise AssertionError("a binary message outside a chunk")
            message: dict[str, Any] = json.loads(raw)
            assert missing_fields(message) == [], message  # every field the schema requires, null or not
            if message["type"] == "chunk":
                for _ in range(len(message["frames"]["sizes"])):  # per frame, or one H.264 fragment
                    frame = await asyncio.wait_for(self.ws.recv(), 60)
                    assert isinstance(frame, bytes)
                if self.ack:
                    with contextlib.suppress(websockets.ConnectionClosed):  # the server may be closing it
                        await self.ws.send(json.dumps({"type": "chunk.ack", "seq": message["seq"]}))
            self.seen.append(message)
            return message

    async def until(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Read until a message of ``kind`` (with ``fields``) arrives; return it."""
        while True:
            message = await self.next()
            if message["type"] == kind and all(message.get(k) == v for k, v in fields.items()):
                return message
            if message["type"] == "error" and kind != "error":
                raise AssertionError(message)

    async def reply(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send ``message`` and read until the reply carrying its id."""
        message_id = await self.send(message)
        while True:
            got = await self.next()
            if got.get("id") == message_id:
                return got

    async def synced(self) -> None:
        """Everything sent so far (acks included) has been taken by the server: a ping's pong came back."""
        await self.reply({"type": "ping"})

    async def start(self, **fields: Any) -> dict[str, Any]:
        started = await self.reply({"type": "session.start", "options": {"media": "raw"}, **fields})
        assert started["type"] == "session.started", started
        return started

    def drop(self) -> None:
        """Lose the connection with no close handshake (the server parks the member)."""
        self.ws.transport.abort()

    async def close(self) -> None:
        await self.ws.close()


def keys_event(event_id: int, *held: str) -> dict[str, Any]:
    control = {"track": "keys", "schema": KEYS, "data": {"held": list(held)}}
    return {"type": "input.event", "event_id": event_id, "controls": [control]}


# -- errors ---------------------------------------------------------------------------------


async def test_invalid_control_names_the_clients_own_event_id(server: RunningServer) -> None:
    """Protocol: `invalid_control` refuses "the event" -- by this client's `event_id`, not the session's."""
    host = await Wire.open(server)
    started = await host.start(seed=1, share={"controllers": True})
    controller = await Wire.open(server)
    joined = await controller.reply(
        {"type": "session.join", "session_id": started["session_id"], "token": started["share"]["controller"],
         "role": "controller"}
    )  # fmt: skip
    assert joined["type"] == "session.joined"
    assert (await host.reply(keys_event(5, "W")))["type"] == "input.accepted"  # the session's ids move on
    for wire, event_id in ((host, 7), (controller, 3)):
        refused = await wire.reply(keys_event(event_id, "Q"))
        assert refused["type"] == "error"
        assert refused["code"] == "invalid_control"
        assert refused["event_id"] == event_id
        assert refused["message"].startswith(f"event {event_id} refused: control track 'keys'"), refused
    await controller.close()
    await host.close()


async def test_a_viewers_chunk_cancel_is_not_controller(server: RunningServer) -> None:
    """Protocol (errors): `not_controller` answers a viewer's `chunk.cancel` too."""
    host = await Wire.open(server)
    started = await host.start(seed=2, share={"viewers": True})
    viewer = await Wire.open(server)
    await viewer.reply(
        {"type": "session.join", "session_id": started["session_id"], "token": started["share"]["viewer"],
         "role": "viewer"}
    )  # fmt: skip
    for message in ({"type": "chunk.cancel"}, {"type": "session.reset"}, keys_event(1, "W")):
        refused = await viewer.reply(message)
        assert (refused["type"], refused["code"]) == ("error", "not_controller"), refused
    await viewer.close()
    await host.close()


async def test_each_member_is_sent_its_own_media(server: RunningServer) -> None:
    """Protocol (each member's media): `session.join {media}` picks what that member is sent;
    `session.joined.media` names it, and so does each of its chunks' `frames.media` (JPEG: one binary
    per frame), while the host goes on getting the world's H.264; `session.resume {media}` changes it."""
    host = await Wire.open(server)
    started = await host.start(seed=3, options={"media": "h264"}, share={"viewers": True})
    assert started["media"] == "h264"
    playing = asyncio.create_task(host.until("never"))  # the host reads (and acks) on
    viewer = await Wire.open(server)
    joined = await viewer.reply(
        {"type": "session.join", "session_id": started["session_id"], "token": started["share"]["viewer"],
         "role": "viewer", "media": "jpeg"}
    )  # fmt: skip
    assert (joined["type"], joined["media"]) == ("session.joined", "jpeg"), joined
    for _ in range(2):
        chunk = await viewer.until("chunk")
        assert chunk["frames"]["media"] == "jpeg"
        assert len(chunk["frames"]["sizes"]) == chunk["frames"]["count"]
    viewer.drop()
    viewer = await Wire.open(server)
    resumed = await viewer.reply(
        {"type": "session.resume", "session_id": started["session_id"], "token": joined["resume_token"],
         "last_seq": chunk["seq"], "media": "raw"}
    )  # fmt: skip
    assert (resumed["type"], resumed["media"]) == ("session.resumed", "raw"), resumed
    chunk = await viewer.until("chunk")
    assert chunk["frames"]["media"] == "raw"
    assert chunk["frames"]["sizes"] == [48 * 48 * 3] * chunk["frames"]["count"]
    await viewer.close()
    playing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await playing
    assert {m["frames"]["media"] for m in host.seen if m["type"] == "chunk"} == {"h264"}
    await host.close()  # a clean close: the world ends (the read cancelled may have stopped mid-chunk)


async def test_resume_and_join_on_a_connection_with_a_session_are_session_exists(server: RunningServer) -> None:
    """Protocol (errors): `session_exists` answers `session.resume` and `session.join` on a connection whose
    session is open, as it answers a second `session.start`."""
    host = await Wire.open(server)
    started = await host.start(seed=3, share={"viewers": True})
    for message in (
        {"type": "session.start"},
        {"type": "session.resume", "session_id": started["session_id"], "token": started["resume_token"],
         "last_seq": -1},
        {"type": "session.join", "session_id": started["session_id"], "token": started["share"]["viewer"],
         "role": "viewer"},
    ):  # fmt: skip
        refused = await host.reply(message)
        assert (refused["type"], refused["code"]) == ("error", "session_exists"), refused
    await host.close()


# -- the waiting line --------------------------------------------------------------------------


async def test_every_session_queued_carries_position_ahead_and_eta_s_null_or_not() -> None:
    """Protocol (the waiting line): each `session.queued` carries `position`, `ahead` and `eta_s` (`null` until a
    world has ended): the first notice and every update (updates used to leave a null `eta_s` out)."""
    running = start_server("--model", "procedural", "--workers", "1", "--max-sessions-per-worker", "1",
                           "--evict-idle-s", "300")  # fmt: skip
    try:
        player = await Wire.open(running)
        await player.start(seed=1)
        await player.until("chunk", seq=1)  # acked: the world is in use, never evicted for the line
        waiters = [await Wire.open(running) for _ in range(3)]
        for index, waiter in enumerate(waiters):
            await waiter.send({"type": "session.start", "seed": 10 + index, "queue": True})
            first = await waiter.until("session.queued")
            assert (first["position"], first["ahead"], first["eta_s"]) == (index + 1, index, None), first
        left = await waiters[0].reply({"type": "session.close"})
        assert (left["type"], left["reason"]) == ("session.closed", "left_queue")
        for position, waiter in enumerate(waiters[1:], start=1):  # they move up; still nothing measured
            moved = await waiter.until("session.queued", position=position)
            assert (moved["ahead"], moved["eta_s"]) == (position - 1, None), moved
        await player.reply({"type": "session.close"})  # a world ends: the next in line starts
        await waiters[1].until("session.started")
        while (update := await waiters[2].until("session.queued"))["position"] != 1 or update["eta_s"] is None:
            pass
        assert update["ahead"] == 0
        assert update["eta_s"] >= 0
        notices = [m for m in waiters[2].seen if m["type"] == "session.queued"]
        assert all({"position", "ahead", "eta_s"} <= set(m) for m in notices), notices
        for waiter in waiters[1:]:
            await waiter.reply({"type": "session.close"})
            await waiter.close()
        await waiters[0].close()
        await player.close()
    finally:
        running.stop()
    assert "Traceback" not in running.log()


# -- seq, resume ----------------------------------------------------------------------------


async def test_a_resume_with_keyframe_starts_the_h264_stream_again(server: RunningServer) -> None:
    """Protocol (media): the stream goes on across a resume without a gap (no init segment); a
    `session.resume {keyframe: true}` (a client with no decoder) gets, after `session.resumed`, the
    chunks before the next IDR frame as `chunk.skipped`, then that IDR frame with the init segment in
    front, as a late joiner does."""
    host = await Wire.open(server)
    started = await host.reply({"type": "session.start", "seed": 8, "options": {"media": "h264"}})
    assert started["type"] == "session.started", started
    for keyframe in (False, True):
        await host.until("chunk")
        await host.synced()
        last = [m for m in host.seen if m["type"] == "chunk"][-1]  # the last one read before the drop
        host.drop()
        host = await Wire.open(server)
        resume = {"type": "session.resume", "session_id": started["session_id"], "token": started["resume_token"],
                  "last_seq": last["seq"]}  # fmt: skip
        if keyframe:
            resume["keyframe"] = True
        resumed = await host.reply(resume)
        assert resumed["type"] == "session.resumed", resumed
        following = await host.next()
        if not keyframe:
            assert following["type"] == "chunk"  # the chunk after last_seq (re-sent, or the next made) ...
            assert following["seq"] == last["seq"] + 1
            assert not following["frames"].get("init_bytes")  # ... goes on in the client's stream
            continue
        skipped_to = last["seq"]
        if following["type"] == "chunk.skipped":  # the chunks made before the IDR frame, if any
            assert following["from_seq"] == last["seq"] + 1
            assert following["reason"] == "keyframe", following
            skipped_to = following["to_seq"]
            following = await host.next()
        assert following["type"] == "chunk"
        assert following["seq"] == skipped_to + 1
        assert following["frames"]["keyframe"] is True
        assert following["frames"]["init_bytes"] > 0
    await host.reply({"type": "session.close"})
    await host.close()


async def test_session_joined_seq_is_this_connections_numbering(server: RunningServer) -> None:
    """Protocol: `session.joined.seq` is the world's last chunk numbered as this connection numbers
    chunks (per connection); the first chunk the joiner gets is `seq + 1`."""
    host = await Wire.open(server)
    started = await host.start(seed=4, share={"viewers": True})
    await host.until("chunk", seq=1)

    async def keep_playing() -> None:  # the host reads (and acks) on: its world never waits on backpressure
        while True:
            await host.next()

    playing = asyncio.create_task(keep_playing())
    joiner = await Wire.open(server)
    await joiner.start(seed=5)  # this connection's own session first: its chunks take seq 0, 1, 2, ...
    await joiner.until("chunk", seq=2)
    assert (await joiner.reply({"type": "session.close"}))["type"] == "session.closed"  # after all its chunks
    base = 1 + max(m["seq"] for m in joiner.seen if m["type"] == "chunk")
    joined = await joiner.reply(
        {"type": "session.join", "session_id": started["session_id"], "token": started["share"]["viewer"],
         "role": "viewer"}
    )  # fmt: skip
    first = await joiner.until("chunk")
    assert first["seq"] == joined["seq"] + 1

    def host_seq() -> dict[str, int]:
        return {m["request_id"]: m["seq"] for m in host.seen if m["type"] == "chunk"}

    async with asyncio.timeout(60):
        while first["request_id"] not in host_seq():  # noqa: ASYNC110 - the same chunk, as the host numbers it
            await asyncio.sleep(0.01)
    playing.cancel()
    assert first["seq"] == host_seq()[first["request_id"]] + base
    await joiner.close()
    await host.close()


async def test_a_resume_gets_chunk_skipped_first_then_the_buffered_chunks(server: RunningServer) -> None:
    """Protocol (resume): after `session.resumed` come, in seq order, the `chunk.skipped` for chunks the
    buffer (`--replay-chunks`, 8) no longer holds, then the buffered chunks, with no gap or repeat."""
    host = await Wire.open(server)
    started = await host.start(seed=6)
    assert started["resume_grace_s"] == 60  # the server's --resume-grace-s, told with the resume token
    await host.until("chunk", seq=11)
    await host.synced()
    host.drop()  # generation pauses: the host was the only controller
    again = await Wire.open(server)
    resumed = await again.reply(
        {"type": "session.resume", "session_id": started["session_id"], "token": started["resume_token"],
         "last_seq": -1}  # this client kept nothing: everything is missing
    )  # fmt: skip
    assert resumed["type"] == "session.resumed"
    assert resumed["replayed"] == 8
    last = resumed["seq"]
    skipped = await again.next()
    assert skipped["type"] == "chunk.skipped", skipped
    assert (skipped["from_seq"], skipped["to_seq"], skipped["reason"]) == (0, last - 8, "resume")
    chunks = [await again.next() for _ in range(8)]
    assert [m["type"] for m in chunks] == ["chunk"] * 8
    assert [m["seq"] for m in chunks] == list(range(last - 7, last + 1))
    await again.reply({"type": "session.close"})
    await again.close()


async def test_resent_chunks_name_a_members_events_only_if_it_had_not_acked_them(server: RunningServer) -> None:
    """Protocol (resume): each event is reported to a member once: a chunk re-sent after a resume carries
    the member's applied ids only if the member had not acked it; an acked one comes with empty lists."""
    host = await Wire.open(server, ack=False)
    started = await host.start(seed=7)

    async def ack_all() -> None:  # an ack acks every chunk up to it
        seqs = [m["seq"] for m in host.seen if m["type"] == "chunk"]
        if seqs:
            await host.ws.send(json.dumps({"type": "chunk.ack", "seq": max(seqs)}))

    async def applying(event_id: int) -> dict[str, Any]:
        """The chunk that applies ``event_id``, every chunk before it acked, itself not (yet)."""
        while True:
            await ack_all()
            chunk = await host.until("chunk")
            if event_id in chunk["applied_event_ids"]:
                return chunk

    assert (await host.reply(keys_event(1, "D")))["status"] == "accepted"
    acked = await applying(1)
    await ack_all()  # acked, as every chunk before it
    assert (await host.reply(keys_event(2, "W")))["status"] == "accepted"
    unacked = await applying(2)  # not acked
    await host.synced()
    host.drop()
    again = await Wire.open(server)
    resumed = await again.reply(
        {"type": "session.resume", "session_id": started["session_id"], "token": started["resume_token"],
         "last_seq": acked["seq"] - 1}  # claims it missed the acked chunk too
    )  # fmt: skip
    assert resumed["type"] == "session.resumed"
    resent = {}
    while unacked["seq"] not in resent:
        chunk = await again.until("chunk")
        resent[chunk["seq"]] = chunk
    assert resent[acked["seq"]]["request_id"] == acked["request_id"]
    assert resent[acked["seq"]]["applied_event_ids"] == []  # acked: its event was reported once already
    assert resent[acked["seq"]]["applied_latency_ms"] == []
    assert resent[unacked["seq"]]["request_id"] == unacked["request_id"]
    assert resent[unacked["seq"]]["applied_event_ids"] == [2]  # not acked: reported again
    await again.reply({"type": "session.close"})
    await again.close()


async def test_a_controllers_reset_reaches_the_host_only_as_a_new_epoch(server: RunningServer) -> None:
    """Protocol (sharing): only the controller that reset gets `session.reset`; the host sees the next chunk
    with the new epoch and chunk_index 0, and its own discarded events in `input.dropped` `reset`."""
    host = await Wire.open(server)
    started = await host.start(seed=8, share={"controllers": True})
    controller = await Wire.open(server)
    await controller.reply(
        {"type": "session.join", "session_id": started["session_id"], "token": started["share"]["controller"],
         "role": "controller"}
    )  # fmt: skip
    await host.until("chunk", seq=1)
    reply = await controller.reply({"type": "session.reset"})
    assert (reply["type"], reply["epoch"]) == ("session.reset", 1)
    after = await host.until("chunk", epoch=1)
    assert after["chunk_index"] == 0
    assert "session.reset" not in [m["type"] for m in host.seen]
    await controller.close()
    await host.close()


# -- the server's stop --------------------------------------------------------------------------


async def _read_to_the_end(wire: Wire) -> None:
    while True:
        await wire.next()


async def _texts_to_the_end(socket: ClientConnection, said: list[dict[str, Any]]) -> None:
    while True:
        message = await asyncio.wait_for(socket.recv(), 30)
        if isinstance(message, str):
            said.append(json.loads(message))


async def test_a_server_stop_tells_every_member_shutdown_before_closing_their_sockets() -> None:
    """Protocol: `session.closed {reason: "shutdown"}` to every member of every world when the server stops
    (SIGTERM), then each WebSocket closes with 1001; a `/v1/realtime/video` session gets `session.done
    {stopped: true}`, then 1001 too."""
    running = start_server("--model", "procedural")
    try:
        host = await Wire.open(running)
        started = await host.start(seed=9, share={"viewers": True})
        viewer = await Wire.open(running)
        await viewer.reply(
            {"type": "session.join", "session_id": started["session_id"], "token": started["share"]["viewer"],
             "role": "viewer"}
        )  # fmt: skip
        idle = await Wire.open(running)  # a connection with no session
        await idle.synced()
        video = await websockets.connect(f"ws://127.0.0.1:{running.port}/v1/realtime/video", max_size=None)
        await video.send(json.dumps({"type": "session.start", "prompt": "islands"}))
        assert json.loads(await asyncio.wait_for(video.recv(), 30))["type"] == "video.start"
        assert json.loads(await asyncio.wait_for(video.recv(), 30))["type"] == "video.chunk_metadata"
        await host.until("chunk", seq=2)
        running.process.send_signal(signal.SIGTERM)
        said: list[dict[str, Any]] = []
        with pytest.raises(websockets.ConnectionClosed) as video_ended:
            await _texts_to_the_end(video, said)
        assert said[-1]["type"] == "session.done"
        assert said[-1]["stopped"] is True
        assert video_ended.value.rcvd is not None
        assert video_ended.value.rcvd.code == 1001
        for wire in (host, viewer):
            closed = await wire.until("session.closed")
            assert closed["reason"] == "shutdown"
        for wire in (host, viewer, idle):
            with pytest.raises(websockets.ConnectionClosed) as ended:
                await _read_to_the_end(wire)
            assert ended.value.rcvd is not None
            assert ended.value.rcvd.code == 1001
        # A stop asked for is a clean exit, after the runtime closed (its shared memory unlinked).
        assert running.process.wait(timeout=60) == 0
        assert "Traceback" not in running.log()
        assert "leaked shared_memory" not in running.log()
    finally:
        running.stop()


async def test_a_stop_sent_to_the_whole_process_group_still_tells_every_member_shutdown() -> None:
    """systemd's default KillMode, `timeout` and `kill -- -PGID` send SIGTERM to the workers too: the
    server still shuts down as it does alone (the workers leave that to it), so a player hears
    `session.closed {reason: "shutdown"}`, not `session.failed {code: worker_died}`."""
    running = start_server("--model", "procedural", "--workers", "2", own_group=True)
    try:
        host = await Wire.open(running)
        await host.start(seed=3)
        await host.until("chunk", seq=2)
        os.killpg(running.process.pid, signal.SIGTERM)
        while (message := await host.next())["type"] != "session.closed":
            assert message["type"] != "session.failed", message
        assert message["reason"] == "shutdown"
        assert running.process.wait(timeout=60) == 0
        log = running.log()
        assert "leaked shared_memory" not in log
        assert "died" not in log
        assert "Traceback" not in log
    finally:
        running.stop()


# -- chunk.cancel with journals ------------------------------------------------------------------


async def test_chunk_cancel_works_on_a_server_that_keeps_journals(tmp_path: Path) -> None:
    """`chunk.cancel` on a server with `--record-dir`: the journal passes the cancel on (it used to refuse every
    one with `cancel_unsupported`); the cancelled chunk is never sent nor journaled."""
    from worldserve.runtime.journal import read_journal

    running = start_server(
        "--model", "runtime_models:FaultyModel", "--model-option", "slow_s=0.3", "--record-dir", str(tmp_path),
        test_models=True,
    )  # fmt: skip
    try:
        host = await Wire.open(running)
        started = await host.start(seed=10, prompt="slow")  # each step sleeps 0.3 s: a chunk is mostly in flight
        await host.until("chunk", seq=0)
        cancelled = None
        for _ in range(200):
            reply = await host.reply({"type": "chunk.cancel"})
            if reply["type"] == "chunk.cancelled":
                cancelled = reply
                break
            assert (reply["type"], reply["code"]) == ("error", "nothing_to_cancel"), reply
            await host.until("chunk")  # between chunks: try again during the next one
        assert cancelled is not None
        # The next chunk has the cancelled chunk's index; no chunk with it came before.
        nxt = await host.until("chunk", chunk_index=cancelled["chunk_index"])
        indexes = [m["chunk_index"] for m in host.seen if m["type"] == "chunk"]
        assert indexes == list(range(nxt["chunk_index"] + 1))
        await host.reply({"type": "session.close"})
    finally:
        running.stop()
    journal = read_journal(tmp_path / f"{started['session_id']}.jsonl")
    journaled = [chunk.chunk_index for chunk in journal.chunks]  # the session may have made more before the close
    assert journaled == list(range(len(journaled)))
    assert journaled[: len(indexes)] == indexes
    assert journal.complete


# -- metrics ---------------------------------------------------------------------------------------


def _metrics(server: RunningServer) -> dict[str, float]:
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _family(samples: dict[str, float], name: str) -> dict[str, float]:
    return {key: value for key, value in samples.items() if key.startswith(name + "{")}


async def test_metric_families_each_sum_and_the_clock_period_goes_with_the_last_session() -> None:
    running = start_server("--model", "procedural")
    try:
        host = await Wire.open(running)
        await host.start(seed=11)
        await host.until("chunk", seq=1)
        for event_id in range(1, 6):  # held keys: the older ones are superseded or applied
            await host.reply(keys_event(event_id, "D" if event_id % 2 else "W"))
        await host.reply(keys_event(2, "W"))  # stale
        await host.reply(keys_event(9, "Q"))  # invalid
        await host.reply({"type": "session.start"})  # an error reply for the client's fault
        live = await asyncio.to_thread(_metrics, running)
        periods = _family(live, "worldserve_chunk_period_seconds")
        assert list(periods) == ['worldserve_chunk_period_seconds{worker="0"}']
        assert periods['worldserve_chunk_period_seconds{worker="0"}'] >= 0.25
        events = _family(live, "worldserve_events_total")
        settled = _family(live, "worldserve_events_settled_total")
        assert sorted(events) == [f'worldserve_events_total{{outcome="{o}"}}' for o in
                                  ("accepted", "duplicate", "invalid", "rejected_full", "stale")]  # fmt: skip
        assert sorted(settled) == [f'worldserve_events_settled_total{{fate="{f}"}}' for f in
                                   ("applied", "dropped", "superseded")]  # fmt: skip
        assert sum(events.values()) == 7  # every event that reached the session, once
        accepted = events['worldserve_events_total{outcome="accepted"}']
        assert accepted == 5
        assert sum(settled.values()) + live["worldserve_queue_depth"] == accepted
        client_errors = _family(live, "worldserve_client_errors_total")
        server_errors = _family(live, "worldserve_server_errors_total")
        assert client_errors['worldserve_client_errors_total{code="session_exists"}'] == 1
        assert 'worldserve_client_errors_total{code="admission_refused"}' not in client_errors
        assert 'worldserve_server_errors_total{code="admission_refused"}' in server_errors
        assert 'worldserve_server_errors_total{code="session_exists"}' not in server_errors
        assert not [name for name in live if "_created" in name]

        await host.reply({"type": "session.close"})
        await host.close()
        after = await asyncio.to_thread(_metrics, running)
        while after["worldserve_sessions_registered"] > 0:  # the close is done on the server's side too
            await asyncio.sleep(0.05)
            after = await asyncio.to_thread(_metrics, running)
        assert _family(after, "worldserve_chunk_period_seconds") == {}  # no stale period once nobody is there
        settled = _family(after, "worldserve_events_settled_total")
        assert sum(settled.values()) == accepted  # the close settled the rest (applied or dropped)
    finally:
        running.stop()


async def test_a_chunks_times_are_the_servers_instants_in_the_documented_order(server: RunningServer) -> None:
    """Protocol (Key-to-photon timing): a chunk's `times` has one `accepted_ms` per applied event,
    in order, and accepted <= tick <= dispatched <= stepped <= encoded <= sent, on the server's
    CLOCK_MONOTONIC (this host's: the test's ``time.monotonic`` reads the same clock)."""
    wire = await Wire.open(server)
    await wire.start(seed=8)
    await wire.until("chunk", seq=0)
    applied: list[int] = []
    for event_id, held in ((1, ("W",)), (2, ("W", "D"))):  # one at a time: a queued key set replaces the last
        before = time.monotonic() * 1000.0
        assert (await wire.reply(keys_event(event_id, *held)))["type"] == "input.accepted"
        while event_id not in applied:
            chunk = await wire.until("chunk")
            times = chunk["times"]
            assert times["clock"] == "monotonic"
            assert len(times["accepted_ms"]) == len(chunk["applied_event_ids"])
            instants = [times[name] for name in ("tick_ms", "dispatched_ms", "stepped_ms", "encoded_ms", "sent_ms")]
            assert instants == sorted(instants), times
            for accepted in times["accepted_ms"]:
                assert before <= accepted <= times["tick_ms"], times
            applied += chunk["applied_event_ids"]
    assert applied == [1, 2]
    assert times["sent_ms"] <= time.monotonic() * 1000.0
    await wire.close()
