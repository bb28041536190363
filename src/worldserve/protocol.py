"""The typed tick contract: immutable values that cross every boundary.

Owns: :class:`ControlInput` (one model-defined control track), :class:`TickRequest`
(one AR block for one session), :class:`ChunkMetadata` (what a model echoes back),
the deep-freezing of JSON-like control data, and the two wire encodings shared with
vllm-omni (the ``extra_args`` key and the chunk output envelope).

Must not know: sessions, queues, sockets, tensors or what a control means.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, NoReturn

__all__ = [
    "CHUNK_METADATA_KEY",
    "HELD_KEYS_SCHEMA_NAME",
    "PROMPT_TRANSITION_SCHEMA_NAME",
    "PROMPT_TRANSITION_TRACK",
    "TICK_EXTRA_ARGS_KEY",
    "ChunkMetadata",
    "ControlInput",
    "FrozenMap",
    "TickRequest",
    "build_chunk_envelope",
    "freeze_transport_value",
    "held_keys",
    "parse_chunk_envelope",
    "prompt_transition_control",
    "transition_chunks_control",
    "thaw_transport_value",
]

#: ``extra_args`` key under which vllm-omni carries a serialized tick.
TICK_EXTRA_ARGS_KEY = "ar_diffusion_tick"
#: Key of the chunk identity inside an output envelope's ``metadata`` mapping.
CHUNK_METADATA_KEY = "ar_diffusion"
#: The control track that carries a prompt change's transition length (vllm-omni's
#: ``transition_chunks``): data ``{"chunks": N}``, N >= 0. Models that blend prompts declare it.
PROMPT_TRANSITION_TRACK = "prompt_transition"
PROMPT_TRANSITION_SCHEMA_NAME = "worldserve.prompt_transition.v1"
#: The schema of held-key state, on whatever track a model names: data ``{"held": [key, ...]}``, the keys
#: held now. A tick also holds the keys pressed since the last one, so a tap between two reaches the model.
HELD_KEYS_SCHEMA_NAME = "worldserve.keys.v1"


class FrozenMap(Mapping[str, Any]):
    """A read-only, hashable mapping of string keys to deeply frozen values.

    ``FrozenMap(mapping)`` freezes a JSON-like mapping (see
    :func:`freeze_transport_value`). A ``FrozenMap`` is never frozen twice: passing
    one where frozen data is expected shares it as it is. It compares equal to any
    mapping with the same items, so frozen control data can be checked against
    plain dicts (whose sequences are tuples: ``(1,) != [1]``). It has no mutating
    method, refuses attribute assignment and deletion, pickles without being frozen
    again, and copies as itself.
    """

    __slots__ = ("_hash", "_items")

    _items: dict[str, Any]
    _hash: int

    def __new__(cls, value: Mapping[str, Any] | None = None, /) -> FrozenMap:
        if isinstance(value, FrozenMap):
            return value
        if value is None:
            return _wrap({})
        if not isinstance(value, Mapping):
            raise ValueError(f"FrozenMap needs a mapping; got {type(value).__name__} (data must be transport-safe).")
        frozen: FrozenMap = _freeze_root(value, "value")
        return frozen

    @classmethod
    def _trusted(cls, items: dict[str, Any]) -> FrozenMap:
        """Wrap ``items`` whose keys and values are already validated and frozen."""
        return _wrap(items)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("FrozenMap is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("FrozenMap is immutable")

    def __copy__(self) -> FrozenMap:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenMap:
        return self

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMap):
            return self is other or self._items == other._items
        if isinstance(other, dict):
            return self._items == other
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:  # the slot stays unset until the first hash
            cached = hash(frozenset(self._items.items()))
            _set_hash(self, cached)
            return cached

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Values are FrozenMaps, tuples and scalars, which pickle as themselves;
        # the receiving side trusts them instead of freezing them again.
        return (FrozenMap._trusted, (self._items,))


def _not_transport_safe(path: str, value: object, why: str | None = None) -> NoReturn:
    detail = why or f"got {type(value).__name__}"
    raise ValueError(
        f"{path} is not transport-safe ({detail}); control data may contain only mappings "
        "with string keys, sequences, strings, finite numbers, booleans and None."
    )


# FrozenMap's slots, set directly: a frozen map is built for every mapping in every control.
_new_object = object.__new__
_set_items = FrozenMap._items.__set__  # type: ignore[attr-defined]
_set_hash = FrozenMap._hash.__set__  # type: ignore[attr-defined]


def _wrap(items: dict[str, Any]) -> FrozenMap:
    frozen: FrozenMap = _new_object(FrozenMap)
    _set_items(frozen, items)
    return frozen


# ``path`` is a chain of (parent, step) pairs built on the way down, only where a container
# is entered, and rendered only for an error, so the happy path formats no strings. The
# loops inline the common scalars (``x - x != 0.0`` is true exactly for NaN and infinities)
# instead of calling ``_freeze`` for each; control data is mostly small dicts of numbers.


def _freeze_root(value: Any, path: str) -> Any:
    """:func:`_freeze` from the top, with a cycle (or absurd depth) reported like any other bad value."""
    try:
        return _freeze(value, path)
    except RecursionError:
        raise ValueError(
            f"{path} is not transport-safe: it contains itself or is nested too deeply; "
            "control data must be a finite JSON tree."
        ) from None


def _freeze(value: Any, path: Any) -> Any:
    kind = type(value)
    if kind is dict:
        return _freeze_mapping(value, path)
    if kind is list or kind is tuple:
        return _freeze_sequence(value, path, kind is tuple)
    if kind is float:
        if value - value != 0.0:
            _not_transport_safe(_render(path), value, f"non-finite float {value!r}")
        return value
    if kind is str or kind is int or kind is bool or value is None or kind is FrozenMap:
        return value
    # Other mappings and sequences; subclasses (enums, numpy floats, ...) become plain JSON values.
    if isinstance(value, Mapping):
        return _freeze_mapping(value, path)
    if isinstance(value, float):
        return _freeze(float(value), path)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return _freeze_sequence(value, path, False)
    _not_transport_safe(_render(path), value)


def _freeze_mapping(value: Mapping[Any, Any], path: Any) -> FrozenMap:
    items: dict[str, Any] = {}
    for key, item in value.items():
        if type(key) is not str:
            if not isinstance(key, str):
                _not_transport_safe(_render(path), value, f"mapping key {key!r} is not a string")
            key = str.__str__(key)
        kind = type(item)
        if kind is float:
            if item - item != 0.0:
                _not_transport_safe(_render((path, key)), item, f"non-finite float {item!r}")
        elif kind is dict:
            item = _freeze_mapping(item, (path, key))
        elif not (kind is str or kind is int or kind is bool or item is None or kind is FrozenMap):
            item = _freeze(item, (path, key))
        items[key] = item
    return _wrap(items)


def _freeze_sequence(value: Sequence[Any], path: Any, share: bool) -> tuple[Any, ...]:
    # ``share``: ``value`` is a tuple, returned as it is if all of its items are already frozen.
    frozen: list[Any] = []
    append = frozen.append
    for index, item in enumerate(value):
        kind = type(item)
        if kind is float:
            if item - item != 0.0:
                _not_transport_safe(_render((path, index)), item, f"non-finite float {item!r}")
        elif kind is dict:
            item = _freeze_mapping(item, (path, index))
            share = False
        elif not (kind is str or kind is int or kind is bool or item is None or kind is FrozenMap):
            new = _freeze(item, (path, index))
            if new is not item:
                item, share = new, False
        append(item)
    return value if share else tuple(frozen)  # type: ignore[return-value]


def _render(path: Any) -> str:
    steps: list[str] = []
    while isinstance(path, tuple):
        path, step = path
        steps.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return str(path) + "".join(reversed(steps))


def freeze_transport_value(value: Any, *, path: str = "value") -> Any:
    """Return a deeply immutable copy of JSON-like ``value``.

    Mappings become :class:`FrozenMap`, lists and tuples become tuples; already
    frozen parts are shared, not copied. Anything that is not JSON (other types,
    non-string keys, NaN or infinite floats, a value that contains itself) raises
    ``ValueError`` naming its path.
    """
    return _freeze_root(value, path)


def thaw_transport_value(value: Any) -> Any:
    """Return a detached, JSON-serializable copy (dicts and lists) of frozen data."""
    if isinstance(value, Mapping):
        return {key: thaw_transport_value(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [thaw_transport_value(item) for item in value]
    return value


def _require_text(value: object, field: str) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ValueError(f"{field} must be a non-empty string; got {value!r}.")


def _require_index(value: object, field: str) -> int:
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ValueError(f"{field} must be a non-negative integer (not a bool); got {value!r}.")


def _event_id_tuple(value: object, field: str) -> tuple[int, ...]:
    if type(value) is tuple:
        # The common case (every tick a session builds): a tuple of plain ints, checked in one pass.
        previous = -1
        for event_id in value:
            if type(event_id) is not int or event_id <= previous:
                break
            previous = event_id
        else:
            return value
    elif isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"{field} must be a sequence of event ids; got {type(value).__name__}.")
    ids = tuple([_require_index(event_id, f"{field} item") for event_id in value])
    for earlier, later in pairwise(ids):
        if later <= earlier:
            raise ValueError(f"{field} must be unique and strictly increasing; got {list(ids)!r}.")
    return ids


def _require_mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping; got {type(value).__name__}.")
    return value


def _reject_unknown_keys(value: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        raise ValueError(f"{what} has unknown keys {unknown}; allowed: {sorted(allowed)}.")


@dataclass(frozen=True, slots=True)
class ControlInput:
    """One model-defined control track (``track``) in a ``schema`` the model names.

    ``data`` is frozen once, here: nested mappings become :class:`FrozenMap`,
    sequences become tuples. Passing already frozen data shares it.
    """

    track: str
    schema: str
    data: Mapping[str, Any]

    def __post_init__(self) -> None:
        _require_text(self.track, "control.track")
        _require_text(self.schema, "control.schema")
        data = self.data
        if type(data) is not FrozenMap:
            if not isinstance(data, Mapping):
                raise ValueError(
                    f"control[{self.track}].data must be a mapping; got {type(data).__name__} "
                    "(control data must be transport-safe)."
                )
            object.__setattr__(self, "data", _freeze_root(data, f"control[{self.track}].data"))

    def to_dict(self) -> dict[str, Any]:
        """A detached JSON-ready copy: ``{"track", "schema", "data"}``."""
        return {"track": self.track, "schema": self.schema, "data": thaw_transport_value(self.data)}

    @classmethod
    def from_dict(cls, value: object) -> ControlInput:
        """Parse :meth:`to_dict` output; missing or unknown keys are errors."""
        mapping = _require_mapping(value, "control")
        _reject_unknown_keys(mapping, _CONTROL_KEYS, "control")
        for key in ("track", "schema", "data"):
            if key not in mapping:
                raise ValueError(f"control is missing {key!r}.")
        return cls(track=mapping["track"], schema=mapping["schema"], data=mapping["data"])


_CONTROL_KEYS = frozenset({"track", "schema", "data"})


def held_keys(control: ControlInput) -> frozenset[str] | None:
    """The keys a held-keys control (:data:`HELD_KEYS_SCHEMA_NAME`) holds; None for any other control,
    and for one whose data is not a list of key names (the model's validator refuses it)."""
    if control.schema != HELD_KEYS_SCHEMA_NAME:
        return None
    held = control.data.get("held")
    if not isinstance(held, tuple) or not all(isinstance(key, str) for key in held):
        return None
    return frozenset(held)


def prompt_transition_control(chunks: int) -> ControlInput:
    """The ``prompt_transition`` control: the event's prompt change blends over ``chunks`` chunks
    before the one with the new prompt alone (the k-th ``k / (chunks + 1)`` of the way)."""
    return ControlInput(PROMPT_TRANSITION_TRACK, PROMPT_TRANSITION_SCHEMA_NAME, {"chunks": chunks})


def transition_chunks_control(transition_chunks: int) -> ControlInput:
    """The ``prompt_transition`` control for a wire ``transition_chunks`` (vllm-omni's meaning, on
    both of the server's routes): the change takes ``N`` chunks, the k-th ``k / N`` of the way,
    the N-th with the new prompt alone (0 and 1: at once). The track counts the blended chunks
    before that one, so ``N`` is sent as ``N - 1``: the same weights, chunk for chunk."""
    return prompt_transition_control(max(0, transition_chunks - 1))


@dataclass(frozen=True, slots=True)
class TickRequest:
    """One atomic AR-block computation for one session.

    ``request_id`` names this computation, ``session_id`` the persistent rollout,
    ``chunk_index`` the block's place in it, and ``applied_event_ids`` the accepted
    events this immutable snapshot of ``prompt`` and ``controls`` represents.
    """

    session_id: str
    request_id: str
    chunk_index: int
    applied_event_ids: tuple[int, ...] = ()
    prompt: str | None = None
    controls: tuple[ControlInput, ...] = ()
    reset: bool = False
    close_session: bool = False

    def __post_init__(self) -> None:
        _require_text(self.session_id, "session_id")
        _require_text(self.request_id, "request_id")
        object.__setattr__(self, "chunk_index", _require_index(self.chunk_index, "chunk_index"))
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a string or None; got {type(self.prompt).__name__}.")
        if type(self.reset) is not bool:
            raise ValueError(f"reset must be a bool; got {self.reset!r}.")
        if type(self.close_session) is not bool:
            raise ValueError(f"close_session must be a bool; got {self.close_session!r}.")
        object.__setattr__(self, "applied_event_ids", _event_id_tuple(self.applied_event_ids, "applied_event_ids"))
        controls = self.controls if type(self.controls) is tuple else tuple(self.controls)
        tracks = set()
        for control in controls:
            if type(control) is not ControlInput and not isinstance(control, ControlInput):
                raise ValueError(f"controls must contain ControlInput values; got {type(control).__name__}.")
            if control.track in tracks:
                raise ValueError(f"controls must hold each track at most once; {control.track!r} repeats.")
            tracks.add(control.track)
        object.__setattr__(self, "controls", controls)

    def to_extra_args(self) -> dict[str, Any]:
        """Serialize under vllm-omni's ``extra_args`` key (``"ar_diffusion_tick"``)."""
        return {
            TICK_EXTRA_ARGS_KEY: {
                "session_id": self.session_id,
                "request_id": self.request_id,
                "chunk_index": self.chunk_index,
                "applied_event_ids": list(self.applied_event_ids),
                "prompt": self.prompt,
                "controls": [control.to_dict() for control in self.controls],
                "reset": self.reset,
                "close_session": self.close_session,
            }
        }

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> TickRequest | None:
        """Parse :meth:`to_extra_args` output; ``None`` when no tick is present."""
        if extra_args is None or TICK_EXTRA_ARGS_KEY not in extra_args:
            return None
        value = _require_mapping(extra_args[TICK_EXTRA_ARGS_KEY], TICK_EXTRA_ARGS_KEY)
        _reject_unknown_keys(value, _TICK_KEYS, TICK_EXTRA_ARGS_KEY)
        for key in ("session_id", "request_id", "chunk_index"):
            if key not in value:
                raise ValueError(f"{TICK_EXTRA_ARGS_KEY} is missing {key!r}.")
        raw_controls = value.get("controls", ())
        if isinstance(raw_controls, (str, bytes)) or not isinstance(raw_controls, Sequence):
            raise ValueError(f"controls must be a sequence; got {type(raw_controls).__name__}.")
        return cls(
            session_id=value["session_id"],
            request_id=value["request_id"],
            chunk_index=value["chunk_index"],
            applied_event_ids=_event_id_tuple(value.get("applied_event_ids", ()), "applied_event_ids"),
            prompt=value.get("prompt"),
            controls=tuple(ControlInput.from_dict(control) for control in raw_controls),
            reset=value.get("reset", False),
            close_session=value.get("close_session", False),
        )


_TICK_KEYS = frozenset(
    {
        "session_id",
        "request_id",
        "chunk_index",
        "applied_event_ids",
        "prompt",
        "controls",
        "reset",
        "close_session",
    }
)


@dataclass(frozen=True, slots=True)
class ChunkMetadata:
    """Identity of one generated AR block; a chunk commits only if it equals its tick's."""

    session_id: str
    request_id: str
    chunk_index: int
    applied_event_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require_text(self.session_id, "session_id")
        _require_text(self.request_id, "request_id")
        object.__setattr__(self, "chunk_index", _require_index(self.chunk_index, "chunk_index"))
        object.__setattr__(self, "applied_event_ids", _event_id_tuple(self.applied_event_ids, "applied_event_ids"))

    @classmethod
    def from_tick(cls, tick: TickRequest) -> ChunkMetadata:
        return cls(tick.session_id, tick.request_id, tick.chunk_index, tick.applied_event_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "request_id": self.request_id,
            "chunk_index": self.chunk_index,
            "applied_event_ids": list(self.applied_event_ids),
        }

    @classmethod
    def from_dict(cls, value: object) -> ChunkMetadata:
        """Parse :meth:`to_dict` output strictly (``applied_event_ids`` defaults to ``()``)."""
        mapping = _require_mapping(value, f"metadata.{CHUNK_METADATA_KEY}")
        for key in ("session_id", "request_id", "chunk_index"):
            if key not in mapping:
                raise ValueError(f"metadata.{CHUNK_METADATA_KEY} is missing {key!r}.")
        return cls(
            session_id=mapping["session_id"],
            request_id=mapping["request_id"],
            chunk_index=mapping["chunk_index"],
            applied_event_ids=_event_id_tuple(
                mapping.get("applied_event_ids", ()), f"metadata.{CHUNK_METADATA_KEY}.applied_event_ids"
            ),
        )


def build_chunk_envelope(payload: Any, metadata: ChunkMetadata) -> dict[str, Any]:
    """The chunk output envelope: ``{"payload": ..., "metadata": {"ar_diffusion": {...}}}``."""
    return {"payload": payload, "metadata": {CHUNK_METADATA_KEY: metadata.to_dict()}}


def parse_chunk_envelope(envelope: object) -> tuple[Any, ChunkMetadata]:
    """Split a chunk output into ``(payload, ChunkMetadata)``; a malformed one raises ``ValueError``.

    Two shapes are taken, as vllm-omni 0.30.0 has both:

    - the worker-side envelope a pipeline returns, ``{"payload": ..., "metadata":
      {"ar_diffusion": {...}}}`` (exactly those two keys; :func:`build_chunk_envelope`);
    - what ``AsyncOmni`` hands a consumer as ``multimodal_output``: the payload's keys
      flattened beside ``metadata``, ``{"latents": ..., "metadata": {"ar_diffusion": {...}}}``;
      the payload is then the mapping of every key but ``metadata``.
    """
    outer = _require_mapping(envelope, "chunk envelope")
    if "metadata" not in outer:
        raise ValueError("chunk envelope is missing 'metadata'.")
    metadata = _require_mapping(outer["metadata"], "chunk envelope metadata")
    if CHUNK_METADATA_KEY not in metadata:
        raise ValueError(f"chunk envelope metadata is missing {CHUNK_METADATA_KEY!r}.")
    chunk = ChunkMetadata.from_dict(metadata[CHUNK_METADATA_KEY])
    if "payload" in outer and len(outer) == 2:
        return outer["payload"], chunk
    payload = {key: value for key, value in outer.items() if key != "metadata"}
    if not payload:
        raise ValueError("chunk envelope is missing 'payload' (or payload keys beside 'metadata').")
    return payload, chunk
