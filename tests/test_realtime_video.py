"""``WS /v1/realtime/video`` driven by a client written from vllm-omni's published protocol document
(docs/serving/streaming_video_output_api.md and the example's README of vllm-omni), not from
worldserve's code: it knows only the documented messages and fields, concatenates the binary
frames in receive order and decodes them with PyAV.

Frames are compared with the procedural world by PSNR (H.264 in yuv420p: the bound of
``test_h264``); what camera interactions do is checked on the decoded frames (the view moves
the way the Unity axes say); each error case gets its documented reply. Nothing is timed.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import numpy.typing as npt
import pytest
import websockets

from runtime_models import Gate
from server_harness import RunningServer, start_server
from test_h264 import H264_PSNR_DB, UNRELATED_PSNR_DB, psnr
from worldserve.client import WorldClient
from worldserve.models.world import World

pytestmark = pytest.mark.timeout(120)

SEED = 7
SIZE = 48
FRAMES_PER_CHUNK = 4


class VideoStreamClient:
    """A vllm-omni realtime video client: JSON control events, one binary fMP4 frame after each metadata."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws: Any = None
        self.media = bytearray()  # every binary frame, concatenated in receive order
        self.metadata: list[dict[str, Any]] = []
        self.other: list[dict[str, Any]] = []  # queued, pong, error, done ...

    async def __aenter__(self) -> VideoStreamClient:
        self.ws = await websockets.connect(self.url, max_size=None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()

    async def send(self, message: dict[str, Any] | str) -> None:
        await self.ws.send(message if isinstance(message, str) else json.dumps(message))

    async def start(self, **fields: Any) -> dict[str, Any]:
        await self.send({"type": "session.start", "format": "m4s", **fields})
        reply = await self.next_event()
        assert reply["type"] == "video.start", reply
        return reply

    async def next_event(self) -> dict[str, Any]:
        """The next JSON event; a chunk's binary frame is read right after its metadata."""
        message = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
        if message["type"] == "video.chunk_metadata":
            payload = await asyncio.wait_for(self.ws.recv(), 60)
            assert isinstance(payload, bytes), "metadata must be followed by one binary frame"
            assert len(payload) == message["byte_length"]
            self.media += payload
            self.metadata.append(message)
        else:
            self.other.append(message)
        return dict(message)

    async def until(self, kind: str, **fields: Any) -> dict[str, Any]:
        while True:
            event = await self.next_event()
            if event["type"] == kind and all(event.get(k) == v for k, v in fields.items()):
                return event

    async def interact(self, event: dict[str, Any], event_id: str | None = None, **more: Any) -> None:
        interaction: dict[str, Any] = {"event": event, **more}
        if event_id is not None:
            interaction["event_id"] = event_id
        await self.send({"type": "session.interaction", "interaction": interaction})

    def frames(self) -> npt.NDArray[np.uint8]:
        with av.open(io.BytesIO(bytes(self.media)), format="mp4") as container:
            return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])

    def chunk(self, index: int) -> dict[str, Any]:
        return next(m for m in self.metadata if m["generation_chunk_index"] == index)


def camera(mode: str, translation: list[float], rotation: list[float] | None = None) -> dict[str, Any]:
    data = {"translation": translation, "rotation": rotation or [0.0, 0.0, 0.0, 1.0]}
    return {"multi_modal_data": {"camera": {"mode": mode, "data": data}}}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural", "--workers", "1")
    yield running
    running.stop()


