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
  ``image``: base64 raw RGB or null; ``references``: the reference images, base64 raw RGB each, in
  the model's slot order, absent or empty for none), ``frames_per_chunk``, ``fps``, ``worldserve`` (version);
- ``chunk``: ``chunk_index``, ``applied_event_ids``, ``prompt``, ``controls`` (the whole
  snapshot the chunk was made under: ``[{track, schema, data}]``), ``request_id``; a
  ``chunk_index`` of 0 after the first chunk means the session was reset before it;
- ``retract``: ``chunk_index``, ``request_id``: the chunk logged last was undone (a
  preemption: it was made again with newer input, logged next); it was never shown as made,
  so replay leaves it out;
- ``close``: the session closed.

``applied_event_ids`` are the *session's* event ids: the server maps each member's wire ids
(each connection numbers its own events) to the session's one increasing sequence, so they
are no client's ids; replay does not need them (it replays each chunk's snapshot).

A line is written once the chunk's metadata echoed its tick (the commit follows at once),
and flushed. A server that dies leaves a journal without a close line, perhaps with its
last line cut off: :func:`read_journal` keeps every complete line and says what is missing
(:attr:`Journal.warnings`); a bad line anywhere else is refused, naming it.
Must not know: transports, what a model computes, how the engine schedules.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from worldserve.errors import CancelUnsupportedError
from worldserve.models.base import ModelSpec, SessionOptions
from worldserve.protocol import ChunkMetadata, ControlInput, TickRequest
from worldserve.runtime.chunk import Chunk
from worldserve.session import TickConsumer

__all__ = ["Journal", "JournalChunk", "JournalStart", "Journals", "read_journal"]

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


@dataclass(frozen=True, slots=True)
class Journal:
    """A journal read back: how the session started, its chunks, and what a reader should know
    (the journal ended without a close line, or its last line was cut off)."""

    start: JournalStart
    chunks: list[JournalChunk]
    warnings: tuple[str, ...] = ()
    #: Chunks the session undid and made again (``retract`` lines); ``chunks`` holds only their replacements.
    retracted: int = 0

    @property
    def complete(self) -> bool:
        """Whether the journal ends with the session's close line (and nothing was cut off)."""
        return not self.warnings


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
                "options": {
                    "prompt": options.prompt,
                    "seed": options.seed,
                    "image": image,
                    "references": [base64.b64encode(blob).decode("ascii") for blob in options.references],
                },
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

    def cancel_tick(self, tick: TickRequest) -> None:
        """``chunk.cancel`` goes through to the engine (a :class:`~worldserve.session.TickCanceller`):
        the cancelled tick's ``execute_tick`` raises, so its chunk is never logged, and the
        journal goes on from the last chunk logged, as the session does."""
        cancel = getattr(self._engine, "cancel_tick", None)
        if not callable(cancel):
            raise CancelUnsupportedError("the runtime behind this journal cannot cancel a chunk.")
        cancel(tick)

    async def retract_tick(self, tick: TickRequest) -> None:
        """A preemption undoes the last chunk (a :class:`~worldserve.session.TickRetracter`): once the
        engine did, a ``retract`` line says so, so replay leaves that chunk out."""
        retract = getattr(self._engine, "retract_tick", None)
        if not callable(retract):
            raise CancelUnsupportedError("the runtime behind this journal cannot undo a chunk.")
        await retract(tick)
        handle = self._files.get(tick.session_id)
        if handle is not None:
            self._write(handle, {"type": "retract", "chunk_index": tick.chunk_index, "request_id": tick.request_id})

    @staticmethod
    def _write(handle: IO[str], line: dict[str, Any]) -> None:
        handle.write(json.dumps(line, separators=(",", ":")) + "\n")
        handle.flush()


def read_journal(path: str | Path) -> Journal:
    """Read a journal back; ``ValueError`` names the line that is not one (``OSError``: no file).

    A last line cut off mid-write (no newline, not JSON: the writer died) is left out with a
    warning, as is a missing close line; the complete lines before it replay as they are.
    """
    lines, cut = _lines(Path(path))
    if not lines:
        raise ValueError(
            f"{path}: {'empty' if cut is None else 'cut off in its first line'}: a journal starts with a 'start' line."
        )
    if lines[0][1].get("type") != "start":
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
                references=tuple(base64.b64decode(blob) for blob in options.get("references") or ()),
            ),
            frames_per_chunk=int(first["frames_per_chunk"]),
            fps=float(first["fps"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{path}:{number}: not a start line ({error}).") from None
    chunks: list[JournalChunk] = []
    retracted = 0
    closed = False
    for number, line in lines[1:]:
        kind = line.get("type")
        if kind == "close":
            closed = True
            break
        if kind == "retract":
            if not chunks or line.get("chunk_index") != chunks[-1].chunk_index:
                raise ValueError(f"{path}:{number}: a retract line that does not undo the chunk logged before it.")
            chunks.pop()
            retracted += 1
            continue
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
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{path}:{number}: not a chunk line ({error}).") from None
    warnings = []
    if cut is not None:
        warnings.append(
            f"{path}:{cut}: the last line is cut off (the server stopped while writing it); "
            f"replaying the {len(chunks)} complete chunk lines before it"
        )
    elif not closed:
        warnings.append(
            f"{path}: no close line (the server stopped, or the session was still open): "
            f"replaying its {len(chunks)} chunks"
        )
    return Journal(start, chunks, tuple(warnings), retracted)


def _lines(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], int | None]:
    """The journal's lines as objects, and the number of a last line cut off mid-write (None: none)."""
    with path.open(encoding="utf-8") as handle:
        texts = handle.read().split("\n")
    # Every line the writer finished ends in a newline, so what follows the last one is a cut line.
    tail = texts.pop()
    lines: list[tuple[int, dict[str, Any]]] = []
    for number, text in enumerate(texts, start=1):
        if text.strip():
            lines.append((number, _parse_line(path, number, text)))
    cut = None
    if tail.strip():
        number = len(texts) + 1
        try:
            lines.append((number, _parse_line(path, number, tail)))
        except ValueError:
            cut = number
    return lines, cut


def _parse_line(path: Path, number: int, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: not JSON ({error}).") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{number}: a line must be a JSON object.")
    return value
