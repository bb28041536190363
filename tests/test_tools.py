"""``worldserve bench`` and ``worldserve record`` against a real server (small smoke runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from server_harness import RunningServer, start_server
from worldserve.tools.loadtest import TABLE_NOTES, check_server, format_table, run_bench
from worldserve.tools.record import load_script, record


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


async def test_bench_accounts_for_every_event(server: RunningServer) -> None:
    result = await run_bench(server.ws, clients=3, duration=1.5, event_interval=0.1, settle=3.0)
    table = format_table(result)
    assert "accepted->applied" in table
    for note in TABLE_NOTES:  # the "of it" and "bound" rows, and both frame rates, are explained under the table
        assert note in table
    for report in result.reports:
        played = report.played_fps
        assert played is not None
        # what a player at the model's 16 fps plays: never more than 16, less only by the stalls
        assert 0 < played <= 16.0 + 1e-9
        _, stall = report.late
        assert played == pytest.approx(report.frames / (report.chunks * 0.25 + stall))
        assert not report.errors, report.errors
        assert report.accepted > 0
        assert report.lost == 0
        assert report.applied_twice == 0
        assert report.applied_once + report.dropped == report.accepted
        assert report.ttfc is not None


def test_record_writes_gif_mp4_and_sidecar(server: RunningServer, tmp_path: Path) -> None:
    script = {
        "prompt": "islands",
        "seed": 5,
        "chunks": 6,
        "events": [
            {
                "after_chunk": 1,
                "controls": [{"track": "keys", "schema": "worldserve.keys.v1", "data": {"held": ["D"]}}],
            },
            {"after_chunk": 3, "prompt": "snowy peaks"},
        ],
    }
    script_path = tmp_path / "script.json"
    script_path.write_text(json.dumps(script))
    for suffix in (".gif", ".mp4"):
        out = tmp_path / f"world{suffix}"
        done = subprocess.run(
            [sys.executable, "-m", "worldserve", "record", str(script_path), "--url", server.ws, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert out.stat().st_size > 1000
        sidecar = json.loads(out.with_suffix(".json").read_text())
        assert len(sidecar["chunks"]) == 6
        assert [event["status"] for event in sidecar["events"]] == ["accepted", "accepted"]
        for event in sidecar["events"]:
            assert event["applied_in_chunk"] is not None
            # after the chunks it was sent after; or in the last of them, made again with it (a preemption)
            assert event["applied_in_chunk"] >= event["sent_after_chunks"] - _preempted(sidecar, event)
    with Image.open(tmp_path / "world.gif") as gif:
        assert gif.size == (48 * 4, 48 * 4)
        # Pillow merges identical consecutive frames, adding their durations; GIF keeps
        # centiseconds, so the 24 frames at 16 fps last 1.5 s give or take rounding.
        total = 0
        for index in range(gif.n_frames):
            gif.seek(index)
            total += gif.info["duration"]
        assert abs(total - 1500) <= 100, total


def test_record_exits_1_when_the_server_refused_an_event(server: RunningServer, tmp_path: Path) -> None:
    script = {
        "chunks": 3,
        "events": [
            {
                "after_chunk": 0,
                "controls": [{"track": "keys", "schema": "worldserve.keys.v1", "data": {"held": ["Q"]}}],
            },
            {"after_chunk": 0, "prompt": "snow"},
        ],
    }
    script_path = tmp_path / "script.json"
    script_path.write_text(json.dumps(script))
    out = tmp_path / "refused.gif"
    done = subprocess.run(
        [sys.executable, "-m", "worldserve", "record", str(script_path), "--url", server.ws, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    said = done.stderr.splitlines()
    assert len(said) == 1, done.stderr
    assert "refused 1 of 2 events (first: script event 0, invalid_control" in said[0]
    assert out.exists()  # what was recorded is still written, the sidecar with the refusal
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert [event["status"] for event in sidecar["events"]] == ["error", "accepted"]


async def test_an_event_after_chunk_k_is_sent_once_chunk_k_has_arrived(server: RunningServer, tmp_path: Path) -> None:
    """docs/protocol.md (Tools): ``after_chunk: k`` is sent once chunk k -- the (k+1)-th chunk -- has arrived,
    so the chunk that applies it comes after chunk k on the wire."""
    script_path = tmp_path / "script.json"
    script_path.write_text(
        json.dumps({"chunks": 6, "events": [{"after_chunk": k, "prompt": f"p{k}"} for k in (-1, 0, 2)]})
    )
    recording = await record(server.ws, load_script(script_path))
    events = recording.sidecar["events"]
    assert [event["sent_after_chunks"] for event in events] == [0, 1, 3]
    for event, k in zip(events, (-1, 0, 2), strict=True):
        assert event["applied_in_chunk"] is not None
        # after chunk k on the wire: a later chunk, or chunk k made again with it (a preemption)
        assert event["applied_in_chunk"] > k - _preempted(recording.sidecar, event)


def _preempted(sidecar: dict[str, Any], event: dict[str, Any]) -> int:
    """1 when ``event`` had the chunk already received made again with it (a preemption), else 0 (its
    chunk replaced none, or replaced one that applied it already: those events are applied again)."""
    chunk = next(c for c in sidecar["chunks"] if event["event_id"] in c["applied_event_ids"])
    if chunk["supersedes"] is None:
        return 0
    replaced = next(c for c in sidecar["superseded"] if c["seq"] == chunk["supersedes"])
    assert replaced["chunk_index"] == chunk["chunk_index"]
    assert set(replaced["applied_event_ids"]) <= set(chunk["applied_event_ids"])
    return 0 if event["event_id"] in replaced["applied_event_ids"] else 1


async def test_check_server_says_why_a_bench_cannot_run(server: RunningServer) -> None:
    assert await check_server(server.ws) is None
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    said = await check_server(f"ws://127.0.0.1:{port}/v1/world")
    assert said is not None
    assert said.startswith(f"cannot connect to ws://127.0.0.1:{port}/v1/world: ")
    assert "\n" not in said


def test_record_refuses_a_bad_script(tmp_path: Path) -> None:
    script_path = tmp_path / "bad.json"
    script_path.write_text(json.dumps({"events": [{"after_chunk": 1}]}))
    done = subprocess.run(
        [sys.executable, "-m", "worldserve", "record", str(script_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "must carry a prompt and/or controls" in done.stderr


async def test_find_capacity_doubles_then_bisects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search itself, against a fake bench: a count is held up to 11 sessions; the 12th is refused."""
    import worldserve.tools.loadtest as loadtest

    tried: list[int] = []
    media: set[object] = set()

    async def fake_bench(url: str, *, clients: int, **options: object) -> loadtest.BenchResult:
        tried.append(clients)
        media.add(options.get("media"))
        reports = []
        for index in range(clients):
            report = loadtest.ClientReport(chunk_period=0.25, chunks=10)
            report.arrivals = [0.25 * k for k in range(10)]
            if clients > 11 and index == clients - 1:
                report.errors["admission_refused"] += 1
                report.error_messages.append("session 'x' refused: no real-time headroom")
            reports.append(report)
        return loadtest.BenchResult(clients=clients, duration=1.0, reports=reports)

    monkeypatch.setattr(loadtest, "run_bench", fake_bench)
    capacity, steps = await loadtest.find_capacity("ws://unused", start=2, max_clients=32, media="h264")
    assert media == {"h264"}  # every step's sessions travel as asked (worldserve bench --find-capacity --media)
    assert capacity == 11
    assert tried == [2, 4, 8, 16, 12, 10, 11]
    assert [step.held for step in steps] == [True, True, True, False, False, True, True]
    table = loadtest.format_capacity_table(capacity, steps)
    assert "sessions held at <= 1 % late chunks (counted by the player's underruns): 11" in table
    assert "at 12 clients, first error: session 'x' refused: no real-time headroom" in table


