"""Draining a front-end before it stops (a deploy, a restart): admit no more, let its worlds run out.

A world cannot move to another front-end today: its state (a model's K/V cache) lives on the worker
that made it, and a front-end's workers are its own (in its process, its child processes, or Ray
actors that fate-share with it). So a drain gives what it can without moving one: from the moment it
begins, no start is admitted (each is refused ``admission_refused`` with a retry hint, so a client
retries through the balancer and lands on another front-end; those waiting in line first), ``/healthz``
answers 503 ``draining`` so a balancer that checks it stops sending new players, while every world
already here goes on as before (resumes and joins included) until it ends or ``timeout_s`` passes;
the front-end then stops, ending the worlds still left with ``session.closed {reason: "shutdown"}``.

Owns: :class:`Drain` (whether, since when, why, and whether it is over).
Must not know: uvicorn, signals, sockets (the server's loop asks :meth:`Drain.over`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from worldserve.server.waiting import WaitingRoom

__all__ = ["Drain"]

_log = logging.getLogger("worldserve.server")


class Drain:
    """One front-end's drain: begun once (by SIGTERM or ``POST /admin/drain``), over when no world is
    left or ``timeout_s`` passed."""

    def __init__(
        self,
        timeout_s: float,
        room: WaitingRoom[Any],
        worlds: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be non-negative; got {timeout_s!r}.")
        self.timeout_s = timeout_s
        self._room = room
        self._worlds = worlds
        self._clock = clock
        self.began: float | None = None
        self.why = ""

    @property
    def draining(self) -> bool:
        return self.began is not None

    def begin(self, why: str) -> bool:
        """Stop admitting now (``why``: what asked, for the log and ``/healthz``); False if already draining."""
        if self.began is not None:
            return False
        self.began, self.why = self._clock(), why
        self._room.stop_admitting(
            "this front-end is draining (it is about to restart): start again, and another front-end takes it."
        )
        _log.warning(
            "draining (%s): no more starts; %d world(s) go on for up to %g s (--drain-timeout-s)",
            why,
            self._worlds(),
            self.timeout_s,
        )
        return True

    def over(self) -> bool:
        """Draining, and no world is left or the time is up."""
        if self.began is None:
            return False
        return self._worlds() == 0 or self._clock() - self.began >= self.timeout_s

    def health(self) -> dict[str, Any]:
        if self.began is None:
            return {"draining": False}
        left = max(0.0, self.timeout_s - (self._clock() - self.began))
        return {"draining": True, "why": self.why, "worlds": self._worlds(), "left_s": round(left, 1)}
