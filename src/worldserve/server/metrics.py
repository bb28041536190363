"""Prometheus metrics of one server (prometheus-client), in a registry of its own.

Owns: the server's own instruments (sessions started/active, time to first chunk,
chunk latency, key-to-photon's server parts (wait for the tick, queue, model step,
encode), frames sent and their bytes by media, resumes, joins, skipped chunks, the
process's CPU time, error replies by code -- the client's fault and the server's in two
families -- and session failures by code; the ``/v1/realtime/video`` route's sessions and
errors) and a collector that reads, at scrape time, the control plane's counters and
latency histogram (``SessionManager.stats()``), its queue depth, and the engine's counters.
Nothing is counted twice: the control plane's and the engine's counters stay where
they are kept and are only read here. Each labelled family sums to something: the
events received by the answer they got (``worldserve_events_total{outcome}``), the
accepted events by where they ended (``worldserve_events_settled_total{fate}``; plus
``worldserve_queue_depth``, the ones still queued, it equals the accepted). No counter has
a ``_created`` series (prometheus-client's are switched off, so every family looks alike).

Must not know: sockets, how counters are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from worldserve.errors import CODES, ErrorCode, Fault, Surface, codes_at
from worldserve.runtime.metrics import EngineStats
from worldserve.session import SessionManager
from worldserve.stats import HistogramSnapshot

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_QUEUE_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_OUTCOMES = ("admitted", "timeout", "left", "full")

#: The answers an input event that reached a session's queue got: each event exactly one.
_EVENT_OUTCOMES = ("accepted", "duplicate", "stale", "rejected_full", "invalid")


def _histogram(name: str, documentation: str, snapshot: HistogramSnapshot) -> HistogramMetricFamily:
    cumulative = list(accumulate(snapshot.counts))
    buckets = [(repr(float(bound)), count) for bound, count in zip(snapshot.bounds, cumulative, strict=False)]
    buckets.append(("+Inf", cumulative[-1]))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=snapshot.total)


class _RuntimeCollector(Collector):
    """Reads the control plane's and the engine's counters at scrape time."""

    def __init__(self, manager: SessionManager[Any], engine_stats: Callable[[], EngineStats] | None) -> None:
        self._manager = manager
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._manager.stats()
        events = CounterMetricFamily(
            "worldserve_events",
            "Input events that reached a session, by the answer each got (one each: the family sums to them).",
            labels=["outcome"],
        )
        for outcome in _EVENT_OUTCOMES:
            events.add_metric([outcome], getattr(stats, outcome))
        yield events
        settled = CounterMetricFamily(
            "worldserve_events_settled",
            "Accepted events by where each ended: applied in a chunk, superseded by a newer held control, or "
            "dropped by a reset, close or failure (one each: with worldserve_queue_depth it sums to the accepted).",
            labels=["fate"],
        )
        settled.add_metric(["applied"], stats.applied)
        settled.add_metric(["superseded"], stats.superseded)
        settled.add_metric(["dropped"], stats.dropped - stats.superseded)
        yield settled
        yield CounterMetricFamily("worldserve_chunks", "Chunks committed.", value=stats.chunks)
        yield CounterMetricFamily(
            "worldserve_chunks_cancelled", "Chunks cancelled by chunk.cancel (never sent).", value=stats.cancelled
        )
        yield CounterMetricFamily(
            "worldserve_chunks_retracted",
            "Committed chunks undone by a preemption (made again with newer input; their events applied again).",
            value=stats.retracted,
        )
        yield CounterMetricFamily("worldserve_session_resets", "Successful session resets.", value=stats.resets)
        yield CounterMetricFamily("worldserve_tick_failures", "Ticks that failed a session.", value=stats.failures)
        yield _histogram(
            "worldserve_event_applied_latency_seconds",
            "Time from an event's acceptance to the commit of the chunk that applied it.",
            stats.applied_latency,
        )
        sessions = list(self._manager)
        yield GaugeMetricFamily("worldserve_sessions_registered", "Sessions the control plane holds.", len(sessions))
        yield GaugeMetricFamily(
            "worldserve_queue_depth",
            "Accepted events waiting for a chunk, over all sessions.",
            sum(session.pending_event_count for session in sessions),
        )
        if self._engine_stats is not None:
            yield from self._engine(self._engine_stats())

    def _engine(self, engine: EngineStats) -> Iterator[Metric]:
        for name, documentation in _ENGINE_COUNTERS:
            yield CounterMetricFamily(f"worldserve_{name}", documentation, value=getattr(engine, name))
        failures = CounterMetricFamily(
            "worldserve_engine_tick_failures", "Ticks the engine failed, by error code.", labels=["code"]
        )
        for code, count in sorted(engine.tick_failures.items()):
            failures.add_metric([code], count)
        yield failures
        yield _histogram("worldserve_batch_size", "Ticks per model step.", engine.batch_size)
        yield _histogram(
            "worldserve_engine_tick_latency_seconds",
            "A tick's time in the engine (queued + round trip).",
            engine.tick_latency,
        )
        yield _histogram(
            "worldserve_engine_overhead_seconds",
            "Per batch: round trip minus model compute (IPC, scheduling).",
            engine.overhead,
        )
        yield GaugeMetricFamily("worldserve_engine_queued_ticks", "Ticks waiting in the engine.", engine.queued_ticks)
        yield GaugeMetricFamily("worldserve_workers_alive", "Worker processes alive.", engine.workers_alive)
        resident = GaugeMetricFamily("worldserve_resident_sessions", "Sessions resident per worker.", labels=["worker"])
        for worker, count in enumerate(engine.resident):
            resident.add_metric([str(worker)], count)
        yield resident
        periods = GaugeMetricFamily(
            "worldserve_chunk_period_seconds",
            "Per worker whose chunk clock runs: its period (over the model's chunk period: it cannot hold real time).",
            labels=["worker"],
        )
        for worker, period in enumerate(engine.chunk_periods):  # None: no clock, or no session on it
            if period is not None:
                periods.add_metric([str(worker)], period)
        yield periods


_ENGINE_COUNTERS = (
    ("ticks", "Ticks the engine received."),
    ("batches", "Model steps run."),
    ("admissions", "Sessions admitted to a worker."),
    ("admissions_refused", "Sessions refused for lack of room."),
    ("evictions", "Idle sessions evicted to make room."),
    ("deadline_exceeded", "Ticks failed past their deadline."),
    ("worker_deaths", "Worker processes that died."),
    ("worker_restarts", "Worker processes started to replace dead ones."),
    ("worker_restart_failures", "Replacement workers that failed to start (retried with backoff)."),
    ("workers_killed_hung", "Workers killed for hanging."),
)


class ServerMetrics:
    """The instruments a server updates, plus scrape-time views of the runtime."""

    def __init__(
        self,
        manager: SessionManager[Any],
        engine_stats: Callable[[], EngineStats] | None = None,
    ) -> None:
        # prometheus-client adds a `_created` series to the counters and histograms it keeps (not to those
        # read at scrape time): off, so every family looks alike. It is process-wide, as the server is.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self.sessions_started = Counter(
            "worldserve_sessions_started", "Sessions started over WebSocket.", registry=self.registry
        )
        self.sessions_moved = Counter(
            "worldserve_sessions_moved",
            "Clients sent on to another front-end (session.moved): a resume or join to the one its world lives "
            "on, a waiting start to the one the service's line placed it on.",
            registry=self.registry,
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
        self.late_chunks = Counter(
            "worldserve_late_chunks",
            "Chunks ready after their playout instant (--lead jit: the viewer stalled, and playback moved later).",
            registry=self.registry,
        )
        self.preempted_chunks = Counter(
            "worldserve_preempted_chunks",
            "Chunks made again because input came before they played (--preempt auto): undone after they were "
            "made and sent (how=undone), or cancelled while being made (how=cancelled).",
            ["how"],
            registry=self.registry,
        )
        self.preempt_wasted = Counter(
            "worldserve_preempt_wasted_step_seconds",
            "Step time spent on chunks a preemption threw away (a batch's step shared by its sessions).",
            registry=self.registry,
        )
        # Key-to-photon, the server's parts (the same instants each chunk message's `times` carries).
        self.k2p_wait_tick = Histogram(
            "worldserve_k2p_wait_tick_seconds",
            "Per applied event: from its acceptance to the issue of the tick that took it.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.k2p_queue = Histogram(
            "worldserve_k2p_queue_seconds",
            "Per chunk: from its tick's issue to its dispatch to a worker (waiting for company or a worker).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.k2p_step = Histogram(
            "worldserve_k2p_step_seconds",
            "Per chunk: the model's step, dispatch to result (its batch's round trip, a worker's encoding left out).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.k2p_encode = Histogram(
            "worldserve_k2p_encode_seconds",
            "Per chunk: encoding its frames as the world's media (the worker's for its batch and/or the server's).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.sessions_resumed = Counter(
            "worldserve_sessions_resumed", "Members that resumed after a dropped connection.", registry=self.registry
        )
        self.members_joined = Counter(
            "worldserve_members_joined",
            "Connections that joined a shared world, by role.",
            ["role"],
            registry=self.registry,
        )
        for role in ("viewer", "controller"):
            self.members_joined.labels(role=role)
        self.chunks_skipped = Counter(
            "worldserve_chunks_skipped",
            "Chunks not sent to a lagging viewer (or lost past a resume's buffer).",
            registry=self.registry,
        )
        self.frames_sent = Counter("worldserve_frames_sent", "Frames sent to clients.", registry=self.registry)
        self.webrtc_copies = Counter(
            "worldserve_webrtc_copies",
            "Messages a WebRTC session's client also sent as copies on its fast channel, counted as its connection "
            "ends: taken (read before the main channel's own copy came) or unused (late, or not readable).",
            ["used"],
            registry=self.registry,
        )
        self.media_bytes_sent = Counter(
            "worldserve_media_bytes_sent",
            "Bytes of frames (binary messages) sent to clients, by media (jpeg, raw, h264).",
            ["media"],
            registry=self.registry,
        )
        self.chunk_encodings = Counter(
            "worldserve_chunk_encodings",
            "Chunks encoded, by media: once per media a world's members use (not once per member), "
            "counted as the world receives them from its worker or encodes them itself.",
            ["media"],
            registry=self.registry,
        )
        for media in ("jpeg", "raw", "h264"):
            self.media_bytes_sent.labels(media=media)
            self.chunk_encodings.labels(media=media)
        self.realtime_sessions_started = Counter(
            "worldserve_realtime_video_sessions_started",
            "Sessions started over /v1/realtime/video (also counted in worldserve_sessions_started).",
            registry=self.registry,
        )
        self.realtime_errors = Counter(
            "worldserve_realtime_video_errors",
            "error messages sent on /v1/realtime/video, by code (none: vllm-omni's uncoded errors).",
            ["code"],
            registry=self.registry,
        )
        for code in ("none", "event_id_conflict", "interaction_failed"):
            self.realtime_errors.labels(code=code)
        self.client_errors = Counter(
            "worldserve_client_errors",
            "Error replies for the client's fault (a message, event or start the client must fix), by code.",
            ["code"],
            registry=self.registry,
        )
        self.server_errors = Counter(
            "worldserve_server_errors",
            "Error replies for the server's fault (no room, a runtime or internal failure), by code.",
            ["code"],
            registry=self.registry,
        )
        self.session_failures = Counter(
            "worldserve_session_failures",
            "Sessions failed while generating, by code.",
            ["code"],
            registry=self.registry,
        )
        # Every code a client can meet is a label from the start (0 until it happens): the
        # vocabulary (worldserve.errors), not this module, decides the label values.
        for code in dict.fromkeys(codes_at(Surface.MESSAGE) + codes_at(Surface.EVENT) + codes_at(Surface.START)):
            self.error_replies(code)
        for code in codes_at(Surface.TICK) + codes_at(Surface.LIFECYCLE):
            self.session_failures.labels(code=code.value)
        # The waiting room (session.start with queue: true): how many wait now, and each wait's outcome and length.
        self.queue_waiting: Callable[[], int] = lambda: 0
        Gauge("worldserve_queue_waiting", "Starts waiting in line for room now.", registry=self.registry).set_function(
            lambda: self.queue_waiting()
        )
        self.queue_starts = Counter(
            "worldserve_queue_starts",
            "Starts that waited in line, by outcome (admitted, timeout, left, full: refused, the line was full).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in _QUEUE_OUTCOMES:
            self.queue_starts.labels(outcome=outcome)
        self.queue_wait_seconds = Histogram(
            "worldserve_queue_wait_seconds",
            "How long a start waited in line (admitted, timed out or left).",
            buckets=_QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_RuntimeCollector(manager, engine_stats))
        # This process's CPU time (Linux /proc; absent elsewhere): `worldserve bench` reads it per chunk.
        ProcessCollector(registry=self.registry)

    def queue_wait(self, outcome: str, waited_s: float) -> None:
        """A start left the waiting room (or was refused at its door: ``full``)."""
        self.queue_starts.labels(outcome=outcome).inc()
        if outcome != "full":
            self.queue_wait_seconds.observe(waited_s)

    def error_replies(self, code: ErrorCode) -> Any:
        """The counter of ``error`` replies with ``code``: in the client's family or the server's, by its fault."""
        family = self.client_errors if CODES[code].fault is Fault.CLIENT else self.server_errors
        return family.labels(code=code.value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