def url(server: RunningServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime/video"


async def test_a_bounded_session_streams_the_models_frames_then_a_trailer_and_done(server: RunningServer) -> None:
    async with VideoStreamClient(url(server)) as client:
        start = await client.start(model="procedural", prompt="tropical islands", width=48, height=48, fps=16,
                                   num_frames=14, seed=SEED)  # fmt: skip
        assert start["format"] == "m4s"
        assert start["request_id"].startswith("video_stream-")
        assert start["config"]["num_frames"] == 14
        done = await client.until("session.done")
    assert done == {"type": "session.done", "request_id": start["request_id"], "chunks": 5, "stopped": False}
    kinds = [m["kind"] for m in client.metadata]
    assert kinds == ["media"] * 4 + ["trailer"]  # 14 frames: rounded up to whole chunks of 4
    assert [m["transport_chunk_index"] for m in client.metadata] == [0, 1, 2, 3, 4]
    assert [m["generation_chunk_index"] for m in client.metadata] == [0, 1, 2, 3, None]
    assert [m["num_frames"] for m in client.metadata] == [4, 4, 4, 4, 0]
    assert all(m["request_id"] == start["request_id"] for m in client.metadata)
    frames = client.frames()
    assert frames.shape == (16, SIZE, SIZE, 3)
    still = World(SEED).render(0, 0, SIZE, SIZE, "islands")
    for frame in frames:
        assert psnr(frame, still) >= H264_PSNR_DB
        assert psnr(frame, World(SEED + 1).render(0, 0, SIZE, SIZE, "islands")) <= UNRELATED_PSNR_DB


async def test_interactions_move_the_world_as_the_axes_say_and_report_their_event_ids(server: RunningServer) -> None:
    async with VideoStreamClient(url(server)) as client:
        start = await client.start(prompt="islands", seed=SEED)  # no num_frames: until session.stop
        request_id = start["request_id"]
        await client.until("video.chunk_metadata", generation_chunk_index=1)
        await client.interact(camera("velocity", [0.05, 0.0, 0.0]), "right")  # +X: the view pans right
        queued = await client.until("session.interaction.queued")
        assert queued == {"type": "session.interaction.queued", "request_id": request_id, "event_id": "right"}
        right = (await client.until("video.chunk_metadata", started_event_ids=["right"]))["generation_chunk_index"]
        await client.until("video.chunk_metadata", generation_chunk_index=right + 2)
        await client.interact({"prompt": "a snowy tundra"}, "snow")  # procedural: an immediate switch
        await client.until("session.interaction.queued", event_id="snow")
        snow = (await client.until("video.chunk_metadata", started_event_ids=["snow"]))["generation_chunk_index"]
        await client.interact(camera("velocity", [0.0, 0.0, 0.05]), "forward")  # +Z: forward, up the screen
        await client.until("session.interaction.queued", event_id="forward")
        forward = await client.until("video.chunk_metadata", started_event_ids=["forward"])
        turn = forward["generation_chunk_index"]
        await client.until("video.chunk_metadata", generation_chunk_index=turn + 1)
        await client.send({"type": "session.stop"})
        done = await client.until("session.done")
    assert done["stopped"] is True
    assert done["chunks"] == len(client.metadata)
    assert all(m["kind"] == "media" for m in client.metadata)  # no trailer on a stop
    # The lists, per chunk, as vllm-omni's handlers report them.
    assert client.chunk(right)["active_event_ids"] == ["right"]
    assert client.chunk(right)["completed_event_ids"] == []
    for index in range(right + 1, turn):
        assert client.chunk(index)["active_event_ids"][-1] == "right"
        assert "right" not in client.chunk(index)["started_event_ids"]
    assert client.chunk(snow)["started_event_ids"] == ["snow"]
    assert client.chunk(snow)["completed_event_ids"] == ["snow"]  # a transition of 0 chunks
    assert client.chunk(snow)["active_event_ids"] == ["snow", "right"]
    assert client.chunk(turn)["started_event_ids"] == ["forward"]
    assert client.chunk(turn)["completed_event_ids"] == ["right"]  # replaced by a newer camera event
    assert client.chunk(turn)["active_event_ids"] == ["forward"]
    # The frames: still before "right", then 2 px a frame to the right, then 2 px a frame up.
    frames = client.frames()
    world = World(SEED)
    x = y = 0
    for index in range(turn + 2):
        for frame in frames[index * FRAMES_PER_CHUNK : (index + 1) * FRAMES_PER_CHUNK]:
            if right <= index < turn:
                x += 2
            elif index >= turn:
                y -= 2
            style = "snow" if index >= snow else "islands"
            assert psnr(frame, world.render(x, y, SIZE, SIZE, style)) >= H264_PSNR_DB, (index, x, y)
    assert x > 0
    assert y < 0


async def test_a_camera_target_is_reached_over_its_transition_and_completes(server: RunningServer) -> None:
    async with VideoStreamClient(url(server)) as client:
        await client.start(prompt="islands", seed=SEED)
        await client.until("video.chunk_metadata", generation_chunk_index=0)
        await client.interact(camera("target", [0.2, 0.0, 0.0]), "there", transition_chunks=2)  # 8 px right
        await client.until("session.interaction.queued", event_id="there")
        first = (await client.until("video.chunk_metadata", started_event_ids=["there"]))["generation_chunk_index"]
        second = await client.until("video.chunk_metadata", generation_chunk_index=first + 1)
        after = await client.until("video.chunk_metadata", generation_chunk_index=first + 2)
        await client.send({"type": "session.stop"})
        await client.until("session.done")
    assert client.chunk(first)["active_event_ids"] == ["there"]
    assert second["completed_event_ids"] == ["there"]
    assert second["active_event_ids"] == []
    assert after["active_event_ids"] == after["completed_event_ids"] == []
    frames = client.frames()
    world = World(SEED)
    moving = frames[first * FRAMES_PER_CHUNK : (first + 2) * FRAMES_PER_CHUNK]
    for step, frame in enumerate(moving, start=1):  # 1 px a frame for 8 frames
        assert psnr(frame, world.render(step, 0, SIZE, SIZE, "islands")) >= H264_PSNR_DB
    for frame in frames[(first + 2) * FRAMES_PER_CHUNK :]:  # then it stays there
        assert psnr(frame, world.render(8, 0, SIZE, SIZE, "islands")) >= H264_PSNR_DB


@pytest.mark.parametrize(
    ("start", "error"),
    [
        ("{not json", "Invalid JSON"),
        ('["session.start"]', "JSON object"),
        ({"type": "session.interaction"}, "Expected session.start"),
        ({"type": "session.start", "prompt": "x", "format": "mp4"}, "format"),
        ({"type": "session.start"}, "prompt"),
        ({"type": "session.start", "prompt": "x", "model": "other-model"}, "Model mismatch"),
        ({"type": "session.start", "prompt": "x", "width": 832, "height": 480}, "48x48"),
        ({"type": "session.start", "prompt": "x", "image_reference": {"image_url": "https://example.com/a.png"}},
         "data:"),
        ({"type": "session.start", "prompt": "x", "image_reference": [{"image_url": "data:,"}]}, "single"),
        ({"type": "session.start", "prompt": "x", "extra_params": {"bitrate_kbps": 1}}, "bitrate_kbps"),
    ],
)  # fmt: skip
async def test_a_bad_start_gets_an_error_without_a_code_and_the_socket_closes(
    server: RunningServer, start: dict[str, Any] | str, error: str
) -> None:
    async with websockets.connect(url(server)) as ws:
        await ws.send(start if isinstance(start, str) else json.dumps(start))
        reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert reply["type"] == "error"
        assert error in reply["message"]
        assert "code" not in reply
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 30)


