"""Continuous batching for one worker: which queued ticks run together, and when.

Owns: a worker's queue of ticks waiting for dispatch (in arrival order) and the rule
that forms a batch. While the worker computes, ticks pile up and go together the
moment it is free. When it is idle, a batch goes at once if it is full (the batch
limit) or complete (every session resident on the worker has a tick queued); else it
waits for company at most ``batch_wait_s`` after its oldest tick arrived.

On a worker whose :class:`~worldserve.runtime.clock.ChunkClock` runs (its sessions
issue their ticks at its instants), :meth:`BatchQueue.clocked_due_at` applies instead:
the batch of an instant goes once every session due at it has arrived (at most
``gather_wait_s`` after the instant, or after the worker's last step ended if that ran
past it). A tick off the instants (a joiner's first chunk,
its lead chunk, a straggler) runs at once if it ends before the next instant, or if
the next instant's batch, started after it, still ends before the earliest playout
instant of its chunks (pacing issues a tick at least one period before its chunk
plays, so this costs that batch slack, not lateness); else it waits for that instant's
batch, and falls back in phase instead of pushing everyone's next batch late.

Pure: the caller passes the time, the clock and the worker's counts. Must not know:
asyncio, executors, sessions' logic, models.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from worldserve.runtime.clock import ChunkClock

__all__ = ["BatchQueue", "Queued"]

T = TypeVar("T")


class Queued(Generic[T]):
    """One waiting item and when it arrived (the caller's clock)."""

    __slots__ = ("arrived", "item")

    def __init__(self, item: T, arrived: float) -> None:
        self.item = item
        self.arrived = arrived


class BatchQueue(Generic[T]):
    """The ticks waiting for one worker."""

    def __init__(self, *, batch_limit: int, batch_wait_s: float) -> None:
        if batch_limit < 1:
            raise ValueError(f"batch_limit must be at least 1; got {batch_limit!r}.")
        if not batch_wait_s >= 0:
            raise ValueError(f"batch_wait_s must be non-negative; got {batch_wait_s!r}.")
        self.batch_limit = batch_limit
        self.batch_wait_s = batch_wait_s
        self._queue: deque[Queued[T]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Queued[T]]:
        return iter(self._queue)

    def push(self, item: T, now: float) -> Queued[T]:
        entry = Queued(item, now)
        self._queue.append(entry)
        return entry

    def discard(self, entry: Queued[T]) -> bool:
        """Drop a waiting entry (its tick expired or was cancelled); False if not waiting."""
        try:
            self._queue.remove(entry)
        except ValueError:
            return False
        return True

    def due_at(self, resident: int) -> float | None:
        """When an idle worker should take a batch: ``-inf`` now, a time, or None (empty)."""
        queue = self._queue
        if not queue:
            return None
        if len(queue) >= self.batch_limit or len(queue) >= resident:
            return float("-inf")
        return queue[0].arrived + self.batch_wait_s

    def clocked_due_at(
        self,
        resident: int,
        *,
        now: float,
        clock: ChunkClock,
        served: float,
        waiting_for: int,
        gather_wait_s: float,
        step_s: float | None,
        instant_step_s: float | None = None,
        slack_s: float | None = None,
        freed: float = float("-inf"),
    ) -> float | None:
        """When an idle worker on ``clock`` should take a batch: ``-inf`` now, a time, or None.

        ``served``: when the worker last took a batch; ``waiting_for``: sessions due at an
        instant up to ``now`` whose tick has not arrived; ``step_s``: the predicted step
        time of the queued ticks, ``instant_step_s`` that of an instant's batch (every
        session resident on the worker); None: unknown. ``slack_s``: how long after its
        instant an instant's batch may end with every chunk still ready by its playout
        instant (the least of the sessions'; None: one period, what pacing guarantees).
        ``freed``: when the worker's last step ended; an instant's batch waits for its
        sessions at most ``gather_wait_s`` after the instant or after that, whichever is
        later (a step that ran past the instant held its sessions' next ticks back).
        """
        queue = self._queue
        if not queue:
            return None
        if len(queue) >= self.batch_limit or len(queue) >= resident:
            return float("-inf")
        instant = clock.last_slot(now)
        if served < instant:  # this instant's batch has not gone: it forms now
            if waiting_for <= 0:
                return float("-inf")
            return max(instant, queue[0].arrived, freed) + gather_wait_s
        following = clock.after(now)
        slack = clock.period if slack_s is None else slack_s
        if step_s is None or _fits_before(now + step_s, following, slack, instant_step_s):
            return queue[0].arrived + self.batch_wait_s
        return following

    def take(self) -> list[Queued[T]]:
        """Remove and return the next batch (oldest first, at most ``batch_limit``)."""
        queue = self._queue
        return [queue.popleft() for _ in range(min(len(queue), self.batch_limit))]

    def drain(self) -> list[Queued[T]]:
        """Remove and return everything waiting."""
        entries = list(self._queue)
        self._queue.clear()
        return entries


def _fits_before(end: float, instant: float, slack: float, instant_step_s: float | None) -> bool:
    """Whether a step ending at ``end`` leaves the batch of ``instant`` time to end within ``slack`` of it."""
    if end <= instant:
        return True  # it ends in the idle time before the instant
    return instant_step_s is not None and end + instant_step_s <= instant + slack
