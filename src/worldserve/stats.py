"""Cheap, read-only-from-outside counters of the control plane.

Owns: :class:`LatencyHistogram` (fixed buckets, O(log buckets) per observation),
:class:`SessionCounters` (the mutable counters one session owns) and their immutable
snapshots :class:`HistogramSnapshot` and :class:`SessionStats`, which add up so a
manager can aggregate them and an exporter (Prometheus) can read them.

Must not know: sessions' logic, metrics libraries. Standard library only.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, fields

__all__ = ["DEFAULT_LATENCY_BUCKETS", "HistogramSnapshot", "LatencyHistogram", "SessionCounters", "SessionStats"]

#: Upper bounds (seconds) of the accepted->applied latency buckets; the last bucket is +Inf.
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Bucket counts (not cumulative; ``len(bounds) + 1`` of them, the last for +Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    count: int

    @classmethod
    def empty(cls, bounds: tuple[float, ...] = DEFAULT_LATENCY_BUCKETS) -> HistogramSnapshot:
        return cls(bounds, (0,) * (len(bounds) + 1), 0.0, 0)

    def __add__(self, other: HistogramSnapshot) -> HistogramSnapshot:
        if self.bounds != other.bounds:
            raise ValueError("cannot add histograms with different bucket bounds")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramSnapshot(self.bounds, counts, self.total + other.total, self.count + other.count)

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (``inf`` past the last bound, 0 if empty)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must lie in [0, 1]")
        if self.count == 0:
            return 0.0
        rank = q * self.count
        seen = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += count
            if seen >= rank and count:
                return bound
        return float("inf")


class LatencyHistogram:
    """A fixed-bucket histogram owned by one writer."""

    __slots__ = ("_bounds", "_count", "_counts", "_total")

    def __init__(self, bounds: tuple[float, ...] = DEFAULT_LATENCY_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("bucket bounds must be strictly increasing")
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0
        self._count = 0

    def observe(self, seconds: float) -> None:
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._total += seconds
        self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self._bounds, tuple(self._counts), self._total, self._count)


_NO_LATENCIES = HistogramSnapshot.empty()


@dataclass(frozen=True, slots=True)
class SessionStats:
    """An immutable snapshot of one session's (or, summed, many sessions') counters.

    ``accepted``/``duplicate``/``stale``/``rejected_full``/``invalid``: answers of
    ``accept_event`` (the last three raised); ``applied``: events committed in a chunk;
    ``dropped``: accepted events discarded by a reset, a close, a failure or a successor
    (each is applied or dropped exactly once); ``superseded``: those of ``dropped`` that a
    newer event on the same continuous tracks replaced in the queue; ``chunks``:
    committed chunks; ``cancelled``: chunks cancelled by ``cancel_chunk()``; ``retracted``:
    committed chunks undone by ``retract_chunk()`` (a preemption), whose ``unapplied`` events
    went back to the queue and are applied again in the chunk made in their place (so
    ``accepted == applied - unapplied + dropped + pending``; every counter only grows); ``failures``:
    times the session became ``failed`` (a tick or a reset failed); ``resets``: successful
    resets; ``applied_latency``: seconds from acceptance to the commit that applied it.
    """

    accepted: int = 0
    duplicate: int = 0
    stale: int = 0
    rejected_full: int = 0
    invalid: int = 0
    applied: int = 0
    dropped: int = 0
    superseded: int = 0
    chunks: int = 0
    cancelled: int = 0
    retracted: int = 0
    unapplied: int = 0
    failures: int = 0
    resets: int = 0
    applied_latency: HistogramSnapshot = _NO_LATENCIES

    def __add__(self, other: SessionStats) -> SessionStats:
        values = {field.name: getattr(self, field.name) + getattr(other, field.name) for field in fields(SessionStats)}
        return SessionStats(**values)


class SessionCounters:
    """The mutable counters one session owns; plain attribute increments, no locks."""

    __slots__ = (
        "accepted",
        "applied",
        "applied_latency",
        "cancelled",
        "chunks",
        "dropped",
        "duplicate",
        "failures",
        "invalid",
        "rejected_full",
        "resets",
        "retracted",
        "stale",
        "superseded",
        "unapplied",
    )

    def __init__(self) -> None:
        self.accepted = 0
        self.duplicate = 0
        self.stale = 0
        self.rejected_full = 0
        self.invalid = 0
        self.applied = 0
        self.dropped = 0
        self.superseded = 0
        self.chunks = 0
        self.cancelled = 0
        self.retracted = 0
        self.unapplied = 0
        self.failures = 0
        self.resets = 0
        self.applied_latency = LatencyHistogram()

    def snapshot(self) -> SessionStats:
        return SessionStats(
            accepted=self.accepted,
            duplicate=self.duplicate,
            stale=self.stale,
            rejected_full=self.rejected_full,
            invalid=self.invalid,
            applied=self.applied,
            dropped=self.dropped,
            superseded=self.superseded,
            chunks=self.chunks,
            cancelled=self.cancelled,
            retracted=self.retracted,
            unapplied=self.unapplied,
            failures=self.failures,
            resets=self.resets,
            applied_latency=self.applied_latency.snapshot(),
        )