async def test_a_start_over_4_mib_is_refused(server: RunningServer) -> None:
    async with websockets.connect(url(server), max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "prompt": "x", "pad": "y" * (4 * 1024 * 1024)}))
        reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert reply == {"type": "error", "message": "session.start message too large"}


async def test_each_bad_message_or_interaction_gets_its_documented_reply(server: RunningServer) -> None:
    async with VideoStreamClient(url(server)) as client:
        start = await client.start(prompt="islands", seed=1)
        request_id = start["request_id"]

        async def reply_to(message: dict[str, Any] | str) -> dict[str, Any]:
            await client.send(message)
            while True:
                event = await client.next_event()
                if event["type"] != "video.chunk_metadata":
                    return event

        assert await reply_to({"type": "session.ping"}) == {"type": "session.pong"}
        for message, text in [
            ("{nope", "Invalid JSON"),
            ("[1, 2]", "JSON objects"),
            ({"type": "session.bogus"}, "Unknown message type"),
            ({"type": "session.interaction", "pad": "x" * (128 * 1024)}, "too large"),
            ({"type": "session.interaction"}, "interaction object"),
            ({"type": "session.interaction", "interaction": {"event_id": "", "event": {"prompt": "a"}}}, "event_id"),
            ({"type": "session.interaction", "interaction": {"event_id": "e"}}, "event object"),
            ({"type": "session.interaction", "interaction": {"event": {"prompt": "  "}}}, "non-empty"),
            ({"type": "session.interaction", "interaction": {"event": {"prompt": "a"}, "transition_chunks": -1}},
             ">= 0"),
            ({"type": "session.interaction", "interaction": {"event": {"prompt": "a"}, "transition_chunks": 1.5}},
             "integer"),
            ({"type": "session.interaction", "interaction": {"event": {"prompt": "a", "negative_prompt": "b"}}},
             "negative_prompt"),
        ]:  # fmt: skip
            reply = await reply_to(message)
            assert reply["type"] == "error", (message, reply)
            assert text in reply["message"], (message, reply)
            assert "code" not in reply, (message, reply)
        # What the model cannot take: interaction_failed, naming the request and the event.
        for event_id, event, more in [
            ("yaw", camera("velocity", [0.0, 0.0, 0.0], [0.0, 0.0523, 0.0, 0.9986]), {}),
            ("climb", camera("velocity", [0.0, 0.05, 0.0]), {}),
            ("fast", camera("velocity", [0.5, 0.0, 0.0]), {}),
            ("jump", camera("target", [0.1, 0.0, 0.0]), {"transition_chunks": 0}),
            ("keys", {"multi_modal_data": {"camera": {"mode": "velocity", "data": {"actions": ["w"]}}}}, {}),
            ("audio", {"multi_modal_data": {"audio": {"data": 1}}}, {}),
        ]:
            await client.interact(event, event_id, **more)
            reply = await client.until("error", event_id=event_id)
            assert reply["code"] == "interaction_failed", reply
            assert reply["request_id"] == request_id
        # A target the view cannot reach in time is refused at the chunk boundary, after queued.
        await client.interact(camera("target", [5.0, 0.0, 0.0]), "far")
        await client.until("session.interaction.queued", event_id="far")
        assert (await client.until("error", event_id="far"))["code"] == "interaction_failed"
        # A failed event id may be used again; an accepted one may not.
        await client.interact(camera("velocity", [0.05, 0.0, 0.0]), "yaw")
        await client.until("session.interaction.queued", event_id="yaw")
        await client.interact({"prompt": "desert"}, "yaw")
        conflict = await client.until("error", event_id="yaw")
        assert conflict["code"] == "event_id_conflict"
        assert conflict["request_id"] == request_id
        # Without an event_id the server makes one.
        await client.interact({"prompt": "forest"})
        made = await client.until("session.interaction.queued")
        assert re.fullmatch(r"[0-9a-f]{32}", made["event_id"])
        while made["event_id"] not in (await client.until("video.chunk_metadata"))["started_event_ids"]:
            pass
        await client.send({"type": "session.stop"})
        assert (await client.until("session.done"))["stopped"] is True


