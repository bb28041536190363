"""worldserve: serve realtime, interactive world models chunk by chunk.

The core (this package's top level, :mod:`worldserve.protocol`, :mod:`worldserve.session`,
:mod:`worldserve.lifecycle`, :mod:`worldserve.stats`) needs only the standard library.
``worldserve.Runtime`` (the ``models`` extra: numpy) is imported on first use (so it is
left out of ``__all__``: a star import stays standard-library only).
"""

from typing import TYPE_CHECKING, Any

from worldserve.lifecycle import CLOSE_SESSION_RPC, RESET_SESSION_RPC, CollectiveRPCClient, WorkerLifecycle
from worldserve.protocol import (
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
from worldserve.session import (
    TRANSITIONS,
    CancelUnsupportedError,
    ChunkCancelledError,
    ChunkMetadataError,
    ControlReducer,
    ControlValidator,
    DroppedEvents,
    DropReason,
    EventAcceptance,
    EventAcceptanceStatus,
    EventQueueFullError,
    EventReach,
    InvalidEventError,
    NothingToCancelError,
    PreparedControls,
    Session,
    SessionError,
    SessionEvent,
    SessionLifecycle,
    SessionManager,
    SessionStateError,
    SessionStatus,
    StaleEventError,
    TickCanceller,
    TickConsumer,
)
from worldserve.stats import HistogramSnapshot, SessionStats

if TYPE_CHECKING:
    from worldserve.runtime import Runtime as Runtime

__version__ = "0.1.0"

__all__ = [
    "CHUNK_METADATA_KEY",
    "CLOSE_SESSION_RPC",
    "RESET_SESSION_RPC",
    "TICK_EXTRA_ARGS_KEY",
    "TRANSITIONS",
    "CancelUnsupportedError",
    "ChunkCancelledError",
    "ChunkMetadata",
    "ChunkMetadataError",
    "CollectiveRPCClient",
    "ControlInput",
    "ControlReducer",
    "ControlValidator",
    "DropReason",
    "DroppedEvents",
    "EventAcceptance",
    "EventAcceptanceStatus",
    "EventQueueFullError",
    "EventReach",
    "FrozenMap",
    "HistogramSnapshot",
    "InvalidEventError",
    "NothingToCancelError",
    "PreparedControls",
    "Session",
    "SessionError",
    "SessionEvent",
    "SessionLifecycle",
    "SessionManager",
    "SessionStateError",
    "SessionStats",
    "SessionStatus",
    "StaleEventError",
    "TickCanceller",
    "TickRetracter",
    "TickConsumer",
    "TickRequest",
    "WorkerLifecycle",
    "__version__",
    "build_chunk_envelope",
    "freeze_transport_value",
    "parse_chunk_envelope",
    "thaw_transport_value",
]


def __getattr__(name: str) -> Any:
    # Lazy: ``import worldserve`` stays standard-library only; the runtime needs numpy.
    if name == "Runtime":
        from worldserve.runtime import Runtime as Runtime

        return Runtime
    raise AttributeError(f"module 'worldserve' has no attribute {name!r}")
