"""What the engine hands the control plane for one tick: a small, frozen, sendable chunk.

Owns: :class:`Chunk` -- the frames (``uint8 [frames, H, W, 3]``, read-only; or, for a
session created with an encoding, :class:`~worldserve.media.EncodedFrames` the worker
made), the :class:`~worldserve.protocol.ChunkMetadata` the model echoed, and where the
time went (queued in the engine, computing in ``model.step``, encoding in the worker,
the round trip to the worker).

Must not know: how it was computed, transports, sessions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worldserve.media import EncodedFrames
from worldserve.protocol import ChunkMetadata

__all__ = ["Chunk"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One generated AR block of one session.

    ``queued_s``: from the tick's arrival at the engine to its dispatch (waiting for
    company or for the worker); ``compute_s``: the worker's ``model.step`` for the whole
    batch; ``roundtrip_s``: from dispatch to the result back on the event loop;
    ``encode_s``: the worker's encoding of the whole batch's frames (0 when it sent arrays).
    ``frames`` is an array unless the session was created with an encoding that the
    runtime has its workers apply (see :attr:`RuntimeConfig.encode_frames
    <worldserve.runtime.RuntimeConfig.encode_frames>`); :meth:`array` asserts the former.
    """

    frames: npt.NDArray[np.uint8] | EncodedFrames
    metadata: ChunkMetadata
    worker: int
    batch_size: int
    queued_s: float
    compute_s: float
    roundtrip_s: float
    encode_s: float = 0.0

    def array(self) -> npt.NDArray[np.uint8]:
        """The frames as an array; raises ``TypeError`` if the worker handed them back encoded."""
        if not isinstance(self.frames, np.ndarray):
            raise TypeError("this chunk's frames were encoded by the worker; create the session without an encoding.")
        return self.frames

    @property
    def latency_s(self) -> float:
        """The tick's time in the engine: queued plus the round trip."""
        return self.queued_s + self.roundtrip_s

    @property
    def overhead_s(self) -> float:
        """The engine's own cost for this tick's batch: IPC, pickling, wake-ups (not compute nor encoding)."""
        return max(0.0, self.roundtrip_s - self.compute_s - self.encode_s)
