"""Counters and latency histograms: cheap to write, immutable to read, additive across sessions."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldserve import HistogramSnapshot, SessionStats
from worldserve.stats import DEFAULT_LATENCY_BUCKETS, LatencyHistogram, SessionCounters

PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=100)


def test_observations_land_in_the_first_bucket_whose_bound_they_do_not_exceed() -> None:
    histogram = LatencyHistogram((0.1, 1.0))
    for seconds in (0.0, 0.1, 0.100001, 1.0, 1.5, math.inf):
        histogram.observe(seconds)
    snapshot = histogram.snapshot()
    # Prometheus "le" buckets: a value equal to a bound belongs to that bound's bucket.
    assert snapshot.counts == (2, 2, 2)
    assert snapshot.count == 6
    assert snapshot.bounds == (0.1, 1.0)
    assert math.isinf(snapshot.total)


@PROPERTY
@given(st.lists(st.floats(min_value=0, max_value=60, allow_nan=False), max_size=50))
def test_histogram_counts_every_observation_once(values: list[float]) -> None:
    histogram = LatencyHistogram()
    for value in values:
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert len(snapshot.counts) == len(DEFAULT_LATENCY_BUCKETS) + 1
    assert sum(snapshot.counts) == snapshot.count == len(values)
    assert snapshot.total == pytest.approx(sum(values))
    for bucket, count in enumerate(snapshot.counts):
        low = DEFAULT_LATENCY_BUCKETS[bucket - 1] if bucket else -math.inf
        high = DEFAULT_LATENCY_BUCKETS[bucket] if bucket < len(DEFAULT_LATENCY_BUCKETS) else math.inf
        assert count == sum(1 for value in values if low < value <= high)


@pytest.mark.parametrize("bounds", [(1.0, 1.0), (2.0, 1.0), (0.5, 0.25, 1.0)])
def test_bounds_must_strictly_increase(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyHistogram(bounds)


def test_snapshots_are_immutable_and_detached() -> None:
    histogram = LatencyHistogram((1.0,))
    histogram.observe(0.5)
    snapshot = histogram.snapshot()
    histogram.observe(2.0)
    assert snapshot.counts == (1, 0)
    assert histogram.snapshot().counts == (1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.count = 7  # type: ignore[misc]
    stats = SessionStats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.accepted = 1  # type: ignore[misc]


def test_histograms_add_bucket_by_bucket() -> None:
    a = HistogramSnapshot((1.0, 2.0), (1, 0, 2), 9.5, 3)
    b = HistogramSnapshot((1.0, 2.0), (0, 4, 1), 7.0, 5)
    assert a + b == HistogramSnapshot((1.0, 2.0), (1, 4, 3), 16.5, 8)
    assert a + HistogramSnapshot.empty((1.0, 2.0)) == a
    with pytest.raises(ValueError, match="different bucket bounds"):
        a + HistogramSnapshot.empty((1.0,))


def test_quantile_is_the_upper_bound_of_the_bucket_holding_it() -> None:
    snapshot = HistogramSnapshot((0.1, 1.0, 10.0), (2, 0, 1, 1), 0.0, 4)
    assert snapshot.quantile(0.0) == 0.1
    assert snapshot.quantile(0.5) == 0.1
    assert snapshot.quantile(0.51) == 10.0  # the empty (0.1, 1] bucket is skipped
    assert snapshot.quantile(0.75) == 10.0
    assert snapshot.quantile(0.9) == math.inf
    assert snapshot.quantile(1.0) == math.inf
    assert HistogramSnapshot.empty().quantile(0.99) == 0.0
    for q in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"q must lie in \[0, 1\]"):
            snapshot.quantile(q)


def test_session_stats_add_field_by_field() -> None:
    names = [field.name for field in dataclasses.fields(SessionStats) if field.name != "applied_latency"]
    a = SessionStats(**{name: index + 1 for index, name in enumerate(names)})
    b = SessionStats(**{name: 10 * (index + 1) for index, name in enumerate(names)})
    total = a + b
    for index, name in enumerate(names):
        assert getattr(total, name) == 11 * (index + 1)
    latency = HistogramSnapshot.empty()
    assert total.applied_latency == latency
    assert a + SessionStats() == a


def test_counters_snapshot_every_field() -> None:
    counters = SessionCounters()
    names = [field.name for field in dataclasses.fields(SessionStats) if field.name != "applied_latency"]
    for index, name in enumerate(names):
        setattr(counters, name, index + 1)
    counters.applied_latency.observe(0.003)
    snapshot = counters.snapshot()
    assert [getattr(snapshot, name) for name in names] == list(range(1, len(names) + 1))
    assert snapshot.applied_latency.count == 1
    assert set(SessionCounters.__slots__) == {field.name for field in dataclasses.fields(SessionStats)}
    with pytest.raises(AttributeError):
        counters.typo = 1  # type: ignore[attr-defined]
