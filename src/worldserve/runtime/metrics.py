"""The engine's counters, read-only from outside (a Prometheus exporter reads snapshots).

Owns: :class:`EngineCounters` (mutable, written only by the engine on its event loop),
:class:`EngineStats`, its immutable snapshot with the engine's gauges, and
:class:`Capacity` (room for new sessions, what ``/healthz`` reports).

Must not know: the engine's logic, metrics libraries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from worldserve.stats import HistogramSnapshot, LatencyHistogram

__all__ = ["BATCH_SIZE_BUCKETS", "OVERHEAD_BUCKETS", "Capacity", "EngineCounters", "EngineStats"]

#: Upper bounds of the batch-size histogram's buckets (the last bucket is +Inf).
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
#: Upper bounds (seconds) of the engine-overhead histogram's buckets: finer than latencies.
OVERHEAD_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


@dataclass(frozen=True, slots=True)
class Capacity:
    """Room for new sessions now, for a load balancer to steer by.

    ``free``: session slots no session holds on the workers that are ready (None:
    unlimited -- no residency limit; a full worker may still admit by evicting a session
    nobody uses); ``workers_alive``: workers ready to take sessions; ``slots``: session
    slots on those workers, held or not (None: unlimited); ``room``: whether a new session
    would be tried on some worker now (a free slot, a session it may evict, real-time
    headroom), not whether it surely gets in.
    """

    free: int | None
    workers_alive: int
    slots: int | None = None
    room: bool = False


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's counters (monotonic) and gauges (now)."""

    ticks: int
    chunks: int
    tick_failures: Mapping[str, int]  # by error code
    batches: int
    batch_size: HistogramSnapshot
    tick_latency: HistogramSnapshot  # queued + round trip, seconds
    overhead: HistogramSnapshot  # round trip - compute - the worker's frame encoding, seconds per batch
    admissions: int
    admissions_refused: int
    evictions: int
    deadline_exceeded: int
    worker_deaths: int
    worker_restarts: int
    worker_restart_failures: int
    workers_killed_hung: int
    ticks_cancelled: int  # by cancel_tick (a chunk.cancel)
    ticks_retracted: int  # committed ticks undone by retract_tick (a preemption)
    rollbacks_failed: int  # a cancelled tick's state could not be rolled back (the session's next tick fails)
    # gauges
    sessions: int
    resident: tuple[int, ...]  # per worker
    queued_ticks: int
    workers_alive: int
    #: per worker: its chunk clock's period, stretched past the chunk period when it cannot hold real
    #: time (None: no session paces on its clock)
    chunk_periods: tuple[float | None, ...] = ()

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size.total / self.batch_size.count if self.batch_size.count else 0.0


class EngineCounters:
    """The engine's monotonic counters; plain attribute increments on one event loop."""

    __slots__ = (
        "admissions",
        "admissions_refused",
        "batch_size",
        "batches",
        "chunks",
        "deadline_exceeded",
        "evictions",
        "overhead",
        "rollbacks_failed",
        "tick_failures",
        "tick_latency",
        "ticks",
        "ticks_cancelled",
        "ticks_retracted",
        "worker_deaths",
        "worker_restart_failures",
        "worker_restarts",
        "workers_killed_hung",
    )

    def __init__(self) -> None:
        self.ticks = 0
        self.chunks = 0
        self.tick_failures: Counter[str] = Counter()
        self.batches = 0
        self.batch_size = LatencyHistogram(BATCH_SIZE_BUCKETS)
        self.tick_latency = LatencyHistogram()
        self.overhead = LatencyHistogram(OVERHEAD_BUCKETS)
        self.admissions = 0
        self.admissions_refused = 0
        self.evictions = 0
        self.deadline_exceeded = 0
        self.worker_deaths = 0
        self.worker_restarts = 0
        self.worker_restart_failures = 0
        self.workers_killed_hung = 0
        self.ticks_cancelled = 0
        self.ticks_retracted = 0
        self.rollbacks_failed = 0

    def snapshot(
        self,
        *,
        sessions: int,
        resident: tuple[int, ...],
        queued_ticks: int,
        workers_alive: int,
        chunk_periods: tuple[float | None, ...] = (),
    ) -> EngineStats:
        return EngineStats(
            ticks=self.ticks,
            chunks=self.chunks,
            tick_failures=MappingProxyType(dict(self.tick_failures)),
            batches=self.batches,
            batch_size=self.batch_size.snapshot(),
            tick_latency=self.tick_latency.snapshot(),
            overhead=self.overhead.snapshot(),
            admissions=self.admissions,
            admissions_refused=self.admissions_refused,
            evictions=self.evictions,
            deadline_exceeded=self.deadline_exceeded,
            worker_deaths=self.worker_deaths,
            worker_restarts=self.worker_restarts,
            worker_restart_failures=self.worker_restart_failures,
            workers_killed_hung=self.workers_killed_hung,
            ticks_cancelled=self.ticks_cancelled,
            ticks_retracted=self.ticks_retracted,
            rollbacks_failed=self.rollbacks_failed,
            sessions=sessions,
            resident=resident,
            queued_ticks=queued_ticks,
            workers_alive=workers_alive,
            chunk_periods=chunk_periods,
        )
