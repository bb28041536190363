"""Session journals: a small JSON Lines log of what a session's chunks applied, for exact replay.

Owns: the journal format (one file per session, ``<dir>/<session_id>.jsonl``), writing it
(:class:`Journals`, a :class:`~worldserve.session.TickConsumer` that sits in front of the
engine and logs each tick whose chunk came back for it) and reading it back
(:func:`read_journal`). No frames are logged: a chunk's frames follow from the model, the
session's start options and the sequence of applied snapshots, so a journal of an hour of
play is a few hundred kilobytes.

Lines, each a JSON object with a ``type``:

- ``start``: ``session_id``, ``model`` (name), ``model_version``, ``precision``,
  ``model_options`` (those the runtime was started with), ``options`` (``prompt``, ``seed``,
  ``image``: base64 raw RGB or null), ``frames_per_chunk``, ``fps``, ``worldserve`` (version);
- ``chunk``: ``chunk_index``, ``applied_event_ids``, ``prompt``, ``controls`` (the whole
  snapshot the chunk was made under: ``[{track, schema, data}]``), ``request_id``; a
  ``chunk_index`` of 0 after the first chunk means the session was reset before it;
- ``close``: the session closed.

A line is written once the chunk's metadata echoed its tick (the commit follows at once).
Must not know: transports, what a model computes, how the engine schedules.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from worldserve.models.base import ModelSpec, SessionOptions
from worldserve.protocol import ChunkMetadata, ControlInput, TickRequest
from worldserve.runtime.chunk import Chunk
from worldserve.session import TickConsumer

__all__ = ["JournalChunk", "JournalStart", "Journals", "read_journal"]

_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True, slots=True)
class JournalStart:
    """How the journaled session started and what served it."""

    session_id: str
    model: str
    model_version: str
    precision: str
    model_options: dict[str, Any]
    options: SessionOptions
    frames_per_chunk: int
    fps: float


@dataclass(frozen=True, slots=True)
class JournalChunk:
    """One committed chunk's snapshot."""

    chunk_index: int
    applied_event_ids: tuple[int, ...]
    prompt: str | None
    controls: tuple[ControlInput, ...]


class Journals:
    """Writes one journal per session into ``directory``; the engine's tick consumer, wrapped."""

    def __init__(
        self, directory: str | Path, engine: TickConsumer[Chunk], spec: ModelSpec, model_options: dict[str, Any]
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._engine = engine
        self._spec = spec
        self._model_options = model_options
        self._files: dict[str, IO[str]] = {}

    def path(self, session_id: str) -> Path:
        """Where ``session_id``'s journal is written."""
        if not _SAFE_ID.fullmatch(session_id):
            raise ValueError(f"session id {session_id!r} cannot name a journal file.")
        return self.directory / f"{session_id}.jsonl"

    def open(self, session_id: str, options: SessionOptions) -> None:
        """Start ``session_id``'s journal with its start line."""
        handle = self.path(session_id).open("w", encoding="utf-8")
        self._files[session_id] = handle
        image = None if options.image is None else base64.b64encode(options.image).decode("ascii")
        from worldserve import __version__

        self._write(
            handle,
            {
                "type": "start",
                "session_id": session_id,
                "model": self._spec.name,
                "model_version": self._spec.version,
                "precision": self._spec.precision,
                "model_options": self._model_options,
                "options": {"prompt": options.prompt, "seed": options.seed, "image": image},
                "frames_per_chunk": self._spec.frames_per_chunk,
                "fps": self._spec.fps,
                "worldserve": __version__,
            },
        )

    def close(self, session_id: str) -> None:
        handle = self._files.pop(session_id, None)
        if handle is not None:
            self._write(handle, {"type": "close"})
            handle.close()

    def close_all(self) -> None:
        for session_id in list(self._files):
            self.close(session_id)

    # -- the TickConsumer ----------------------------------------------------------------

    async def execute_tick(self, tick: TickRequest) -> Chunk:
        chunk = await self._engine.execute_tick(tick)
        handle = self._files.get(tick.session_id)
        if handle is not None and chunk.metadata == ChunkMetadata.from_tick(tick):
            self._write(
                handle,
                {
                    "type": "chunk",
                    "chunk_index": tick.chunk_index,
                    "applied_event_ids": list(tick.applied_event_ids),
                    "prompt": tick.prompt,
                    "controls": [control.to_dict() for control in tick.controls],
                    "request_id": tick.request_id,
                },
            )
        return chunk

    def chunk_metadata(self, output: Chunk) -> ChunkMetadata:
        return self._engine.chunk_metadata(output)

    @staticmethod
    def _write(handle: IO[str], line: dict[str, Any]) -> None:
        handle.write(json.dumps(line, separators=(",", ":")) + "\n")
        handle.flush()


def read_journal(path: str | Path) -> tuple[JournalStart, list[JournalChunk]]:
    """Read a journal back; ``ValueError`` names the line that is not one."""
    lines = list(_lines(Path(path)))
    if not lines or lines[0][1].get("type") != "start":
        raise ValueError(f"{path}: a journal starts with a 'start' line.")
    number, first = lines[0]
    try:
        options = first["options"]
        image = options.get("image")
        start = JournalStart(
            session_id=str(first["session_id"]),
            model=str(first["model"]),
            model_version=str(first.get("model_version", "")),
            precision=str(first.get("precision", "")),
            model_options=dict(first.get("model_options") or {}),
            options=SessionOptions(
                prompt=options.get("prompt"),
                seed=int(options.get("seed", 0)),
                image=None if image is None else base64.b64decode(image),
            ),
            frames_per_chunk=int(first["frames_per_chunk"]),
            fps=float(first["fps"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}:{number}: not a start line ({error}).") from None
    chunks = []
    for number, line in lines[1:]:
        kind = line.get("type")
        if kind == "close":
            break
        if kind != "chunk":
            raise ValueError(f"{path}:{number}: unknown line type {kind!r}.")
        try:
            chunks.append(
                JournalChunk(
                    chunk_index=int(line["chunk_index"]),
                    applied_event_ids=tuple(int(event_id) for event_id in line["applied_event_ids"]),
                    prompt=line["prompt"],
                    controls=tuple(ControlInput.from_dict(control) for control in line["controls"]),
                )
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{number}: not a chunk line ({error}).") from None
    return start, chunks


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error}).") from None
            if not isinstance(value, dict):
                raise ValueError(f"{path}:{number}: a line must be a JSON object.")
            yield number, value
