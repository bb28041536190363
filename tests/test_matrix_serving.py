"""``matrix-game-2`` served like every model (tiny config, random weights, CPU).

Batching across sessions through the runtime, residency by ``state_bytes``, rollback of a chunk through
the runner, and a real ``worldserve serve`` playing a session from a start image over WebSocket: keys and
mouse applied, a viewer sharing the world, a dropped connection resumed, a chunk cancelled mid-step, and
the journal replayed frame for frame.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models import SessionOptions, load_model  # noqa: E402
from worldserve.models.matrixgame.controls import keys_control, mouse_control  # noqa: E402
from worldserve.protocol import ControlInput, TickRequest  # noqa: E402
from worldserve.runtime import ModelRunner, Runtime  # noqa: E402
from worldserve.runtime.messages import ResidencyLimits, TickOutput  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def start_image(seed: int) -> np.ndarray:
    """A 80x48 start image: a sky over a ground, seeded."""
    rng = np.random.default_rng(seed)
    frame = np.zeros((48, 80, 3), dtype=np.uint8)
    frame[:24] = rng.integers(100, 255, 3)
    frame[24:] = rng.integers(0, 120, 3)
    return frame


async def test_sessions_batch_through_the_runtime_and_one_without_its_image_is_refused() -> None:
    from worldserve import SessionEvent

    async with Runtime("matrix-game-2", executor="inprocess", model_options={"threads": 1}, batch_wait_s=0.05) as rt:
        assert (rt.spec.frames_per_chunk, rt.spec.fps, rt.spec.requires_image) == (12, 25.0, True)
        with pytest.raises(ValueError, match="starts a world from a start image"):
            await rt.create_session(seed=1)
        sessions = [await rt.create_session(seed=s, image=start_image(s).tobytes()) for s in (1, 2, 3)]
        await sessions[0].accept_event(SessionEvent(1, controls=(keys_control("W", "A"), mouse_control(0.1, 0.0))))
        await sessions[2].accept_event(SessionEvent(1, controls=(keys_control("S"),)))

        async def play(session: object) -> list[object]:
            return [await session.next_chunk() for _ in range(3)]  # type: ignore[attr-defined]

        results = await asyncio.gather(*(play(s) for s in sessions))
        for chunks in results:
            assert [c.metadata.chunk_index for c in chunks] == [0, 1, 2]
            assert all(c.frames.shape == (12, 48, 80, 3) for c in chunks)
        assert results[0][0].metadata.applied_event_ids == (1,)
        held = {c.track: dict(c.data) for c in sessions[0].controls}  # the committed controls, held until changed
        assert held == {"keys": {"held": ("W", "A")}, "mouse": {"yaw": 0.1, "pitch": 0.0}}
        assert rt.stats().engine.batch_size.total > rt.stats().engine.batches  # batches held several sessions
        for session in sessions:
            await rt.close_session(session.session_id)


async def test_a_temple_run_session_refuses_the_mouse_at_acceptance() -> None:
    from worldserve import InvalidEventError, SessionEvent

    async with Runtime("matrix-game-2", executor="inprocess", model_options={"variant": "templerun"}) as rt:
        session = await rt.create_session(seed=4, image=start_image(4).tobytes())
        with pytest.raises(InvalidEventError, match="has no control track 'mouse'"):
            await session.accept_event(SessionEvent(1, controls=(mouse_control(0.1, 0.0),)))
        await session.accept_event(SessionEvent(2, controls=(keys_control("Z"),)))  # turn left: its own key
        chunk = await session.next_chunk()
        assert chunk.metadata.applied_event_ids == (2,)
        await rt.close_session(session.session_id)


def _tick(chunk: int, *controls: ControlInput) -> TickRequest:
    return TickRequest("s", f"s-{chunk}", chunk, (), None, tuple(sorted(controls, key=lambda c: c.track)))


def _step(runner: ModelRunner, tick: TickRequest) -> np.ndarray:
    (result,) = runner.step([tick]).results
    assert isinstance(result, TickOutput), result
    return result.frames


def test_the_runner_rolls_a_chunk_back_and_evicts_by_state_bytes() -> None:
    model = load_model("matrix-game-2", threads=1)
    options = SessionOptions(seed=7, image=start_image(7).tobytes())
    cancelled, straight = ModelRunner(model), ModelRunner(model)
    for runner in (cancelled, straight):
        runner.admit("s", options)
        _step(runner, _tick(0, keys_control("W")))
    _step(cancelled, _tick(1, keys_control("D"), mouse_control(0.5, 0.5)))  # the chunk that gets cancelled
    assert cancelled.rollback_ar_diffusion_session("s", 1) is True
    for chunk, controls in ((1, (keys_control("A"),)), (2, (mouse_control(-0.1, 0.0),))):
        assert np.array_equal(_step(cancelled, _tick(chunk, *controls)), _step(straight, _tick(chunk, *controls)))
    two = ModelRunner(model, ResidencyLimits(memory_budget_bytes=2 * model.spec.state_bytes + 1))
    assert two.capacity == 2
    for name in ("a", "b"):
        two.admit(name, options)
    assert two.admit("c", options) == ("a",)  # the least recently used goes
    assert two.resident_sessions() == ("b", "c")


async def test_a_real_server_plays_from_a_start_image_shares_resumes_and_replays(tmp_path: Path) -> None:
    from server_harness import start_server
    from worldserve.client import WorldClient, WorldError
    from worldserve.tools.replay import replay

    record = tmp_path / "journals"
    server = start_server(
        "--model", "matrix-game-2", "--threads-per-worker", "1", "--record-dir", str(record), timeout=180.0
    )
    try:
        async with WorldClient(server.ws) as refused:
            with pytest.raises(WorldError) as error:
                await refused.start(seed=1)
            assert error.value.code == "invalid_image"
        async with WorldClient(server.ws) as host, WorldClient(server.ws) as viewer:
            info = await host.start(seed=9, image=start_image(9), share_viewers=True)
            assert info.model["name"] == "matrix-game-2"
            assert {c["track"] for c in info.model["controls"]} == {"keys", "mouse"}
            assert info.viewer_token is not None
            await viewer.join(info.session_id, info.viewer_token)
            pressed = await host.send_event(controls=[keys_control("W"), mouse_control(0.2, -0.1)])
            got = [await host.next_chunk(timeout=60)]
            while pressed.event_id not in got[-1].applied_event_ids:
                assert len(got) < 6, "the event was not applied within 6 chunks"
                got.append(await host.next_chunk(timeout=60))
            seen = await viewer.next_chunk(timeout=60)
            assert seen.frames.shape == (12, 48, 80, 3)
            await host.drop()  # the connection is lost; the world is kept
            await host.resume()
            got += [await host.next_chunk(timeout=60) for _ in range(2)]
            cancelled, refusals = None, set()
            for _ in range(400):  # chunk.cancel while a chunk is being made (most of the time, on a CPU)
                try:
                    cancelled = await host.cancel_chunk()
                    break
                except WorldError as refused:
                    refusals.add(refused.code)
                    await asyncio.sleep(0.025)
            assert refusals <= {"nothing_to_cancel"}
            assert cancelled is not None
            assert cancelled >= len(got)
            while len(got) <= cancelled + 1:
                got.append(await host.next_chunk(timeout=60))
            assert [c.chunk_index for c in got] == list(range(len(got)))  # no index skipped or repeated
            await host.close()
        journal = next(record.glob("*.jsonl"))
        from worldserve.runtime.journal import read_journal

        applied = read_journal(journal).chunks[len(got) - 3]  # the chunk that applied the event, as journaled
        assert {c.track: dict(c.data) for c in applied.controls} == {
            "keys": {"held": ("W",)},
            "mouse": {"yaw": 0.2, "pitch": -0.1},
        }
        replayed = await replay(journal, executor="inprocess")
        assert replayed.same_model
        live = np.concatenate([c.frames for c in got])
        # Frame for frame, the chunks after the cancelled one included: the replay never made it.
        assert np.array_equal(replayed.frames[: len(live)], live)

        # worldserve bench steers an image-to-world model too: it reads /v1/models, sends a start image.
        from worldserve.tools.loadtest import run_bench

        bench = await run_bench(server.ws, clients=1, duration=2.0, event_interval=0.5, settle=60.0, media="jpeg")
        (report,) = bench.reports
        assert not report.errors, report.error_messages
        assert report.chunks > 0
        assert report.accepted > 0
        # Every event it pressed is applied once, or replaced in the queue by a newer key press before a chunk
        # took it (keys are a held, continuous track: a slow box makes chunks slower than the presses).
        assert report.applied_once > 0
        assert report.applied_once + report.superseded == report.accepted, report
        assert report.lost == report.applied_twice == 0
    finally:
        server.stop()


@pytest.mark.timeout(150)
def test_the_benchmark_smoke_runs_the_tiny_config() -> None:
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "bench/matrix_game.py",
            "--threads",
            "1",
            "--batches",
            "1",
            "2",
            "--blocks",
            "1",
            "--variants",
            "gta-drive",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"\| gta-drive \| 2 \| \d+ ms \| \d+ ms \| [\d.]+x \| [\d.]+ \| (yes|no) \|", done.stdout)
    assert "real time is a block (12 frames) in <= 480 ms" in done.stdout


def test_parts_of_a_first_block_open_with_the_held_start_frame_and_join_into_each_chunk() -> None:
    model, twin = load_model("matrix-game-2", threads=1), load_model("matrix-game-2", threads=1)
    assert model.spec.frame_parts
    options = SessionOptions(seed=7, image=start_image(7).tobytes())
    old, fresh = model.new_state("old", options), model.new_state("new", options)
    old_twin, fresh_twin = twin.new_state("old", options), twin.new_state("new", options)
    model.step([(old, TickRequest("old", "old-0", 0))])
    twin.step([(old_twin, TickRequest("old", "old-0", 0))])
    ticks = [TickRequest("old", "old-1", 1, controls=(keys_control("W"),)), TickRequest("new", "new-0", 0)]
    parts: list[tuple[int, np.ndarray]] = []
    got = model.step(list(zip((old, fresh), ticks, strict=True)), on_part=lambda r, f: parts.append((r, f)))
    expected = twin.step(list(zip((old_twin, fresh_twin), ticks, strict=True)))
    # A latent frame at a time, both rows together; the new session's first part is its start frame, held.
    assert [(row, len(frames)) for row, frames in parts] == [(0, 4), (1, 4)] * 3
    first = parts[1][1]
    assert all(np.array_equal(frame, first[0]) for frame in first)
    for row, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        joined = np.concatenate([frames for r, frames in parts if r == row])
        assert np.array_equal(joined, mine["payload"])
        assert np.array_equal(mine["payload"], theirs["payload"])
