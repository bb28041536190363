"""``worldserve replay``: regenerate a journaled session's frames through the normal runtime.

Owns: turning a journal (:mod:`worldserve.runtime.journal`) back into a session -- the
same model and model options, the same start options, then for each logged chunk one
event carrying that chunk's whole snapshot (prompt and controls) and one ``next_chunk``;
a logged chunk 0 after the first is a reset -- and checking that the regenerated chunks
have the logged indexes. The frames are bit-exact on the same machine at the same
precision for models whose frames depend only on their inputs (the procedural world,
tinyworld in float32); where the precision or batch arithmetic differs (tinyworld in
bfloat16, whose kernels block differently by batch size), within that model's stated
tolerance.

Must not know: transports, the engine's internals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worldserve.runtime.config import RuntimeConfig
from worldserve.runtime.journal import Journal, JournalStart, read_journal
from worldserve.runtime.runtime import Runtime
from worldserve.session import SessionEvent

__all__ = ["Replay", "replay"]


@dataclass(frozen=True)
class Replay:
    """A replayed session: its frames ``uint8 [chunks * frames_per_chunk, H, W, 3]`` and what served it."""

    frames: npt.NDArray[np.uint8]
    start: JournalStart
    chunks: int
    model_version: str
    precision: str

    @property
    def same_model(self) -> bool:
        """Whether the replay ran the journaled model version at the journaled precision."""
        return (self.model_version, self.precision) == (self.start.model_version, self.start.precision)


async def replay(journal: str | Path | Journal, *, config: RuntimeConfig | None = None, **overrides: Any) -> Replay:
    """Replay a journal (or the one at a path: what :func:`read_journal` keeps of it, its warnings
    aside); ``config``/``overrides`` are the runtime's (model and model options default to the
    journal's)."""
    read = journal if isinstance(journal, Journal) else read_journal(journal)
    start, chunks = read.start, read.chunks
    base = config or RuntimeConfig(model=start.model, model_options=start.model_options, workers=1)
    runtime_config = dataclasses.replace(base, record_dir=None, **overrides)
    frames: list[npt.NDArray[np.uint8]] = []
    async with Runtime(config=runtime_config) as runtime:
        spec = runtime.spec
        if spec.name != start.model:
            raise ValueError(f"the journal was made by model {start.model!r}; this runtime serves {spec.name!r}.")
        options = start.options
        session = await runtime.create_session(
            prompt=options.prompt, seed=options.seed, image=options.image, references=options.references
        )
        event_id = 0
        for index, logged in enumerate(chunks):
            if logged.chunk_index == 0 and index > 0:
                await session.reset()
            elif logged.chunk_index != session.chunk_index:
                raise ValueError(
                    f"journal chunk {index} has index {logged.chunk_index}; the replay is at {session.chunk_index}."
                )
            if logged.prompt != session.prompt or logged.controls != session.controls:
                event_id += 1
                await session.accept_event(SessionEvent(event_id, prompt=logged.prompt, controls=logged.controls))
            chunk = await session.next_chunk()
            frames.append(chunk.array())
        await runtime.close_session(session.session_id)
    shape = (0, spec.height, spec.width, 3)
    stacked = np.concatenate(frames) if frames else np.zeros(shape, np.uint8)
    return Replay(stacked, start, len(chunks), spec.version, spec.precision)
