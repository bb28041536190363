"""The compact tick and metadata encodings of the worker pipe round-trip exactly."""

from __future__ import annotations

import pickle

from worldserve import ChunkMetadata, ControlInput, TickRequest
from worldserve.runtime.wire import decode_metadata, decode_ticks, encode_metadata, encode_ticks


def test_ticks_and_metadata_round_trip_through_pickle() -> None:
    ticks = [
        TickRequest("a", "r1", 0),
        TickRequest(
            "b",
            "r2",
            7,
            (3, 9),
            "snowy",
            (ControlInput("camera", "c.v1", {"dx": 1.5, "dy": -2}), ControlInput("keys", "k.v1", {"held": ["W"]})),
            reset=True,
            close_session=True,
        ),
    ]
    decoded = decode_ticks(pickle.loads(pickle.dumps(encode_ticks(ticks))))
    assert decoded == ticks
    assert [type(tick) for tick in decoded] == [TickRequest, TickRequest]
    assert type(decoded[1].controls[0]) is ControlInput
    assert hash(decoded[1]) == hash(ticks[1])
    metadata = ChunkMetadata.from_tick(ticks[1])
    again = decode_metadata(pickle.loads(pickle.dumps(encode_metadata(metadata))))
    assert again == metadata
    assert type(again) is ChunkMetadata
