"""Tick gathering on one worker: its chunk clock and what it knows of the sessions paced on it.

Owns: one worker's :class:`~worldserve.runtime.clock.ChunkClock` and
:class:`~worldserve.runtime.clock.StepTimes`, a record per paced session (when it last
asked for an instant, its slack, the instant its next tick is due at), when the worker
last took a batch and when its last step ended, and from these when the worker's next
batch is due (:meth:`~worldserve.runtime.scheduler.BatchQueue.clocked_due_at`).

Why a guess: a session whose chunk comes back asks for its next instant only after its
connection committed the chunk, a few ms later. A step that ends just before, or
after, an instant would otherwise let that instant's batch go without the session; its
tick would wait for the next instant, and the session would lose its lead for good
(each later chunk ready just as it plays, late on any noise). So when a step ends, the
engine guesses the instant each of its sessions will ask for, and the instant's batch
waits for them (at most ``gather_wait_s`` after the step ended) until they ask.

Pure: the engine calls it with the event loop's time, the simulation in
``tests/test_clock.py`` with simulated time. Must not know: asyncio, executors,
sessions' logic, models.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from worldserve.runtime.clock import ChunkClock, StepTimes, tick_instant
from worldserve.runtime.scheduler import BatchQueue

__all__ = ["Gathering"]


@dataclass(slots=True)
class _Pacer:
    """What a worker's clock knows of one session paced on it."""

    asked: float  # when it last asked for an instant
    slack: float | None  # its chunk's playout instant minus its tick's instant (None: not told)
    instant: float | None  # the instant its next tick is due at (None: it arrived)
    guessed: bool = False  # ``instant`` is a guess: the session has not asked yet


class Gathering:
    """One worker's chunk clock, step times and paced sessions."""

    __slots__ = ("_pacers", "clock", "freed", "served", "steps")

    def __init__(self, period: float) -> None:
        self.clock = ChunkClock(period)  # runs once a paced session asks for an instant
        self.steps = StepTimes()  # dispatch -> results, per batch size
        self.served = float("-inf")  # when the worker last took a batch
        self.freed = float("-inf")  # when its last step ended
        self._pacers: dict[str, _Pacer] = {}

    def ask(
        self, session_id: str, now: float, want: float | None, *, eager: bool, due: float | None, alone: bool
    ) -> tuple[float, bool]:
        """The instant for a session's next tick (:func:`~worldserve.runtime.clock.tick_instant`),
        and whether a batch may have been waiting for this session (schedule again).

        ``alone``: no other session is resident on the worker; a first tick (``want``
        None) then starts the clock over from now unless another session is due.
        """
        others_due = any(
            pacer.instant is not None and not pacer.guessed for sid, pacer in self._pacers.items() if sid != session_id
        )
        if want is None and alone and not others_due:
            self.clock = ChunkClock(self.clock.nominal)
        instant = tick_instant(self.clock, now, want, served=self.served, eager=eager)
        previous = self._pacers.get(session_id)
        # a lead chunk's instant is "now", not one of the clock's: it tells no slack
        self._pacers[session_id] = _Pacer(now, None if due is None or eager else due - instant, instant)
        return instant, previous is not None and previous.guessed and previous.instant is not None

    def arrived(self, session_id: str) -> None:
        """The session's tick reached the worker's queue."""
        pacer = self._pacers.get(session_id)
        if pacer is not None:
            pacer.instant, pacer.guessed = None, False

    def taken(self, now: float) -> None:
        """The worker took a batch."""
        self.served = now

    def step_done(self, session_ids: Iterable[str], seconds: float | None, now: float) -> None:
        """A step ended (``seconds`` from dispatch; None: it failed): measure it, follow the
        period, and guess the instant its sessions will ask for next."""
        self.freed = now
        if seconds is None:
            return
        session_ids = list(session_ids)
        self.steps.observe(len(session_ids), seconds)
        if not self.clock.started:
            return
        predicted = self.steps.predict(max(len(session_ids), self.pacing(now)[0]))
        if predicted is not None:
            self.clock.stretch(predicted, now)
        instant = self.clock.last_slot(now)
        guess = instant if self.served < instant else self.clock.after(now)
        for session_id in session_ids:
            pacer = self._pacers.get(session_id)
            if pacer is not None:
                pacer.instant, pacer.guessed = guess, True

    def pacing(self, now: float) -> tuple[int, float | None]:
        """The sessions paced on the clock lately (asked within two periods: a session held back by its
        client's acks does not count) and the least of their slacks (None: none told)."""
        horizon = now - 2 * self.clock.period
        for session_id in [sid for sid, pacer in self._pacers.items() if pacer.asked < horizon]:
            del self._pacers[session_id]
        slacks = [pacer.slack for pacer in self._pacers.values() if pacer.slack is not None]
        return len(self._pacers), min(slacks, default=None)

    def waiting_for(self, now: float) -> int:
        """Sessions due at an instant up to ``now`` whose tick has not arrived (asked for, or
        guessed; a guess lapses once its instant's batch has gone). Records of sessions that
        stopped asking are dropped by :meth:`pacing`, which :meth:`batch_due` calls first."""
        count = 0
        for pacer in self._pacers.values():
            if pacer.guessed and pacer.instant is not None and pacer.instant <= self.served:
                pacer.instant, pacer.guessed = None, False
            if pacer.instant is not None and pacer.instant <= now + 1e-6:
                count += 1
        return count

    def batch_due(self, queue: BatchQueue[Any], resident: int, now: float, gather_wait_s: float) -> float | None:
        """When the worker (idle, its clock running) should take a batch from ``queue``."""
        queued = len(queue)
        paced, slack = self.pacing(now)
        return queue.clocked_due_at(
            resident,
            now=now,
            clock=self.clock,
            served=self.served,
            waiting_for=self.waiting_for(now),
            gather_wait_s=gather_wait_s,
            step_s=self.steps.predict(queued) if queued else None,
            instant_step_s=self.steps.predict(max(paced, 1)),
            slack_s=slack,
            freed=self.freed,
        )

    def forget(self, session_id: str) -> None:
        self._pacers.pop(session_id, None)

    def clear(self) -> None:
        """The worker died: its sessions are gone."""
        self._pacers.clear()
