"""The messages of vllm-omni's realtime video protocol (``WS /v1/realtime/video``), as pydantic models.

Owns: the server's messages (``video.start``, ``video.chunk_metadata``,
``session.interaction.queued``, ``session.done``, ``session.pong``, ``error``) and the
``session.start`` request, with the field names, types and defaults of vllm-omni 0.30.0
(``vllm_omni/entrypoints/openai/serving_video_output_stream.py`` and its
``VideoGenerationRequest``): ids are strings, ``session.start`` takes unknown fields
silently and coerces types as vllm-omni's request model does (lax, not strict), an
``error`` carries a ``code`` only for ``event_id_conflict`` and ``interaction_failed``.
``session.interaction`` is checked field by field in :mod:`worldserve.server.realtime_plan`,
with vllm-omni's rules (its server checks it by hand, not with a model).

Must not know: sockets, sessions, models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "EVENT_ID_CONFLICT",
    "INTERACTION_FAILED",
    "MAX_INTERACTION_MESSAGE_BYTES",
    "MAX_START_MESSAGE_BYTES",
    "ChunkMetadata",
    "ImageReference",
    "InteractionQueued",
    "RealtimeError",
    "SessionDone",
    "SessionPong",
    "VideoStart",
    "VideoStartRequest",
]

#: The largest ``session.start`` taken (vllm-omni: 4 MiB) ...
MAX_START_MESSAGE_BYTES = 4 * 1024 * 1024
#: ... and the largest message after it (128 KiB).
MAX_INTERACTION_MESSAGE_BYTES = 128 * 1024
#: The two error codes of the protocol.
EVENT_ID_CONFLICT = "event_id_conflict"
INTERACTION_FAILED = "interaction_failed"


class ImageReference(BaseModel):
    """``{image_url}``: here a ``data:`` URL (the server fetches nothing)."""

    model_config = ConfigDict(extra="forbid")

    image_url: str


class VideoStartRequest(BaseModel):
    """``session.start``'s fields (vllm-omni's ``VideoGenerationRequest``, those that mean something here;
    any other field is accepted and ignored, as there)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str = Field(max_length=500)
    negative_prompt: str | None = None
    width: int | None = Field(default=None, ge=1)
    height: int | None = Field(default=None, ge=1)
    fps: float | None = Field(default=None, ge=1, allow_inf_nan=False)
    num_frames: int | None = Field(
        default=None, ge=0, description="Frames to generate, rounded up to whole chunks; 0 or absent: until stop."
    )
    seed: int | None = None
    image_reference: ImageReference | list[ImageReference] | None = None
    extra_params: dict[str, Any] | None = None


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VideoStart(_Out):
    type: Literal["video.start"] = "video.start"
    request_id: str
    format: Literal["m4s"] = "m4s"
    config: dict[str, Any]


class ChunkMetadata(_Out):
    """Describes the one binary message (fMP4 bytes) that follows it."""

    type: Literal["video.chunk_metadata"] = "video.chunk_metadata"
    request_id: str
    kind: Literal["media", "trailer"]
    num_frames: int
    byte_length: int
    generation_chunk_index: int | None
    transport_chunk_index: int
    started_event_ids: list[str]
    active_event_ids: list[str]
    completed_event_ids: list[str]


class InteractionQueued(_Out):
    type: Literal["session.interaction.queued"] = "session.interaction.queued"
    request_id: str
    event_id: str


class SessionDone(_Out):
    type: Literal["session.done"] = "session.done"
    request_id: str | None
    chunks: int
    stopped: bool


class SessionPong(_Out):
    type: Literal["session.pong"] = "session.pong"


class RealtimeError(_Out):
    type: Literal["error"] = "error"
    message: str
    code: str | None = None
    request_id: str | None = None
    event_id: str | None = None
