"""``WorldHost`` without sockets (sans-I/O): members are plain outlets that record what was posted.

A fake tick consumer makes chunks at once; the spec's chunk period is tiny, so pacing
never waits long. The assertions are on what was posted, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel

from worldserve.media import EncodedFrames, FrameEncoding, encode, encode_frames
from worldserve.models.base import ModelSpec
from worldserve.protocol import ChunkMetadata, ControlInput, TickRequest
from worldserve.runtime.chunk import Chunk
from worldserve.runtime.metrics import Capacity
from worldserve.server.config import ServerConfig
from worldserve.server.host import Role, WorldHost, WorldHosts
from worldserve.server.messages import ChunkMessage, ChunkSkipped, InputDropped
from worldserve.server.metrics import ServerMetrics
from worldserve.session import Session, SessionEvent, SessionManager

SPEC = ModelSpec(
    name="fake", frames_per_chunk=1, fps=1000.0, height=2, width=2, controls=(), max_batch_size=1, state_bytes=1
)


class _Backend:
    """Tick consumer, lifecycle and world backend in one; records the session ids it was asked to apply."""

    spec = SPEC

    def __init__(self, frames: np.ndarray | EncodedFrames | None = None) -> None:
        self.applied: list[tuple[int, ...]] = []
        self.in_use: list[float] = []  # every mark_in_use, in order
        self.frames = np.zeros((1, 2, 2, 3), np.uint8) if frames is None else frames

    async def execute_tick(self, tick: TickRequest) -> Chunk:
        await asyncio.sleep(0)
        self.applied.append(tick.applied_event_ids)
        return Chunk(self.frames, ChunkMetadata.from_tick(tick), 0, 1, 0.0, 0.0, 0.0, encode_s=0.003)

    def chunk_metadata(self, output: Chunk) -> ChunkMetadata:
        return output.metadata

    async def reset_session(self, session_id: str) -> None:
        return None

    async def close_session(self, session_id: str) -> None:
        return None

    async def create_session(
        self, *, prompt: str | None, seed: int, image: bytes | None, encoding: FrameEncoding | None = None
    ) -> Session[Chunk]:
        raise AssertionError

    def mark_in_use(self, session_id: str, seconds: float) -> None:
        assert session_id == "s1"
        self.in_use.append(seconds)

    def capacity(self) -> Capacity:
        return Capacity(free=None, workers_alive=1)


class _Outlet:
    def __init__(self, backlog: int = 0) -> None:
        self.posted: list[BaseModel] = []
        self.detached = False
        self.unwritten = backlog
        self.binary: list[tuple[bytes, ...]] = []

    def post(self, messages: tuple[BaseModel, ...], binary: tuple[bytes, ...] = ()) -> None:
        self.posted.extend(messages)
        if binary:
            self.binary.append(binary)

    def detach(self) -> None:
        self.detached = True

    def unsent(self) -> list[tuple[BaseModel, ...]]:
        return []

    @property
    def backlog(self) -> int:
        return self.unwritten

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for m in self.posted if isinstance(m, kind)]


def _world(
    frames: np.ndarray | EncodedFrames | None = None, media: str = "raw", quality: int = 90, **config: Any
) -> tuple[WorldHost, _Backend]:
    backend = _Backend(frames)
    session: Session[Chunk] = Session("s1", tick_consumer=backend, lifecycle=backend, max_pending_events=8)
    metrics = ServerMetrics(SessionManager(tick_consumer=backend, lifecycle=backend, max_pending_events=8))
    host = WorldHost(
        session,
        backend=backend,
        config=ServerConfig(**config),
        metrics=metrics,
        registry=WorldHosts(),
        media=media,
        quality=quality,
        share_viewers=True,
        share_controllers=True,
    )
    return host, backend


def _keys(event_id: int) -> SessionEvent:
    return SessionEvent(event_id, controls=(ControlInput("keys", "worldserve.keys.v1", {"held": ["W"]}),))


async def _chunks(outlet: _Outlet, count: int) -> list[ChunkMessage]:
    async with asyncio.timeout(5):
        while len(outlet.of(ChunkMessage)) < count:  # noqa: ASYNC110 - the outlet is a plain recorder
            await asyncio.sleep(0.001)
    return outlet.of(ChunkMessage)


async def test_controllers_wire_ids_map_to_one_session_sequence_and_back() -> None:
    host, backend = _world()
    a, b = _Outlet(), _Outlet()
    first = host.attach_host(a)
    assert host.controller_token is not None
    second = host.join(host.controller_token, Role.CONTROLLER, b)
    assert second is not None
    # Same wire ids on both connections: distinct session ids, each answered with its own.
    for wire in (1, 2):
        assert (await host.accept(first, _keys(wire))).event_id == wire
        assert (await host.accept(second, _keys(wire))).event_id == wire
    assert host.session.pending_event_ids == (0, 1, 2, 3)  # arrival order: a1, b1, a2, b2
    host.start()
    for member, outlet in ((first, a), (second, b)):
        chunk = (await _chunks(outlet, 1))[0]
        assert chunk.applied_event_ids == [1, 2]
        host.ack(member, chunk.seq)
    assert backend.applied[0] == (0, 1, 2, 3)
    # A reset drops each member's own pending events, reported in its own ids.
    await host.accept(second, _keys(7))
    await host.reset()
    assert [d.event_ids for d in b.of(InputDropped)] == [[7]]
    assert a.of(InputDropped) == []
    await host.shutdown("test")


async def test_a_parked_host_resumes_with_the_chunks_it_missed() -> None:
    host, _ = _world(max_lag_chunks=2, replay_chunks=3)
    a, c = _Outlet(), _Outlet()
    owner = host.attach_host(a)
    assert host.controller_token is not None
    controller = host.join(host.controller_token, Role.CONTROLLER, c)
    assert controller is not None
    host.start()
    received = await _chunks(a, 1)
    await host.accept(owner, _keys(1))  # accepted before the drop: applied while parked
    await host.disconnected(owner, a, clean=False)  # parked: the controller keeps the world going
    assert owner.expiry is not None
    for seq in range(12):
        await _chunks(c, seq + 1)
        host.ack(controller, seq)
    again = _Outlet()
    last = host.resume(owner, received[-1].seq, again)
    assert owner.expiry is None
    host.replay(owner, last)
    skipped = again.of(ChunkSkipped)
    replayed = again.of(ChunkMessage)
    assert len(replayed) == 3  # the replay buffer
    assert skipped[0].from_seq == last + 1
    assert skipped[0].to_seq + 1 == replayed[0].seq
    assert [m.seq for m in replayed] == list(range(replayed[0].seq, replayed[0].seq + 3))
    # The event was applied in a chunk past the buffer: the skip notice says so.
    assert skipped[0].applied_event_ids == [1]
    assert all(m.applied_event_ids == [] for m in replayed)
    await host.shutdown("test")


async def test_a_world_is_in_use_while_a_connected_member_plays_and_not_once_all_are_parked() -> None:
    host, backend = _world(evict_idle_s=7.0)
    a, c = _Outlet(), _Outlet()
    owner = host.attach_host(a)
    assert backend.in_use == [7.0]  # arrived
    host.start()
    await _chunks(a, 1)
    host.ack(owner, 0)
    await host.accept(owner, _keys(1))
    assert backend.in_use == [7.0, 7.0, 7.0]  # each ack and event extends the mark
    assert host.controller_token is not None
    controller = host.join(host.controller_token, Role.CONTROLLER, c)
    assert controller is not None
    await host.disconnected(owner, a, clean=False)  # parked, but the controller still plays
    assert backend.in_use[-1] == 7.0
    await host.disconnected(controller, c, clean=False)  # nobody connected: evictable now
    assert backend.in_use[-1] == 0.0
    host.resume(owner, 0, _Outlet())
    assert backend.in_use[-1] == 7.0  # back in use on resume
    marks = len(backend.in_use)
    await host.shutdown("test")
    host.remove(controller)
    assert len(backend.in_use) == marks  # a closed world marks nothing


async def test_a_shutdown_while_a_close_releases_the_world_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """session.stop (or close) and the server's stop can meet: the second release finds the session
    gone (SessionStateError) and says nothing; the world still ends for its members.

    A tick is held in flight when the stop comes (the pacing loop may be anywhere in its cycle; the
    test pins the case with the most releases): the stop cancels it, and the session releases the
    worker's state for the cancelled tick too (a third release, which finds it gone as well)."""
    from worldserve.session import SessionStateError

    host, backend = _world()
    outlet = _Outlet()
    owner = host.attach_host(outlet)
    host.start()
    await _chunks(outlet, 1)
    releasing = asyncio.Event()
    calls: list[str] = []
    ticking = asyncio.Event()
    execute_tick = backend.execute_tick

    async def held_tick(tick: TickRequest) -> Chunk:
        ticking.set()
        await asyncio.Event().wait()  # never done: only the stop's cancel ends it
        return await execute_tick(tick)

    backend.execute_tick = held_tick  # type: ignore[method-assign]
    async with asyncio.timeout(5):
        await ticking.wait()

    async def close_session(session_id: str) -> None:
        calls.append(session_id)
        if len(calls) == 1:
            await releasing.wait()  # the first release is still in flight ...
        else:
            raise SessionStateError(f"session {session_id!r} does not exist.")  # ... when the second comes

    backend.close_session = close_session  # type: ignore[method-assign]
    closing = asyncio.ensure_future(host.close("closed", requester=owner, message_id="m1"))
    await asyncio.sleep(0)
    await host.shutdown("shutdown")
    releasing.set()
    await closing
    assert calls == ["s1", "s1", "s1"]  # close's, the cancelled tick's, the stop's
    assert not [record for record in caplog.records if record.levelname == "ERROR"]
    assert host.closed


