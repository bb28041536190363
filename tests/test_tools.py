"""``worldserve bench`` and ``worldserve record`` against a real server (small smoke runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from server_harness import RunningServer, start_server
from worldserve.loadtest import format_table, run_bench


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


async def test_bench_accounts_for_every_event(server: RunningServer) -> None:
    result = await run_bench(server.ws, clients=3, duration=1.5, event_interval=0.1, settle=3.0)
    table = format_table(result)
    assert "accepted->applied" in table
    for report in result.reports:
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
            assert event["applied_in_chunk"] >= event["sent_after_chunks"]
    with Image.open(tmp_path / "world.gif") as gif:
        assert gif.size == (48 * 4, 48 * 4)
        # Pillow merges identical consecutive frames, adding their durations; GIF keeps
        # centiseconds, so the 24 frames at 16 fps last 1.5 s give or take rounding.
        total = 0
        for index in range(gif.n_frames):
            gif.seek(index)
            total += gif.info["duration"]
        assert abs(total - 1500) <= 100, total


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