def _metric(server: RunningServer, name: str) -> float:
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{name} ([\d.e+]+)$", text, re.M)
    assert match is not None, name
    return float(match.group(1))


async def test_sessions_of_both_routes_batch_together_on_one_worker(server: RunningServer) -> None:
    async with (
        VideoStreamClient(url(server)) as first,
        VideoStreamClient(url(server)) as second,
        WorldClient(server.ws) as third,
        WorldClient(server.ws) as fourth,
    ):
        await first.start(prompt="islands", seed=1)
        await second.start(prompt="desert", seed=2)
        await third.start(seed=3)
        await fourth.start(seed=4)

        async def pump(client: VideoStreamClient) -> None:
            while True:
                await client.next_event()

        pumps = [asyncio.create_task(pump(c)) for c in (first, second)]
        try:
            sizes = []
            for _ in range(40):  # the world clients see every step's batch size
                sizes.append((await third.next_chunk(timeout=30)).batch_size)
                await fourth.next_chunk(timeout=30)
                if sizes[-1] == 4:
                    break
            assert 4 in sizes, sizes  # all four sessions in one model step
        finally:
            for task in pumps:
                task.cancel()
        await third.close()
        await fourth.close()
    assert _metric(server, "worldserve_realtime_video_sessions_started_total") >= 2


