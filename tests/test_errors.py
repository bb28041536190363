"""One error vocabulary: each code once, every place that shows codes follows from it.

A code added in one place and not the others fails here: the enum and its table of
meanings, the exception classes, the server's wire codes and JSON Schema, the docs' tables
and the metrics' label values.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import worldserve
import worldserve.errors as errors
from worldserve.errors import (
    CODES,
    ErrorCode,
    Fault,
    RuntimeFailure,
    SessionError,
    Surface,
    codes_at,
    error_from_code,
    exception_table,
    markdown_table,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _classes() -> list[type[SessionError]]:
    found = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, SessionError) and cls.__module__ == errors.__name__
    }
    return sorted(found, key=lambda cls: cls.__name__)  # an alias (TickFailedError) counts once


def test_every_code_is_documented_once_and_every_class_has_its_own_code() -> None:
    assert set(CODES) == set(ErrorCode)
    assert len({code.value for code in ErrorCode}) == len(ErrorCode)
    for code, info in CODES.items():
        assert info.surfaces, code
        assert info.meaning, code
        assert info.remedy, code
    codes = [cls.code for cls in _classes()]
    assert len(codes) == len(set(codes)), "two exception classes share a code"
    for code in codes:
        assert ErrorCode(code) in CODES


def test_the_seed_names_and_the_runtime_names_are_the_same_classes() -> None:
    import worldserve.runtime.errors as runtime_errors
    import worldserve.session as session

    for name in ("SessionError", "SessionStateError", "EventQueueFullError", "StaleEventError", "ChunkMetadataError"):
        assert getattr(session, name) is getattr(errors, name) is getattr(worldserve, name)
    for name in runtime_errors.__all__:
        assert getattr(runtime_errors, name) is getattr(errors, name)
    assert errors.TickFailedError is RuntimeFailure


@pytest.mark.parametrize("cls", [cls for cls in _classes() if issubclass(cls, RuntimeFailure)])
def test_runtime_errors_cross_a_process_as_their_own_class(cls: type[RuntimeFailure]) -> None:
    rebuilt = error_from_code(str(cls.code), "why")
    assert type(rebuilt) is cls
    assert rebuilt.code == cls.code
    assert str(rebuilt) == "why"


def test_an_unknown_code_from_a_worker_stays_visible() -> None:
    rebuilt = error_from_code("model_oom", "out of memory")
    assert type(rebuilt) is RuntimeFailure
    assert rebuilt.code == "model_oom"


def test_the_server_speaks_the_same_codes() -> None:
    from worldserve.server.messages import ErrorCode as WireCode
    from worldserve.server.messages import protocol_json_schema

    assert WireCode is ErrorCode
    schema = protocol_json_schema()["server_to_client"]["$defs"]
    assert set(schema["ErrorCode"]["enum"]) == {code.value for code in ErrorCode}


def test_the_docs_tables_are_generated_from_the_vocabulary() -> None:
    protocol = (DOCS / "protocol.md").read_text()
    assert markdown_table((Surface.MESSAGE, Surface.EVENT, Surface.START)) in protocol
    assert markdown_table((Surface.TICK, Surface.LIFECYCLE)) in protocol
    assert exception_table() in (DOCS / "control-plane.md").read_text()
    for cls in _classes():
        assert f"`{cls.__name__}`" in exception_table()


def test_metrics_carry_every_client_code_as_a_label() -> None:
    from worldserve.server.metrics import ServerMetrics
    from worldserve.session import SessionManager

    class _Nothing:
        async def execute_tick(self, tick: object) -> object:
            raise AssertionError

        def chunk_metadata(self, output: object) -> object:
            raise AssertionError

        async def reset_session(self, session_id: str) -> None:
            return None

        async def close_session(self, session_id: str) -> None:
            return None

    nothing = _Nothing()
    text = ServerMetrics(SessionManager(tick_consumer=nothing, lifecycle=nothing, max_pending_events=4)).render()
    rendered = text.decode()
    for code in codes_at(Surface.MESSAGE) + codes_at(Surface.EVENT) + codes_at(Surface.START):
        # a code is a label of exactly one of the two families: the client's fault or the server's
        mine, other = ("client", "server") if CODES[code].fault is Fault.CLIENT else ("server", "client")
        assert f'worldserve_{mine}_errors_total{{code="{code.value}"}}' in rendered, code
        assert f'worldserve_{other}_errors_total{{code="{code.value}"}}' not in rendered, code
    assert "_created" not in rendered
    for code in codes_at(Surface.TICK) + codes_at(Surface.LIFECYCLE):
        assert f'worldserve_session_failures_total{{code="{code.value}"}}' in rendered, code


def test_codes_are_plain_strings_on_the_wire() -> None:
    assert json.dumps({"code": ErrorCode.WORKER_DIED}) == '{"code": "worker_died"}'
    assert ErrorCode.WORKER_DIED == "worker_died"
