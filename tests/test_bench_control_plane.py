"""Smoke test of bench/control_plane.py: its workload and pieces run; no timing asserted, nothing downloaded."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "control_plane.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("worldserve_bench_control_plane", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_workload_events_are_the_stated_ones(bench: ModuleType) -> None:
    events = bench.make_events(bench.worldserve_impl(), 10)
    assert [event.event_id for event in events] == [10, 11, 12, 13]
    assert events[0].prompt
    assert not events[0].controls
    poses = events[1].controls
    assert [control.track for control in poses] == ["camera", "avatar", "left_hand", "right_hand"]
    for control in poses:
        assert len(control.data["samples"]) == 12
        assert all(set(sample) == {"x", "y", "yaw", "pitch"} for sample in control.data["samples"])
    assert [len(event.controls) for event in events[2:]] == [1, 1]


def test_workload_runs_and_commits_every_event(bench: ModuleType) -> None:
    impl = bench.worldserve_impl()
    session, _ = bench.new_session(impl)
    event_ns, chunk_ns = asyncio.run(bench.run_rounds(impl, session, 3))
    assert event_ns > 0
    assert chunk_ns > 0
    assert session.chunk_index == 3
    assert session.stats.applied == 12
    assert session.pending_event_count == 0
    per_event_us, per_chunk_us = bench.sample(impl, 2)
    assert per_event_us > 0
    assert per_chunk_us > 0


def test_workload_ticks_are_what_both_sides_are_compared_on(bench: ModuleType) -> None:
    ticks = bench.workload_ticks(bench.worldserve_impl(), rounds=2)
    assert [tick["ar_diffusion_tick"]["applied_event_ids"] for tick in ticks] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    tracks = [control["track"] for control in ticks[1]["ar_diffusion_tick"]["controls"]]
    assert tracks == ["avatar", "camera", "keys", "left_hand", "mouse", "right_hand"]
    assert ticks[1]["ar_diffusion_tick"]["request_id"] == "bench-world-1"


def test_seed_loader_shims_the_package_imports_and_restores_sys_modules(bench: ModuleType, tmp_path: Path) -> None:
    # A stand-in for the two seed files with the same import shape: session imports tick_protocol by its
    # absolute vllm_omni path. (The real files come from the downloaded wheel, never from this project.)
    package = tmp_path / "vllm_omni" / "experimental" / "ar_diffusion"
    package.mkdir(parents=True)
    (package / "tick_protocol.py").write_text(
        "from worldserve import ChunkMetadata as ARDiffusionChunkMetadata\n"
        "from worldserve import ControlInput as ARDiffusionControlInput\n"
    )
    (package / "session.py").write_text(
        "from vllm_omni.experimental.ar_diffusion.tick_protocol import ARDiffusionControlInput\n"
        "from worldserve import Session as ARDiffusionSession\n"
        "from worldserve import SessionEvent as ARDiffusionSessionEvent\n"
    )
    before = {name for name in sys.modules if name.startswith("vllm_omni")}
    seed = bench.load_seed(tmp_path)
    assert {name for name in sys.modules if name.startswith("vllm_omni")} == before
    ours = bench.worldserve_impl()
    assert bench.workload_ticks(seed) == bench.workload_ticks(ours)
    rows = bench.measure(ours, seed, samples=2, rounds=2)
    assert [row.metric for row in rows] == ["per event (construct + accept)", "per chunk (next_chunk)"]
    assert all(row.worldserve_us > 0 and row.seed_us > 0 for row in rows)


def test_table_reports_ratio_and_target(bench: ModuleType) -> None:
    rows = [bench.Row("per event (construct + accept)", 10.0, 40.0, 0.4), bench.Row("per chunk", 9.0, 60.0, 0.1)]
    assert rows[0].ratio == 0.25
    assert rows[0].met
    assert rows[1].ratio == 0.15
    assert not rows[1].met
    table = bench.format_table(rows, samples=5, rounds=7).splitlines()
    assert "5 alternating samples per side, 7 rounds each" in table[2]
    assert table[-2].split()[-6:] == ["10.00", "40.00", "0.250x", "<=", "0.4x", "yes"]
    assert table[-1].split()[-6:] == ["9.00", "60.00", "0.150x", "<=", "0.1x", "NO"]