def test_a_capacity_step_is_held_by_what_the_player_saw_or_by_arrival() -> None:
    """By the player, a chunk that ran its jitter buffer dry is late although it met a fixed instant, and a
    chunk that missed the fixed instant but found frames still queued is not; by arrival, the other way."""
    import worldserve.tools.loadtest as loadtest

    def result(underruns: int, arrivals: list[float]) -> loadtest.BenchResult:
        report = loadtest.ClientReport(chunk_period=0.25, chunks=len(arrivals), underruns=underruns)
        report.arrivals = arrivals
        return loadtest.BenchResult(clients=1, duration=1.0, reports=[report])

    on_time = [0.25 * k for k in range(10)]
    one_late = [*on_time[:5], 1.3, *on_time[6:]]  # chunk 5 is 50 ms past its instant
    assert loadtest.held(result(0, on_time))
    assert loadtest.held(result(0, on_time), by="arrival")
    assert not loadtest.held(result(1, on_time))  # 1 underrun in 9 chunks: 11 % > 1 %
    assert loadtest.held(result(1, on_time), by="arrival")
    assert loadtest.held(result(0, one_late))  # a buffer with slack absorbed it
    assert not loadtest.held(result(0, one_late), by="arrival")
    assert loadtest.held(result(1, on_time), limit=0.2)


def test_playout_lateness_counts_a_late_chunk_once_and_reanchors() -> None:
    from worldserve.tools.loadtest import playout_lateness

    assert playout_lateness([0.0, 0.25, 0.5], 0.25) == (0, 0.0)
    late, stall = playout_lateness([0.0, 0.2, 0.6, 0.85, 1.2], 0.25)  # 0.6 is 0.1 late; 1.1 due, 1.2 late
    assert late == 2
    assert stall == pytest.approx(0.2)


async def test_bench_staggered_and_open_loop_against_a_real_server(server: RunningServer) -> None:
    staggered = await run_bench(server.ws, clients=3, duration=1.0, stagger=0.6, settle=3.0, seed=1)
    starts = sorted(report.started_at or 0.0 for report in staggered.reports)
    assert starts[-1] - starts[0] > 0.05  # they did not start together
    assert "staggered" in staggered.arrivals
    opened = await run_bench(server.ws, duration=1.0, arrival_rate=4.0, session_seconds=0.8, settle=3.0, seed=2)
    assert "open loop" in opened.arrivals
    for report in [*staggered.reports, *opened.reports]:
        assert not report.errors, report.error_messages
        assert report.chunks > 1
        assert report.lost == 0
        assert report.applied_twice == 0
    assert opened.clients == len(opened.reports)
