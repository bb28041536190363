"""Per-connection rate limiting: a token bucket.

Must not know: sockets, messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """Allows ``burst`` actions at once and ``rate`` per second on average."""

    __slots__ = ("_clock", "_rate", "_size", "_stamp", "_tokens")

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._size = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._stamp = clock()

    def take(self) -> bool:
        """Spend one token if there is one; False means: over the limit, refuse."""
        now = self._clock()
        self._tokens = min(self._size, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
