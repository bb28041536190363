"""Wire messages: parsing rules, and the published JSON Schema stays current."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from server_harness import missing_fields
from worldserve.server.messages import (
    ChunkMessage,
    ClientMessageError,
    ErrorCode,
    InputEvent,
    ServerMessage,
    SessionQueued,
    SessionStart,
    parse_client_message,
    parse_server_message,
    protocol_json_schema,
    wire_json,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_published_schema_is_current() -> None:
    published = json.loads((DOCS / "protocol.schema.json").read_text())
    assert published == json.loads(json.dumps(protocol_json_schema())), (
        "docs/protocol.schema.json is stale: python -m worldserve.server.messages > docs/protocol.schema.json"
    )


def test_parses_each_client_message() -> None:
    start = parse_client_message('{"type": "session.start", "prompt": "snow", "seed": 3, "id": "a"}')
    assert isinstance(start, SessionStart)
    assert (start.prompt, start.seed, start.id, start.options.media) == ("snow", 3, "a", "jpeg")
    event = parse_client_message(
        '{"type": "input.event", "event_id": 9, "controls": [{"track": "t", "schema": "s", "data": {"k": [1]}}]}'
    )
    assert isinstance(event, InputEvent)
    assert event.controls[0].schema_ == "s"
    for kind in ("session.reset", "session.close", "ping"):
        assert parse_client_message(json.dumps({"type": kind})).type == kind
    assert parse_client_message('{"type": "chunk.ack", "seq": 4}').type == "chunk.ack"


@pytest.mark.parametrize(
    ("text", "code", "fragment"),
    [
        ("{", ErrorCode.INVALID_JSON, "not valid JSON"),
        ("42", ErrorCode.INVALID_MESSAGE, "JSON object"),
        ('{"type": 5}', ErrorCode.UNKNOWN_TYPE, "unknown message type"),
        ('{"type": "input.event", "event_id": true}', ErrorCode.INVALID_MESSAGE, "event_id"),
        ('{"type": "input.event", "event_id": -1}', ErrorCode.INVALID_MESSAGE, "event_id"),
        ('{"type": "session.start", "seed": 4294967296}', ErrorCode.INVALID_MESSAGE, "seed"),
        ('{"type": "session.start", "options": {"media": "png"}}', ErrorCode.INVALID_MESSAGE, "media"),
        ('{"type": "session.start", "prompt": 3}', ErrorCode.INVALID_MESSAGE, "prompt"),
        ('{"type": "chunk.ack"}', ErrorCode.INVALID_MESSAGE, "seq"),
        ('{"type": "ping", "id": "' + "x" * 65 + '"}', ErrorCode.INVALID_MESSAGE, "id"),
    ],
)
def test_rejects_with_stable_codes(text: str, code: ErrorCode, fragment: str) -> None:
    with pytest.raises(ClientMessageError) as caught:
        parse_client_message(text)
    assert caught.value.code is code
    assert fragment in str(caught.value)


def test_error_echoes_the_message_id() -> None:
    with pytest.raises(ClientMessageError) as caught:
        parse_client_message('{"type": "input.event", "id": "m7", "event_id": "x"}')
    assert caught.value.message_id == "m7"


#: One message of each server type, made with only the arguments its model requires: every optional
#: field is left to its default (None for those that are left out when they do not apply).
_FRAMES = {"count": 4, "media": "jpeg", "width": 48, "height": 48, "sizes": [1, 2, 3, 4]}
_SPEC: dict[str, object] = {"name": "procedural"}
_SERVER_SAMPLES: dict[str, dict[str, object]] = {
    "session.started": {"session_id": "s", "model": _SPEC, "media": "jpeg", "max_pending_events": 64,
                        "max_lag_chunks": 3, "lead_chunks": 0},
    "session.queued": {"position": 2, "ahead": 1, "eta_s": None},
    "session.moved": {"session_id": "s", "url": "ws://lb.example/fe/2/v1/world"},
    "session.joined": {"session_id": "s", "role": "viewer", "model": _SPEC, "media": "jpeg", "max_pending_events": 64,
                       "max_lag_chunks": 3, "lead_chunks": 0, "seq": 4},
    "session.resumed": {"session_id": "s", "role": "host", "model": _SPEC, "media": "jpeg", "max_pending_events": 64,
                        "max_lag_chunks": 3, "lead_chunks": 0, "seq": 4, "replayed": 0},
    "chunk.skipped": {"from_seq": 1, "to_seq": 2, "reason": "lagged"},
    "chunk.track": {"seq": 3, "frame": 0, "rtp": 4294967295},
    "input.accepted": {"event_id": 1, "status": "accepted", "pending": 1},
    "chunk": {"seq": 0, "epoch": 0, "chunk_index": 0, "request_id": "r", "applied_event_ids": [], "frames": _FRAMES,
              "timings": {"tick_ms": 1.0}, "batch_size": 1, "applied_latency_ms": []},
    "chunk.part": {"seq": 0, "epoch": 0, "chunk_index": 0, "first": 0, "frames": _FRAMES},
    "input.dropped": {"event_ids": [1], "reason": "reset"},
    "session.failed": {"code": "evicted", "message": "gone"},
    "session.reset": {"epoch": 1},
    "session.closed": {"reason": "closed"},
    "error": {"code": "invalid_message", "message": "no"},
    "chunk.cancelled": {"chunk_index": 3},
    "pong": {},
}  # fmt: skip


def _server_models() -> dict[str, type[BaseModel]]:
    (union, *_) = get_args(ServerMessage)
    return {model.model_fields["type"].default: model for model in get_args(union)}


def test_every_server_message_type_carries_its_always_present_fields_as_the_server_writes_it() -> None:
    """Protocol: every field the schema lists as required is in every message of its type, null or not
    (the first ``session.queued`` notices, before any world ended, used to leave ``eta_s`` out); the
    fields left to ``null`` defaults are left out, and the published schema does not require them."""
    models = _server_models()
    assert set(_SERVER_SAMPLES) == set(models), "a server message type without a sample here"
    schema = protocol_json_schema()["server_to_client"]
    for kind, model in models.items():
        sample = model.model_validate_json(json.dumps(_SERVER_SAMPLES[kind]))  # strict: as JSON, enums by value
        written = json.loads(wire_json(sample))
        assert missing_fields(written, schema) == [], kind
        assert parse_server_message(json.dumps(written)) == sample
        required = schema["$defs"][model.__name__]["required"]
        assert "type" in required, kind
        assert not [name for name, value in written.items() if value is None and name not in required], kind
    queued = json.loads(wire_json(SessionQueued(position=1, ahead=0, eta_s=None)))
    assert queued == {"type": "session.queued", "position": 1, "ahead": 0, "eta_s": None}
    assert "eta_s" in schema["$defs"]["SessionQueued"]["required"]
    frames = json.loads(wire_json(ChunkMessage.model_validate_json(json.dumps(_SERVER_SAMPLES["chunk"]))))["frames"]
    assert "keyframe" not in frames  # h264 only: absent for jpeg
    assert "init_bytes" not in frames