async def test_a_member_that_acks_without_reading_is_held_by_what_is_unwritten() -> None:
    host, _ = _world(max_lag_chunks=2)
    a, v = _Outlet(), _Outlet(backlog=2)
    owner = host.attach_host(a)
    assert host.viewer_token is not None
    viewer = host.join(host.viewer_token, Role.VIEWER, v)
    assert viewer is not None
    host.start()
    for seq in range(4):
        await _chunks(a, seq + 1)
        host.ack(owner, seq)
        host.ack(viewer, seq)  # acks everything, yet its socket has 2 chunks unwritten
    assert v.of(ChunkMessage) == []  # so it skips, however it acks
    a.unwritten = 2  # the host's own socket backs up the same way: generation stops
    made = host.seq
    host.ack(owner, made)
    for _ in range(100):  # at most the tick in flight still commits; then nothing moves
        before = host.seq
        await asyncio.sleep(0.05)
        if host.seq == before:
            break
    assert host.seq <= made + 1
    made = host.seq
    a.unwritten = 0
    host.wake()  # the connection's writer does this as its socket drains
    await _chunks(a, made + 2)
    await host.shutdown("test")


async def test_notices_never_written_before_a_drop_reach_the_resumed_connection() -> None:
    host, _ = _world(max_lag_chunks=2)
    lost = InputDropped(event_ids=[7], reason="reset", detail="posted just before the socket died")
    a = _Outlet()
    a.unsent = lambda: [(lost,)]  # type: ignore[method-assign]
    owner = host.attach_host(a)
    host.start()
    received = await _chunks(a, 1)
    await host.disconnected(owner, a, clean=False)  # parked, with the connection's unwritten notice
    again = _Outlet()
    host.replay(owner, host.resume(owner, received[-1].seq, again))
    assert again.of(InputDropped) == [lost]
    await host.shutdown("test")


