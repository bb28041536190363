"""Prometheus metrics of one server (prometheus-client), in a registry of its own.

Owns: the server's own instruments (sessions started/active, time to first chunk,
chunk latency, frames sent, client errors and session failures by code) and a
collector that reads, at scrape time, the control plane's counters and latency
histogram (``SessionManager.stats()``), its queue depth, and the engine's counters.
Nothing is counted twice: the control plane's and the engine's counters stay where
they are kept and are only read here.

Must not know: sockets, how counters are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from worldserve.session import SessionManager

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_EVENT_OUTCOMES = ("accepted", "duplicate", "stale", "rejected_full", "invalid", "applied", "dropped")


class _ControlPlaneCollector(Collector):
    def __init__(self, manager: SessionManager[Any], engine_stats: Callable[[], Mapping[str, float]] | None) -> None:
        self._manager = manager
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._manager.stats()
        events = CounterMetricFamily(
            "worldserve_events", "Input events by outcome (accepted, duplicate, stale, ...).", labels=["outcome"]
        )
        for outcome in _EVENT_OUTCOMES:
            events.add_metric([outcome], getattr(stats, outcome))
        yield events
        yield CounterMetricFamily("worldserve_chunks", "Chunks committed.", value=stats.chunks)
        yield CounterMetricFamily("worldserve_session_resets", "Successful session resets.", value=stats.resets)
        yield CounterMetricFamily("worldserve_tick_failures", "Ticks that failed a session.", value=stats.failures)
        latency = stats.applied_latency
        cumulative = list(accumulate(latency.counts))
        buckets = [(_bound(bound), count) for bound, count in zip(latency.bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        yield HistogramMetricFamily(
            "worldserve_event_applied_latency_seconds",
            "Time from an event's acceptance to the commit of the chunk that applied it.",
            buckets=buckets,
            sum_value=latency.total,
        )
        sessions = list(self._manager)
        yield GaugeMetricFamily("worldserve_sessions_registered", "Sessions the control plane holds.", len(sessions))
        yield GaugeMetricFamily(
            "worldserve_queue_depth",
            "Accepted events waiting for a chunk, over all sessions.",
            sum(session.pending_event_count for session in sessions),
        )
        if self._engine_stats is not None:
            for name, value in sorted(self._engine_stats().items()):
                yield CounterMetricFamily(f"worldserve_engine_{name}", f"Engine counter {name}.", value=value)


def _bound(value: float) -> str:
    return repr(float(value))


class ServerMetrics:
    """The instruments a server updates, plus scrape-time views of the runtime."""

    def __init__(
        self,
        manager: SessionManager[Any],
        engine_stats: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.sessions_started = Counter(
            "worldserve_sessions_started", "Sessions started over WebSocket.", registry=self.registry
        )
        self.sessions_active = Gauge(
            "worldserve_sessions_active", "Sessions with a live connection.", registry=self.registry
        )
        self.time_to_first_chunk = Histogram(
            "worldserve_time_to_first_chunk_seconds",
            "From session.start to its first chunk's frames sent.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.chunk_latency = Histogram(
            "worldserve_chunk_latency_seconds",
            "Time one next_chunk() took (snapshot, engine, model, commit).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.frames_sent = Counter("worldserve_frames_sent", "Frames sent to clients.", registry=self.registry)
        self.client_errors = Counter(
            "worldserve_client_errors", "Error messages sent to clients, by code.", ["code"], registry=self.registry
        )
        self.session_failures = Counter(
            "worldserve_session_failures",
            "Sessions failed while generating, by code.",
            ["code"],
            registry=self.registry,
        )
        self.registry.register(_ControlPlaneCollector(manager, engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
