"""A worker's chunk clock: the common instants at which its sessions' ticks are issued.

Owns: :class:`ChunkClock` (origin + k * period; the period stretched to the worker's
measured step time when it cannot hold real time, so every session on it slows the
same), :class:`StepTimes` (a worker's recent step time per batch size, and a
prediction for sizes not measured yet), and :func:`tick_instant`, the rule a paced
producer uses to put its next tick on the clock.

Why: sessions that pace their own chunks from their own start stay out of phase, so
each one's tick reaches the worker just after another's step began and waits a whole
step alone. Issuing every session's ticks at the same instants makes them arrive
together and run as one batch.

Pure: the caller passes the time. Must not know: asyncio, workers, sessions, models.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["ChunkClock", "StepTimes", "tick_instant"]

_EPS = 1e-9


class ChunkClock:
    """The instants ``origin + k * period`` of one worker, started by the first session that asks."""

    __slots__ = ("nominal", "origin", "period")

    def __init__(self, period: float) -> None:
        if not period > 0:
            raise ValueError(f"period must be positive; got {period!r}.")
        self.nominal = float(period)
        self.period = float(period)
        self.origin: float | None = None

    @property
    def started(self) -> bool:
        return self.origin is not None

    def next_slot(self, now: float) -> float:
        """The first instant at or after ``now`` (the first call makes ``now`` the origin)."""
        origin = self.origin
        if origin is None:
            self.origin = now
            return now
        k = math.ceil((now - origin) / self.period - _EPS)
        return origin + max(k, 0) * self.period

    def last_slot(self, at: float) -> float:
        """The latest instant at or before ``at`` (the origin itself for times before it)."""
        origin = self.origin
        if origin is None:
            raise RuntimeError("the clock has not started.")
        k = math.floor((at - origin) / self.period + _EPS)
        return origin + max(k, 0) * self.period

    def after(self, now: float) -> float:
        """The first instant strictly after ``now``."""
        slot = self.next_slot(now)
        return slot if slot > now + _EPS else slot + self.period

    def stretch(self, step_s: float, now: float) -> bool:
        """Set the period to ``max(nominal, step_s)``; instants up to ``now`` stay where they were.

        Returns True if the period changed.
        """
        period = max(self.nominal, float(step_s))
        if abs(period - self.period) <= _EPS:
            return False
        if self.origin is not None:
            self.origin = self.last_slot(now)
        self.period = period
        return True


class StepTimes:
    """One worker's step time (dispatch to results) per batch size: the median of the last few.

    A median, not a mean: one step slowed by something else (an admission's state built on
    the worker, a burst of other work on its cores) must not make admission refuse the
    next session or stretch every session's period; three slow steps in five do.
    """

    __slots__ = ("_by_size", "_window")

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1; got {window!r}.")
        self._window = window
        self._by_size: dict[int, deque[float]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_size)

    def observe(self, batch: int, seconds: float) -> None:
        samples = self._by_size.get(batch)
        if samples is None:
            samples = self._by_size[batch] = deque(maxlen=self._window)
        samples.append(seconds)

    def measured(self, batch: int) -> float | None:
        samples = self._by_size.get(batch)
        return None if samples is None else statistics.median(samples)

    def predict(self, batch: int) -> float | None:
        """The step time expected at ``batch`` (None: nothing measured yet).

        A measured size answers its median; between measured sizes the line between the
        neighbours; below the smallest, the smallest's time; above the largest, the line
        through the smallest and largest measured sizes (with one size measured: time
        proportional to the batch, a pessimistic guess that the first larger step corrects).
        """
        known = {size: statistics.median(samples) for size, samples in self._by_size.items()}
        if not known:
            return None
        if batch in known:
            return known[batch]
        sizes = sorted(known)
        low, high = sizes[0], sizes[-1]
        if batch < low:
            return known[low]
        if batch > high:
            if low == high:
                return known[high] * batch / high
            slope = max(0.0, (known[high] - known[low]) / (high - low))
            return known[high] + slope * (batch - high)
        below = max(size for size in sizes if size < batch)
        above = min(size for size in sizes if size > batch)
        share = (batch - below) / (above - below)
        return known[below] + share * (known[above] - known[below])


def tick_instant(
    clock: ChunkClock, now: float, want: float | None, *, served: float = float("-inf"), eager: bool = False
) -> float:
    """When a paced session should issue its next tick on ``clock``.

    ``want`` is when playback pacing would issue it (None: the first tick of a session
    or of an epoch); ``served`` is when the worker last took a batch. A first tick waits
    for the clock's next instant (at most one period: the joining session's phase shift).
    Later ticks go at the latest instant at or before ``want`` -- the same instant as
    every other session of the worker. When that instant has passed, the tick goes at
    once if it is ``eager`` (the lead chunk right after the first: the engine runs it if
    it fits in the idle time before the next instant) or if the instant in force has not
    had its batch yet (it joins that batch); else it waits for the next instant.
    """
    if want is None or not clock.started:
        return clock.next_slot(now)
    instant = clock.last_slot(want)
    if instant >= now:
        return instant
    if eager or served < clock.last_slot(now):
        return now
    return clock.after(now)
