"""The typed tick contract: round trips, every rejection with its message, deep immutability, sharing."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
import pickle
from collections import OrderedDict
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldserve import (
    CHUNK_METADATA_KEY,
    TICK_EXTRA_ARGS_KEY,
    ChunkMetadata,
    ControlInput,
    FrozenMap,
    TickRequest,
    build_chunk_envelope,
    freeze_transport_value,
    parse_chunk_envelope,
    thaw_transport_value,
)

# A fixed, derandomized profile: the same examples on every run and in CI.
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=150)

CAMERA = ControlInput("camera", "example.camera.v1", {"samples": [{"x": 1.0, "y": -2.5}], "mode": "orbit"})
KEYS = ControlInput("keys", "example.keys.v1", {"held": ["w", "shift"], "repeat": 2, "sticky": False, "hint": None})


def full_tick() -> TickRequest:
    return TickRequest(
        session_id="world-1",
        request_id="world-1-req-3",
        chunk_index=3,
        applied_event_ids=(4, 7, 9),
        prompt="a misty forest",
        controls=(CAMERA, KEYS),
        reset=True,
        close_session=False,
    )


# -- JSON-like values: freezing, thawing, sharing -------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=5), json_values, max_size=5)


@PROPERTY
@given(json_values)
def test_thaw_of_freeze_gives_back_the_json_value(value: Any) -> None:
    frozen = freeze_transport_value(value)
    assert thaw_transport_value(frozen) == value
    # and it is still JSON, byte for byte
    assert json.dumps(thaw_transport_value(frozen), sort_keys=True) == json.dumps(value, sort_keys=True)


@PROPERTY
@given(json_values)
def test_freeze_of_thaw_is_identity_on_frozen_values(value: Any) -> None:
    frozen = freeze_transport_value(value)
    again = freeze_transport_value(thaw_transport_value(frozen))
    assert again == frozen
    assert hash(again) == hash(frozen)
    # freezing frozen data shares it instead of copying it
    assert freeze_transport_value(frozen) is frozen


@PROPERTY
@given(json_objects)
def test_control_data_round_trips_through_json(data: dict[str, Any]) -> None:
    control = ControlInput("track", "schema.v1", data)
    wire = json.loads(json.dumps(control.to_dict()))
    assert wire == {"track": "track", "schema": "schema.v1", "data": data}
    assert ControlInput.from_dict(wire) == control


steps = st.lists(st.text(min_size=1, max_size=4) | st.integers(0, 3), max_size=4)


@PROPERTY
@given(steps, st.sampled_from([float("nan"), float("inf"), -math.inf, object(), b"raw", {1, 2}, 1j]))
def test_a_bad_leaf_anywhere_is_refused_naming_its_path(path: list[str | int], bad: object) -> None:
    value: Any = bad
    for step in reversed(path):
        value = {step: value} if isinstance(step, str) else [None] * step + [value]
    rendered = "control[t].data.root" + "".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in path)
    with pytest.raises(ValueError, match="transport-safe") as caught:
        ControlInput("t", "s", {"root": value})
    assert str(caught.value).startswith(f"{rendered} is not transport-safe")


@pytest.mark.parametrize(
    ("data", "path", "detail"),
    [
        ({"object": object()}, "control[cam].data.object", "got object"),
        ({"a": [1, {"b": b"x"}]}, "control[cam].data.a[1].b", "got bytes"),
        ({"a": {"b": {1, 2}}}, "control[cam].data.a.b", "got set"),
        ({"c": 1 + 2j}, "control[cam].data.c", "got complex"),
        ({"a": {1: "one"}}, "control[cam].data.a", "mapping key 1 is not a string"),
        ({"a": {("x",): 1}}, "control[cam].data.a", "mapping key ('x',) is not a string"),
        ({"a": float("nan")}, "control[cam].data.a", "non-finite float nan"),
        ({"a": [0.5, float("inf")]}, "control[cam].data.a[1]", "non-finite float inf"),
        ({"a": (-math.inf,)}, "control[cam].data.a[0]", "non-finite float -inf"),
    ],
)
def test_non_transport_safe_data_is_refused_with_its_path(data: dict[str, Any], path: str, detail: str) -> None:
    with pytest.raises(ValueError, match="transport-safe") as caught:
        ControlInput("cam", "s", data)
    message = str(caught.value)
    assert message.startswith(f"{path} is not transport-safe")
    assert detail in message


@pytest.mark.parametrize("data", [["x"], "text", 3, None, (("a", 1),)])
def test_control_data_must_be_a_mapping(data: Any) -> None:
    with pytest.raises(ValueError, match=r"control\[cam\]\.data must be a mapping.*transport-safe"):
        ControlInput("cam", "s", data)


def test_subclasses_and_other_containers_become_plain_json_values() -> None:
    class Level(enum.IntEnum):
        HIGH = 3

    class Name(str):
        pass

    class Ratio(float):
        pass

    data = {
        "level": Level.HIGH,
        "name": Name("alice"),
        "ratio": Ratio(0.5),
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "proxy": MappingProxyType({"k": [1]}),
        "range": range(3),
        Name("key"): True,
    }
    frozen = ControlInput("t", "s", data).data
    assert type(frozen["level"]) is int
    assert frozen["level"] == 3
    assert type(frozen["name"]) is str
    assert frozen["name"] == "alice"
    assert type(frozen["ratio"]) is float
    assert type(frozen["ordered"]) is FrozenMap
    assert list(frozen["ordered"]) == ["b", "a"]
    assert frozen["proxy"] == {"k": (1,)}
    assert frozen["range"] == (0, 1, 2)
    assert all(type(key) is str for key in frozen)
    with pytest.raises(ValueError, match=r"control\[t\]\.data\.r is not transport-safe \(non-finite float inf\)"):
        ControlInput("t", "s", {"r": Ratio("inf")})


def test_sequences_become_tuples_and_mappings_frozen_maps() -> None:
    data = CAMERA.data
    assert type(data) is FrozenMap
    assert type(data["samples"]) is tuple
    assert type(data["samples"][0]) is FrozenMap
    # A frozen map equals any mapping with the same items; sequences compare as tuples.
    assert data == {"samples": ({"x": 1.0, "y": -2.5},), "mode": "orbit"}
    assert data != {"samples": [{"x": 1.0, "y": -2.5}], "mode": "orbit"}
    assert data == MappingProxyType({"samples": ({"x": 1.0, "y": -2.5},), "mode": "orbit"})
    assert data != {"samples": ()}
    assert (data == 3) is False


# -- deep immutability -------------------------------------------------------------------------------------------


def test_frozen_data_has_no_mutation_path() -> None:
    data = CAMERA.data
    with pytest.raises(TypeError):
        data["mode"] = "free"  # type: ignore[index]
    with pytest.raises(TypeError):
        del data["mode"]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="immutable"):
        data._items = {}  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del data._items
    with pytest.raises(AttributeError, match="immutable"):
        data.extra = 1  # type: ignore[attr-defined]
    assert not hasattr(data, "__dict__")
    assert not hasattr(data, "update")
    assert not hasattr(data, "pop")
    assert not hasattr(data, "clear")
    with pytest.raises(TypeError):
        data["samples"][0]["x"] = 9.0
    assert data["samples"][0]["x"] == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        CAMERA.data = {}  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        full_tick().controls = ()  # type: ignore[misc]


def test_input_is_copied_once_and_output_is_detached() -> None:
    payload = {"samples": [{"x": 1.0}], "keys": ["w"]}
    control = ControlInput("cam", "s", payload)
    payload["samples"][0]["x"] = 99.0  # type: ignore[index]
    payload["keys"].append("a")  # type: ignore[attr-defined]
    payload["new"] = True  # type: ignore[assignment]
    assert control.data == {"samples": ({"x": 1.0},), "keys": ("w",)}

    out = control.to_dict()
    out["data"]["samples"][0]["x"] = -1.0
    out["data"]["keys"].append("zz")
    out["track"] = "other"
    assert control.to_dict() == {"track": "cam", "schema": "s", "data": {"samples": [{"x": 1.0}], "keys": ["w"]}}

    wire = full_tick().to_extra_args()
    wire[TICK_EXTRA_ARGS_KEY]["controls"][0]["data"]["samples"].clear()
    wire[TICK_EXTRA_ARGS_KEY]["applied_event_ids"].append(99)
    assert full_tick().to_extra_args()[TICK_EXTRA_ARGS_KEY]["applied_event_ids"] == [4, 7, 9]
    assert CAMERA.data["samples"] == ({"x": 1.0, "y": -2.5},)


def test_frozen_data_is_shared_never_frozen_twice() -> None:
    shared = ControlInput("camera", "other.schema", CAMERA.data)
    assert shared.data is CAMERA.data
    assert FrozenMap(CAMERA.data) is CAMERA.data
    assert freeze_transport_value(CAMERA.data) is CAMERA.data
    # Frozen parts inside new plain containers are shared too.
    samples = CAMERA.data["samples"]
    nested = ControlInput("t", "s", {"again": samples, "map": CAMERA.data})
    assert nested.data["again"] is samples
    assert nested.data["map"] is CAMERA.data
    assert freeze_transport_value((1, "a", CAMERA.data)) == (1, "a", CAMERA.data)
    frozen_tuple = (1, "a", CAMERA.data)
    assert freeze_transport_value(frozen_tuple) is frozen_tuple
    # ... but a tuple with a plain container inside is rebuilt.
    mixed = (1, [2])
    assert freeze_transport_value(mixed) == (1, (2,))
    assert freeze_transport_value(mixed) is not mixed
    # Copying immutable data is a no-op.
    assert copy.copy(CAMERA.data) is CAMERA.data
    assert copy.deepcopy(CAMERA.data) is CAMERA.data


def test_frozen_map_constructor() -> None:
    assert FrozenMap() == {}
    assert len(FrozenMap()) == 0
    assert FrozenMap(None) == {}
    built = FrozenMap({"a": [1, {"b": 2}]})
    assert built == {"a": (1, {"b": 2})}
    assert type(built["a"][1]) is FrozenMap
    assert "a" in built
    assert "z" not in built
    assert 1 not in built
    assert list(built.items()) == [("a", (1, FrozenMap({"b": 2})))]
    assert repr(FrozenMap({"a": 1})) == "FrozenMap({'a': 1})"
    assert hash(FrozenMap({"a": 1, "b": (2,)})) == hash(FrozenMap({"b": [2], "a": 1}))
    assert len({FrozenMap({"a": 1}), FrozenMap({"a": 1})}) == 1
    with pytest.raises(ValueError, match="FrozenMap needs a mapping; got list"):
        FrozenMap([("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"value\.a is not transport-safe"):
        FrozenMap({"a": object()})


def test_pickling_preserves_values_and_frozenness() -> None:
    tick = full_tick()
    for value in (CAMERA, CAMERA.data, tick, ChunkMetadata.from_tick(tick)):
        clone = pickle.loads(pickle.dumps(value))
        assert clone == value
        assert type(clone) is type(value)
        assert hash(clone) == hash(value)
    clone = pickle.loads(pickle.dumps(tick))
    assert type(clone.controls[0].data) is FrozenMap
    assert type(clone.controls[0].data["samples"][0]) is FrozenMap
    with pytest.raises(TypeError):
        clone.controls[0].data["mode"] = "x"
    with pytest.raises(AttributeError, match="immutable"):
        clone.controls[0].data._items = {}
    # one pickle of a shared map keeps it shared
    pair = pickle.loads(pickle.dumps((CAMERA, ControlInput("cam2", "s", CAMERA.data))))
    assert pair[0].data is pair[1].data


# -- ControlInput ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"track": "", "schema": "s", "data": {}}, "control.track must be a non-empty string; got ''"),
        ({"track": "  ", "schema": "s", "data": {}}, "control.track must be a non-empty string; got '  '"),
        ({"track": 3, "schema": "s", "data": {}}, "control.track must be a non-empty string; got 3"),
        ({"track": "t", "schema": "", "data": {}}, "control.schema must be a non-empty string; got ''"),
        ({"track": "t", "schema": None, "data": {}}, "control.schema must be a non-empty string; got None"),
    ],
)
def test_control_ids_must_be_non_empty_strings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ControlInput(**kwargs)


def test_control_from_dict_round_trip_and_rejections() -> None:
    assert ControlInput.from_dict(CAMERA.to_dict()) == CAMERA
    assert ControlInput.from_dict(MappingProxyType(KEYS.to_dict())) == KEYS
    with pytest.raises(ValueError, match=r"^control must be a mapping; got list"):
        ControlInput.from_dict([("track", "t")])
    for missing in ("track", "schema", "data"):
        value = CAMERA.to_dict()
        del value[missing]
        with pytest.raises(ValueError, match=f"^control is missing '{missing}'"):
            ControlInput.from_dict(value)
    with pytest.raises(ValueError, match=r"^control has unknown keys \['extra', 'priority'\]; allowed"):
        ControlInput.from_dict({**CAMERA.to_dict(), "priority": 1, "extra": 2})
    with pytest.raises(ValueError, match="transport-safe"):
        ControlInput.from_dict({"track": "t", "schema": "s", "data": {"x": float("nan")}})


# -- TickRequest ----------------------------------------------------------------------------------------------------


def test_tick_extra_args_has_vllm_omnis_exact_shape() -> None:
    assert TICK_EXTRA_ARGS_KEY == "ar_diffusion_tick"
    assert full_tick().to_extra_args() == {
        "ar_diffusion_tick": {
            "session_id": "world-1",
            "request_id": "world-1-req-3",
            "chunk_index": 3,
            "applied_event_ids": [4, 7, 9],
            "prompt": "a misty forest",
            "controls": [
                {
                    "track": "camera",
                    "schema": "example.camera.v1",
                    "data": {"samples": [{"x": 1.0, "y": -2.5}], "mode": "orbit"},
                },
                {
                    "track": "keys",
                    "schema": "example.keys.v1",
                    "data": {"held": ["w", "shift"], "repeat": 2, "sticky": False, "hint": None},
                },
            ],
            "reset": True,
            "close_session": False,
        }
    }


def test_tick_round_trips_through_extra_args_and_json() -> None:
    for tick in (full_tick(), TickRequest("s", "r", 0), TickRequest("s", "r", 5, (1,), None, (), False, True)):
        wire = json.loads(json.dumps(tick.to_extra_args()))
        parsed = TickRequest.from_extra_args(wire)
        assert parsed == tick
        assert parsed is not None
        assert type(parsed.applied_event_ids) is tuple
    # vllm-omni puts the tick among other extra_args; those are left alone.
    assert TickRequest.from_extra_args({"seed": 7, **full_tick().to_extra_args()}) == full_tick()
    # optional keys take their defaults
    minimal = {TICK_EXTRA_ARGS_KEY: {"session_id": "s", "request_id": "r", "chunk_index": 0}}
    assert TickRequest.from_extra_args(minimal) == TickRequest("s", "r", 0)


@pytest.mark.parametrize("extra_args", [None, {}, {"seed": 1}])
def test_no_tick_in_extra_args_gives_none(extra_args: dict[str, Any] | None) -> None:
    assert TickRequest.from_extra_args(extra_args) is None


def _tick_args(**changes: Any) -> dict[str, Any]:
    value = full_tick().to_extra_args()[TICK_EXTRA_ARGS_KEY]
    value.update(changes)
    return {TICK_EXTRA_ARGS_KEY: value}


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({TICK_EXTRA_ARGS_KEY: ["session_id"]}, "ar_diffusion_tick must be a mapping; got list"),
        ({TICK_EXTRA_ARGS_KEY: None}, "ar_diffusion_tick must be a mapping; got NoneType"),
        (_tick_args(priority=1), r"ar_diffusion_tick has unknown keys \['priority'\]"),
        (_tick_args(controls="camera"), "controls must be a sequence; got str"),
        (_tick_args(controls=5), "controls must be a sequence; got int"),
        (_tick_args(controls=[["camera"]]), "control must be a mapping; got list"),
        (_tick_args(applied_event_ids="12"), "applied_event_ids must be a sequence of event ids; got str"),
        (
            _tick_args(applied_event_ids=[3, 2]),
            r"applied_event_ids must be unique and strictly increasing; got \[3, 2\]",
        ),
        (_tick_args(chunk_index="3"), "chunk_index must be a non-negative integer"),
        (_tick_args(reset="yes"), "reset must be a bool; got 'yes'"),
        (_tick_args(prompt=["a"]), "prompt must be a string or None; got list"),
    ],
)
def test_malformed_extra_args_are_refused(extra_args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message):
        TickRequest.from_extra_args(extra_args)


@pytest.mark.parametrize("missing", ["session_id", "request_id", "chunk_index"])
def test_extra_args_missing_a_required_key_are_refused(missing: str) -> None:
    args = _tick_args()
    del args[TICK_EXTRA_ARGS_KEY][missing]
    with pytest.raises(ValueError, match=f"^ar_diffusion_tick is missing '{missing}'"):
        TickRequest.from_extra_args(args)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"session_id": ""}, "session_id must be a non-empty string; got ''"),
        ({"session_id": " \t"}, "session_id must be a non-empty string"),
        ({"session_id": None}, "session_id must be a non-empty string; got None"),
        ({"request_id": ""}, "request_id must be a non-empty string; got ''"),
        ({"request_id": 7}, "request_id must be a non-empty string; got 7"),
        ({"chunk_index": -1}, r"chunk_index must be a non-negative integer \(not a bool\); got -1"),
        ({"chunk_index": True}, r"chunk_index must be a non-negative integer \(not a bool\); got True"),
        ({"chunk_index": 1.0}, r"chunk_index must be a non-negative integer \(not a bool\); got 1.0"),
        ({"applied_event_ids": (1, 1)}, r"applied_event_ids must be unique and strictly increasing; got \[1, 1\]"),
        ({"applied_event_ids": (5, 2)}, r"applied_event_ids must be unique and strictly increasing; got \[5, 2\]"),
        ({"applied_event_ids": (-1,)}, r"applied_event_ids item must be a non-negative integer \(not a bool\); got -1"),
        ({"applied_event_ids": (False,)}, r"applied_event_ids item must be a non-negative integer .*got False"),
        ({"applied_event_ids": ("1",)}, r"applied_event_ids item must be a non-negative integer .*got '1'"),
        ({"applied_event_ids": 3}, "applied_event_ids must be a sequence of event ids; got int"),
        ({"applied_event_ids": b"\x01"}, "applied_event_ids must be a sequence of event ids; got bytes"),
        ({"prompt": 3}, "prompt must be a string or None; got int"),
        ({"reset": 1}, "reset must be a bool; got 1"),
        ({"close_session": None}, "close_session must be a bool; got None"),
        ({"controls": ({"track": "t"},)}, "controls must contain ControlInput values; got dict"),
        ({"controls": (CAMERA, KEYS, CAMERA)}, "controls must hold each track at most once; 'camera' repeats"),
    ],
)
def test_tick_validation(changes: dict[str, Any], message: str) -> None:
    fields = {field.name: getattr(full_tick(), field.name) for field in dataclasses.fields(TickRequest)}
    with pytest.raises(ValueError, match="^" + message):
        TickRequest(**{**fields, **changes})


def test_valid_event_id_tuples_are_shared() -> None:
    ids = (0, 3, 8)
    tick = TickRequest("s", "r", 0, ids)
    assert tick.applied_event_ids is ids
    assert ChunkMetadata.from_tick(tick).applied_event_ids is ids


def test_tick_normalizes_what_it_may() -> None:
    class Index(enum.IntEnum):
        TWO = 2

    tick = TickRequest("s", "r", Index.TWO, [Index.TWO, 5], controls=[KEYS])  # type: ignore[arg-type]
    assert type(tick.chunk_index) is int
    assert tick.chunk_index == 2
    assert tick.applied_event_ids == (2, 5)
    assert all(type(i) is int for i in tick.applied_event_ids)
    assert tick.controls == (KEYS,)
    assert tick.controls[0] is KEYS
    assert TickRequest("s", "r", 0, range(3)).applied_event_ids == (0, 1, 2)  # type: ignore[arg-type]


# -- ChunkMetadata and the output envelope --------------------------------------------------------------------------


def test_chunk_metadata_from_tick_and_dict_round_trip() -> None:
    metadata = ChunkMetadata.from_tick(full_tick())
    assert metadata == ChunkMetadata("world-1", "world-1-req-3", 3, (4, 7, 9))
    assert metadata.to_dict() == {
        "session_id": "world-1",
        "request_id": "world-1-req-3",
        "chunk_index": 3,
        "applied_event_ids": [4, 7, 9],
    }
    assert ChunkMetadata.from_dict(json.loads(json.dumps(metadata.to_dict()))) == metadata
    assert ChunkMetadata.from_dict({"session_id": "s", "request_id": "r", "chunk_index": 0}) == ChunkMetadata(
        "s", "r", 0
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"session_id": "", "request_id": "r", "chunk_index": 0}, "session_id must be a non-empty string"),
        ({"session_id": "s", "request_id": " ", "chunk_index": 0}, "request_id must be a non-empty string"),
        ({"session_id": "s", "request_id": "r", "chunk_index": -2}, "chunk_index must be a non-negative integer"),
        ({"session_id": "s", "request_id": "r", "chunk_index": False}, "chunk_index must be a non-negative integer"),
        (
            {"session_id": "s", "request_id": "r", "chunk_index": 0, "applied_event_ids": (2, 2)},
            "applied_event_ids must be unique and strictly increasing",
        ),
    ],
)
def test_chunk_metadata_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message):
        ChunkMetadata(**kwargs)


def test_envelope_round_trip() -> None:
    metadata = ChunkMetadata.from_tick(full_tick())
    payload = {"frames": b"\x00\x01", "fps": 16}
    envelope = build_chunk_envelope(payload, metadata)
    assert envelope == {"payload": payload, "metadata": {CHUNK_METADATA_KEY: metadata.to_dict()}}
    assert CHUNK_METADATA_KEY == "ar_diffusion"
    parsed_payload, parsed = parse_chunk_envelope(envelope)
    assert parsed_payload is payload
    assert parsed == metadata
    # The metadata part survives JSON; other metadata keys are left alone.
    wire = json.loads(json.dumps({"payload": None, "metadata": {**envelope["metadata"], "timing": {"ms": 3}}}))
    assert parse_chunk_envelope(wire) == (None, metadata)


_GOOD_METADATA = {"session_id": "s", "request_id": "r", "chunk_index": 0}


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        ([1, 2], "chunk envelope must be a mapping; got list"),
        (None, "chunk envelope must be a mapping; got NoneType"),
        ({"metadata": {CHUNK_METADATA_KEY: _GOOD_METADATA}}, "chunk envelope is missing 'payload'"),
        ({"payload": 1}, "chunk envelope is missing 'metadata'"),
        ({"payload": 1, "metadata": "ar_diffusion"}, "chunk envelope metadata must be a mapping; got str"),
        ({"payload": 1, "metadata": {}}, "chunk envelope metadata is missing 'ar_diffusion'"),
        ({"payload": 1, "metadata": {CHUNK_METADATA_KEY: [1]}}, "metadata.ar_diffusion must be a mapping; got list"),
        (
            {"payload": 1, "metadata": {CHUNK_METADATA_KEY: {"session_id": "s", "chunk_index": 0}}},
            "metadata.ar_diffusion is missing 'request_id'",
        ),
        (
            {"payload": 1, "metadata": {CHUNK_METADATA_KEY: {**_GOOD_METADATA, "chunk_index": "0"}}},
            "chunk_index must be a non-negative integer",
        ),
        (
            {"payload": 1, "metadata": {CHUNK_METADATA_KEY: {**_GOOD_METADATA, "applied_event_ids": 4}}},
            "metadata.ar_diffusion.applied_event_ids must be a sequence of event ids; got int",
        ),
        (
            {"payload": 1, "metadata": {CHUNK_METADATA_KEY: {**_GOOD_METADATA, "applied_event_ids": [4, 1]}}},
            r"metadata.ar_diffusion.applied_event_ids must be unique and strictly increasing; got \[4, 1\]",
        ),
    ],
)
def test_malformed_envelopes_are_refused(envelope: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message):
        parse_chunk_envelope(envelope)


@pytest.mark.parametrize("missing", ["session_id", "request_id", "chunk_index"])
def test_envelope_metadata_missing_a_key_is_refused(missing: str) -> None:
    metadata = {key: value for key, value in _GOOD_METADATA.items() if key != missing}
    with pytest.raises(ValueError, match=f"^metadata.ar_diffusion is missing '{missing}'"):
        parse_chunk_envelope({"payload": None, "metadata": {CHUNK_METADATA_KEY: metadata}})


def test_data_that_contains_itself_is_refused_like_any_bad_value() -> None:
    cyclic: dict[str, Any] = {"a": 1}
    cyclic["self"] = cyclic
    looped: list[Any] = [1]
    looped.append({"again": looped})
    for bad in (cyclic, {"list": looped}):
        with pytest.raises(ValueError, match=r"control\[keys\]\.data is not transport-safe: it contains itself"):
            ControlInput("keys", "k.v1", bad)
        with pytest.raises(ValueError, match="transport-safe"):
            FrozenMap(bad)
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(50):  # deep, but finite and reasonable: fine
        node["n"] = {}
        node = node["n"]
    assert ControlInput("keys", "k.v1", deep).to_dict()["data"] == deep
