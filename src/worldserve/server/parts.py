"""A world's chunk in flight, sent in parts: to whom, under which seq, and when each part went.

Owns: :class:`PartsOut`, the record of one chunk whose frames the world sends as its worker makes
them (``session.start``'s ``options.parts``, a model with ``spec.frame_parts``): the epoch and
chunk index it belongs to, the seq the chunk will be sent under (the world's next: nothing else is
sent while a tick is in flight), the connections that took its first part (only they are sent the
rest, and only they get the chunk without the frames they have), the frames and payloads sent so far
and when each part went: :meth:`PartsOut.playable`, the earliest instant the chunk's first frame
can be shown with none of its frames late, which the pacing takes for the chunk's readiness when
every connected member takes parts.

Pure: the caller passes the time. Must not know: sockets, sessions, the runtime, message types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PartsOut"]


@dataclass(slots=True)
class PartsOut:
    """The parts of one chunk sent so far (see the module docstring)."""

    epoch: int
    chunk_index: int
    #: The world's seq the chunk will be sent under (members add their own base).
    seq: int
    #: The connections that took the first part (compared by identity: a resumed member's new one did not).
    outlets: tuple[object, ...]
    sent: int = 0  # frames sent
    payloads: list[bytes] = field(default_factory=list)  # their payloads, in order
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (when a part went, its first frame)

    def took(self, outlet: object) -> bool:
        """Whether ``outlet`` was sent the parts."""
        return any(taker is outlet for taker in self.outlets)

    def add(self, at: float, first: int, payloads: tuple[bytes, ...]) -> bool:
        """A part of frames ``first`` .. went at ``at``; False (nothing kept) when it does not follow the last."""
        if first != self.sent:
            return False
        self.arrivals.append((at, first))
        self.payloads.extend(payloads)
        self.sent += len(payloads)
        return True

    def playable(self, fps: float) -> float:
        """The earliest instant the chunk's first frame could be shown with no frame of it late: each part's
        frames are due ``first / fps`` after the first frame, and can be shown only once sent."""
        if not self.arrivals:
            raise ValueError("no part was sent.")
        return max(at - first / fps for at, first in self.arrivals)