# -- timeouts, on a server with short ones and a model whose step a test can hold --------------


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Gate]]:
    gate = Gate(Path(tmp_path_factory.mktemp("gate")) / "gate")
    running = start_server(
        "--model", "runtime_models:FaultyModel", "--model-option", f"gate={gate.path}", "--workers", "1",
        "--realtime-start-timeout-s", "0.5", "--realtime-stall-timeout-s", "1", test_models=True,
    )  # fmt: skip
    yield running, gate
    gate.open()
    running.stop()


async def test_no_start_in_time_gets_an_error_and_the_socket_closes(held: tuple[RunningServer, Gate]) -> None:
    server, _ = held
    async with websockets.connect(url(server)) as ws:
        reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert reply == {"type": "error", "message": "Timeout waiting for session.start"}
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 30)


async def test_a_stalled_session_gets_an_error_then_done_stopped(held: tuple[RunningServer, Gate]) -> None:
    server, gate = held
    async with VideoStreamClient(url(server)) as client:
        await client.start(prompt="gate: the model's step waits for the test", seed=1)
        await gate.wait_entered()  # the first step is held: no progress, and no ping
        stall = await client.until("error")
        assert "Stall timeout" in stall["message"]
        done = await client.until("session.done")
        assert done["stopped"] is True
        assert done["chunks"] == 0
    gate.open()


# -- a model that declares the prompt_transition track ---------------------------------------------


@pytest.mark.timeout(240)
async def test_a_prompt_transition_on_wan_causal_runs_over_its_chunks_as_vllm_omni_lists_it() -> None:
    """wan-causal declares ``prompt_transition``: a prompt interaction with ``transition_chunks: 3`` is
    queued, taken by the model (no ``interaction_failed`` at its boundary) and listed active over
    three chunks, completed in the third (the blend's weights, chunk by chunk, are checked against
    the model in ``test_realtime_plan``); one longer than the model's track allows is refused when
    it is queued."""
    running = start_server(
        "--model", "wan-causal", "--model-option", "config=tiny", "--model-option", "load=dummy",
        "--threads-per-worker", "1", "--workers", "1", timeout=150.0,
    )  # fmt: skip
    try:
        async with VideoStreamClient(url(running)) as client:
            start = await client.start(prompt="islands", seed=3)
            request_id = start["request_id"]
            assert start["config"]["frames_per_chunk"] == 12
            await client.until("video.chunk_metadata", generation_chunk_index=0)
            await client.interact({"prompt": "snow"}, "too-long", transition_chunks=66)  # the track allows 64 blocks
            refused = await client.until("error")
            assert refused["code"] == "interaction_failed"
            assert refused["event_id"] == "too-long"
            await client.interact({"prompt": "desert dunes"}, "dunes", transition_chunks=3)
            assert await client.until("session.interaction.queued", event_id="dunes") == {
                "type": "session.interaction.queued", "request_id": request_id, "event_id": "dunes"
            }  # fmt: skip
            first = (await client.until("video.chunk_metadata", started_event_ids=["dunes"]))["generation_chunk_index"]
            await client.until("video.chunk_metadata", generation_chunk_index=first + 3)
            await client.send({"type": "session.stop"})
            done = await client.until("session.done")
        assert done["stopped"] is True
        assert [e for e in client.other if e["type"] == "error"] == [refused]  # nothing failed at a boundary
        assert [client.chunk(first + k)["active_event_ids"] for k in range(4)] == [["dunes"]] * 3 + [[]]
        assert [client.chunk(first + k)["completed_event_ids"] for k in range(4)] == [[], [], ["dunes"], []]
        frames = client.frames()
        assert frames.shape == (12 * len(client.metadata), 64, 64, 3)
    finally:
        running.stop()
    assert "Traceback" not in running.log()
