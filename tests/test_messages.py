"""Wire messages: parsing rules, and the published JSON Schema stays current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worldserve.server.messages import (
    ClientMessageError,
    ErrorCode,
    InputEvent,
    SessionStart,
    parse_client_message,
    protocol_json_schema,
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
