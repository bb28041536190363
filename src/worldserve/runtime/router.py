"""Session routing: which worker holds each session's state (affinity) and how loaded each is.

Owns: ``session_id -> Route`` (the session's options, its worker, or why it holds no
state now: evicted, its worker died, released after a failure; and until when it is *in
use*: someone is playing it, so admission must not evict it), per-worker resident sets,
and the placement order for a new session (least loaded first). Pure bookkeeping: the
engine tells it what happened (and what time it is); it never calls a worker.

Must not know: asyncio, executors, batching, models.
"""

from __future__ import annotations

from collections.abc import Iterable

from worldserve.models.base import SessionOptions
from worldserve.runtime.errors import (
    SessionEvictedError,
    SessionNotResidentError,
    TickFailedError,
    UnknownSessionError,
    WorkerDiedError,
)

__all__ = ["Route", "Router"]


class Route:
    """One admitted session: its options (kept for resets) and where its state lives."""

    __slots__ = ("gone", "in_use_until", "options", "worker")

    def __init__(self, options: SessionOptions) -> None:
        self.options = options
        self.worker: int | None = None
        self.gone: TickFailedError | None = None  # why the session holds no state (worker None)
        self.in_use_until = float("-inf")  # monotonic time; never evicted before it

    def not_resident_error(self) -> TickFailedError:
        """A fresh error for a tick of a session that holds no state."""
        gone = self.gone
        if gone is None:
            return SessionNotResidentError("the session holds no state yet; reset it.")
        error = type(gone)(str(gone))
        error.code = gone.code
        return error


class Router:
    """Affinity and load of sessions over ``num_workers`` workers."""

    def __init__(self, num_workers: int) -> None:
        self._routes: dict[str, Route] = {}
        self._resident: list[set[str]] = [set() for _ in range(num_workers)]
        self._admitting = [0] * num_workers

    def __len__(self) -> int:
        return len(self._routes)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._routes

    @staticmethod
    def unknown(session_id: str) -> UnknownSessionError:
        return UnknownSessionError(
            f"session {session_id!r} was not admitted by this runtime; create sessions with "
            "Runtime.create_session (or Engine.add_session) before ticking them."
        )

    def find(self, session_id: str) -> Route | None:
        return self._routes.get(session_id)

    def add(self, session_id: str, options: SessionOptions) -> Route:
        route = Route(options)
        self._routes[session_id] = route
        return route

    def remove(self, session_id: str) -> Route | None:
        route = self._routes.pop(session_id, None)
        if route is not None and route.worker is not None:
            self._resident[route.worker].discard(session_id)
        return route

    # -- load and placement ------------------------------------------------------------

    def resident(self, worker: int) -> frozenset[str]:
        return frozenset(self._resident[worker])

    def resident_count(self, worker: int) -> int:
        return len(self._resident[worker])

    def load(self, worker: int) -> int:
        return len(self._resident[worker]) + self._admitting[worker]

    def placement_order(self, workers: Iterable[int]) -> list[int]:
        """Candidate workers for a new session, least loaded first (ties: lowest index)."""
        return sorted(workers, key=lambda worker: (self.load(worker), worker))

    def mark_in_use(self, session_id: str, until: float) -> None:
        """The session is in use until ``until`` (monotonic seconds; the past: not in use)."""
        route = self._routes.get(session_id)
        if route is not None:
            route.in_use_until = until

    def in_use(self, worker: int, now: float) -> frozenset[str]:
        """The sessions resident on ``worker`` that are in use at ``now``."""
        routes = self._routes
        return frozenset(sid for sid in self._resident[worker] if sid in routes and routes[sid].in_use_until > now)

    def begin_admission(self, worker: int) -> None:
        self._admitting[worker] += 1

    def end_admission(self, worker: int) -> None:
        self._admitting[worker] -= 1

    # -- what happened -------------------------------------------------------------------

    def placed(self, session_id: str, worker: int) -> None:
        """The session's state now lives on ``worker``."""
        route = self._routes.get(session_id)
        if route is None:
            return
        if route.worker is not None:
            self._resident[route.worker].discard(session_id)
        route.worker = worker
        route.gone = None
        self._resident[worker].add(session_id)

    def lost(self, session_id: str, worker: int, why: TickFailedError) -> bool:
        """The session's state on ``worker`` is gone; False if it was not there."""
        route = self._routes.get(session_id)
        if route is None or route.worker != worker:
            return False
        self._resident[worker].discard(session_id)
        route.worker = None
        route.gone = why
        return True

    def evicted(self, session_ids: Iterable[str], worker: int) -> None:
        for session_id in session_ids:
            self.lost(
                session_id,
                worker,
                SessionEvictedError(
                    f"session {session_id!r} was evicted from worker {worker} (not in use, least recently "
                    "used) to admit another session; reset it to start over."
                ),
            )

    def worker_died(self, worker: int, error: WorkerDiedError) -> tuple[str, ...]:
        """Every session of ``worker`` lost its state; returns their ids."""
        sessions = tuple(self._resident[worker])
        for session_id in sessions:
            self.lost(session_id, worker, error)
        self._admitting[worker] = 0
        return sessions

    def released(self, session_id: str, why: str) -> int | None:
        """The session's state was released on purpose (closed or failed); returns its old worker."""
        route = self._routes.get(session_id)
        if route is None or route.worker is None:
            return None
        worker = route.worker
        self.lost(session_id, worker, SessionNotResidentError(why))
        return worker
