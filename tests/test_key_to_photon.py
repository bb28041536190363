"""Key-to-photon through a real server: the chunk's ``times``, the bench's decomposition, ``/metrics``.

``worldserve bench`` (``run_bench``) against ``worldserve serve``: every applied event's parts
(the server's instants from its chunk's ``times``, the client's own) are each non-negative and
sum to the total within one frame, and the server's histograms of its parts counted them. The
client and the server run on this host, so one monotonic clock serves both (no offset).
Nothing here asserts on how long anything took.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from server_harness import RunningServer, start_server
from worldserve.tools.loadtest import (
    K2P_PARTS,
    BenchResult,
    KeyToPhoton,
    clock_offset,
    format_table,
    playout_instants,
    playout_lateness,
    run_bench,
)

pytestmark = pytest.mark.timeout(300)

BENCH = Path(__file__).resolve().parent.parent / "bench"
HISTOGRAMS = (
    "worldserve_k2p_wait_tick_seconds",
    "worldserve_k2p_queue_seconds",
    "worldserve_k2p_step_seconds",
    "worldserve_k2p_encode_seconds",
)


def _metric_counts(server: RunningServer) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.http}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith("_count"):
            counts[name.removesuffix("_count")] = float(value)
    return counts


def _check_decomposition(result: BenchResult) -> None:
    samples = result.k2p
    assert result.same_clock
    assert result.offset == 0.0
    assert samples, "no applied event was measured"
    assert sum(r.accepted for r in result.reports) >= len(samples) > 0
    for sample in samples:
        parts = sample.parts(result.offset)
        assert list(parts) == list(K2P_PARTS)
        assert all(value >= 0.0 for value in parts.values()), parts
        assert sample.sums(result.offset)
        assert abs(sum(parts.values()) - sample.total) <= sample.frame
    table = format_table(result)
    assert "key-to-photon ms" in table
    assert f"{len(samples)} (0 off)" in table
    for name in K2P_PARTS:
        assert f"  {name} " in table


async def test_procedural_jpeg_parts_sum_to_the_total_and_metrics_count_them() -> None:
    server = start_server("--model", "procedural")
    try:
        result = await run_bench(server.ws, clients=2, duration=2.0, event_interval=0.1, settle=5.0, media="jpeg")
        _check_decomposition(result)
        counts = _metric_counts(server)
        for name in HISTOGRAMS:
            assert counts.get(name, 0.0) > 0, (name, counts.get(name))
        # one wait-for-tick per applied event (the bench's, at least), one of the others per chunk made
        assert counts["worldserve_k2p_wait_tick_seconds"] >= len(result.k2p)
        chunks = counts["worldserve_k2p_step_seconds"]
        assert chunks == counts["worldserve_k2p_queue_seconds"] == counts["worldserve_k2p_encode_seconds"]
        assert chunks >= sum(r.chunks for r in result.reports)
    finally:
        server.stop()


async def test_a_batching_timed_model_h264_decomposes_too() -> None:
    """A step that takes time, two sessions batched, frames as H.264: queue and model are real parts."""
    path = os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))
    server = start_server("--model", "timed_model:TimedModel", env={"PYTHONPATH": path})
    try:
        result = await run_bench(server.ws, clients=2, duration=2.0, event_interval=0.1, settle=5.0, media="h264")
        _check_decomposition(result)
        assert any(sample.stepped > sample.dispatched for sample in result.k2p)  # the model's sleep is in "model"
    finally:
        server.stop()


async def test_frames_in_parts_decompose_from_the_first_part_and_lose_nothing() -> None:
    """A model that makes each chunk in parts, a client that takes them (``run_bench(parts=True)``): the key's
    frame leaves with the chunk's first part, so its step ends there (``times.part_ms``); every part is
    non-negative and they sum to the total; the player played every frame and the ledger is exact."""
    server = start_server(
        "--model", "runtime_models:PartsModel", "--model-option", "part=1", "--model-option", "pause_s=0.02",
        test_models=True,
    )  # fmt: skip
    try:
        result = await run_bench(
            server.ws, clients=1, duration=2.0, event_interval=0.1, settle=5.0, media="jpeg", parts=True
        )
        _check_decomposition(result)
        (report,) = result.reports
        assert report.lost == report.applied_twice == report.seq_gaps == 0
        assert not report.errors
        # the key's frame left before the step ended: the chunk's stepped instant is after the one it is measured to
        assert all(sample.stepped == sample.encoded == sample.handed for sample in result.k2p)
    finally:
        server.stop()


def _sample(sent: float, up: float, down: float, offset: float) -> KeyToPhoton:
    """An event sent at ``sent`` (client clock) whose trips took ``up`` and ``down``, on a server
    whose clock reads ``offset`` ahead of the client's; 10 ms on the server in between."""
    accepted = sent + up + offset
    handed = accepted + 0.010
    arrived = handed - offset + down
    return KeyToPhoton(
        sent=sent,
        accepted=accepted,
        tick=accepted + 0.002,
        dispatched=accepted + 0.004,
        stepped=accepted + 0.006,
        encoded=accepted + 0.008,
        handed=handed,
        arrived=arrived,
        decoded=arrived + 0.001,
        shown=arrived + 0.051,
        frame=1 / 16,
    )


def test_the_offset_is_zero_on_one_clock_and_estimated_from_the_fastest_trips_elsewhere() -> None:
    offset = 123.456  # another host's clock
    samples = [
        _sample(1.0, 0.004, 0.004, offset),
        _sample(2.0, 0.030, 0.009, offset),
        _sample(3.0, 0.007, 0.050, offset),
    ]
    assert clock_offset(samples, same_clock=True) == 0.0
    estimated = clock_offset(samples, same_clock=False)
    assert estimated == pytest.approx(offset, abs=1e-9)  # the fastest trips (4 ms each way) are symmetric
    for sample in samples:
        parts = sample.parts(estimated)
        assert parts["up"] > 0
        assert parts["down"] > 0
        assert sample.sums(estimated)
    wrong = samples[0].parts(estimated + 0.5)  # a wrong offset moves time between the trips: one goes negative
    assert wrong["up"] < 0 < wrong["down"]
    assert samples[0].sums(estimated + 0.5)


def test_playout_instants_are_the_lateness_models_playout() -> None:
    arrivals = [0.0, 0.1, 0.7, 0.8, 1.6]
    shown = playout_instants(arrivals, 0.25)
    assert shown == pytest.approx([0.0, 0.25, 0.7, 0.95, 1.6])
    late, stall = playout_lateness(arrivals, 0.25)
    assert late == 2
    assert stall == pytest.approx((0.7 - 0.5) + (1.6 - 1.2))
