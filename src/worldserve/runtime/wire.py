"""Compact, trusted encodings of ticks and chunk metadata for the worker pipe.

Owns: turning :class:`~worldserve.protocol.TickRequest` (with its
:class:`~worldserve.protocol.ControlInput` s) and
:class:`~worldserve.protocol.ChunkMetadata` into tuples of plain values and back. A
frozen dataclass pickles through ``__getstate__``/``__setstate__`` at ~2.5 us a tick each
way; tuples take ~0.2 us. Decoding trusts its input: both ends of the pipe are this
runtime, and every value was validated when it was first built. The field lists come
from the dataclasses themselves, so a field added to the contract travels too.

Must not know: what ticks mean, executors, sessions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from worldserve.protocol import ChunkMetadata, ControlInput, TickRequest

__all__ = ["decode_metadata", "decode_ticks", "encode_metadata", "encode_ticks"]

_TICK_FIELDS = tuple(field.name for field in dataclasses.fields(TickRequest))
_CONTROL_FIELDS = tuple(field.name for field in dataclasses.fields(ControlInput))
_METADATA_FIELDS = tuple(field.name for field in dataclasses.fields(ChunkMetadata))
_CONTROLS_AT = _TICK_FIELDS.index("controls")

T = TypeVar("T")


def _trusted(cls: type[T], names: tuple[str, ...], values: Sequence[Any]) -> T:
    instance = object.__new__(cls)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(instance, name, value)
    return instance


def encode_ticks(ticks: Sequence[TickRequest]) -> list[tuple[Any, ...]]:
    rows = []
    for tick in ticks:
        row = [getattr(tick, name) for name in _TICK_FIELDS]
        row[_CONTROLS_AT] = tuple(
            tuple(getattr(control, name) for name in _CONTROL_FIELDS) for control in tick.controls
        )
        rows.append(tuple(row))
    return rows


def decode_ticks(rows: Sequence[tuple[Any, ...]]) -> list[TickRequest]:
    ticks = []
    for row in rows:
        values = list(row)
        values[_CONTROLS_AT] = tuple(_trusted(ControlInput, _CONTROL_FIELDS, control) for control in row[_CONTROLS_AT])
        ticks.append(_trusted(TickRequest, _TICK_FIELDS, values))
    return ticks


def encode_metadata(metadata: ChunkMetadata) -> tuple[Any, ...]:
    return tuple(getattr(metadata, name) for name in _METADATA_FIELDS)


def decode_metadata(row: Sequence[Any]) -> ChunkMetadata:
    return _trusted(ChunkMetadata, _METADATA_FIELDS, row)