class _StuckSocket:
    """A WebSocket whose second send never completes (the peer vanished mid-write)."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.stuck = asyncio.Event()

    async def send_text(self, text: str) -> None:
        if self.sent:
            self.stuck.set()
            await asyncio.Event().wait()
        self.sent.append(text)

    async def send_bytes(self, data: bytes) -> None:
        raise AssertionError("the writer never gets past the stuck notice")


async def test_a_connection_hands_back_the_notices_its_dead_socket_never_took() -> None:
    from worldserve.server.connection import Connection

    _, backend = _world()
    metrics = ServerMetrics(SessionManager(tick_consumer=backend, lifecycle=backend, max_pending_events=8))
    socket = _StuckSocket()
    connection = Connection(socket, backend, ServerConfig(), metrics)  # type: ignore[arg-type]
    first, second, third = (InputDropped(event_ids=[i], reason="reset", detail="x") for i in range(3))
    connection.post((first, second))  # `first` is written, `second` hangs in the socket
    connection.post((ChunkMessage.model_construct(),), (b"frame",))  # a chunk: the replay buffer re-sends it
    connection.post((third,))
    writer = asyncio.create_task(connection._write())
    connection._writer = writer
    async with asyncio.timeout(5):
        await socket.stuck.wait()
    assert connection.unsent() == [(second,), (third,)]
    assert len(socket.sent) == 1
    with contextlib.suppress(asyncio.CancelledError):
        await writer
    assert writer.cancelled()


FRAME = np.arange(12, dtype=np.uint8).reshape(1, 2, 2, 3) * 20


async def test_frames_a_worker_encoded_as_the_world_asked_are_sent_as_they_are() -> None:
    # Payloads that are not what encoding FRAME would make: sent as they are proves no re-encoding.
    worker_made = EncodedFrames(FrameEncoding("jpeg", 70), 2, 2, (b"made-by-the-worker",))
    host, _ = _world(worker_made, media="jpeg", quality=70)
    a = _Outlet()
    host.attach_host(a)
    host.start()
    chunk = (await _chunks(a, 1))[0]
    assert a.binary[0] == (b"made-by-the-worker",)
    assert (chunk.frames.media, chunk.frames.width, chunk.frames.height, chunk.frames.sizes) == ("jpeg", 2, 2, [18])
    assert chunk.timings["encode_ms"] == pytest.approx(3.0)  # the worker's time, as the chunk reported it
    await host.shutdown("test")


async def test_frames_in_another_encoding_or_raw_arrays_are_encoded_by_the_host() -> None:
    for frames in (FRAME, encode(FRAME, FrameEncoding("raw")), encode(FRAME, FrameEncoding("jpeg", 95))):
        host, _ = _world(frames, media="jpeg", quality=60)
        a = _Outlet()
        host.attach_host(a)
        host.start()
        chunk = (await _chunks(a, 1))[0]
        if not isinstance(frames, EncodedFrames) or frames.encoding.media == "raw":
            assert list(a.binary[0]) == encode_frames(FRAME, "jpeg", 60)  # exactly the server's encoding
        else:
            assert a.binary[0][0].startswith(b"\xff\xd8")  # re-encoded from the decoded JPEG
            assert a.binary[0] != frames.payloads
        assert chunk.frames.media == "jpeg"
        assert chunk.timings["encode_ms"] >= 0.0
        await host.shutdown("test")
