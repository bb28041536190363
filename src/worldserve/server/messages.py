"""The WebSocket session protocol's messages, as pydantic models.

Owns: every JSON text message of ``WS /v1/world`` in both directions, their parsing
(:func:`parse_client_message`, strict: no type coercion, no unknown fields), the
error codes (:class:`~worldserve.errors.ErrorCode`, re-exported) and the JSON Schema the docs publish
(:func:`protocol_json_schema`), and how a server message is written (:func:`wire_json`): a
field is always present, ``null`` or not, unless its default is None (:func:`optional_fields`:
then it is left out while unset), and the schema's ``required`` says which. Frames travel as
binary messages right after their ``chunk`` message; they are not modelled here.

Must not know: sockets, sessions, models.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from worldserve.errors import ErrorCode

__all__ = [
    "ADMISSION_RETRY_AFTER_MS",
    "MAX_CONTROLS",
    "MAX_PROMPT_CHARS",
    "AnyClientMessage",
    "ChunkAck",
    "ChunkCancel",
    "ChunkCancelled",
    "ChunkFrames",
    "ChunkMessage",
    "ChunkPartMessage",
    "ChunkSkipped",
    "ChunkTrack",
    "ChunkTimes",
    "ClientMessage",
    "ClientMessageError",
    "ControlModel",
    "DroppedReason",
    "ErrorCode",
    "ErrorMessage",
    "InputAccepted",
    "InputDropped",
    "InputEvent",
    "Media",
    "Ping",
    "Pong",
    "ServerMessage",
    "SessionClose",
    "SessionClosed",
    "SessionFailed",
    "SessionJoin",
    "SessionJoined",
    "SessionMoved",
    "SessionQueued",
    "SessionReset",
    "SessionResetDone",
    "SessionResume",
    "SessionResumed",
    "ShareOptions",
    "ShareTokens",
    "SessionStart",
    "SessionStarted",
    "StartOptions",
    "optional_fields",
    "parse_client_message",
    "protocol_json_schema",
    "wire_json",
]

MAX_PROMPT_CHARS = 500
MAX_CONTROLS = 16
MAX_ID_CHARS = 64
#: A start image's base64: room for a real model's frame as raw RGB (ABot-World's 704x1280: 3.6 MB of base64).
MAX_IMAGE_CHARS = 4 * 1024 * 1024


#: The retry hint an ``admission_refused`` error carries when the runtime gives none: room
#: comes back when a session ends, an idle one can be evicted, or a worker (re)starts --
#: seconds, not minutes. A balancer or client waits this long, or tries another front-end.
ADMISSION_RETRY_AFTER_MS = 1000


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _ClientMessage(_Message):
    id: Annotated[str | None, Field(max_length=MAX_ID_CHARS, description="Client message id, echoed in replies.")] = (
        None
    )


class ControlModel(_Message):
    """One control update: the model's ``track``, its ``schema`` name and JSON ``data``."""

    track: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: Annotated[str, Field(min_length=1, max_length=128, alias="schema")]
    data: dict[str, Any]

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


#: The media a chunk's frames travel as.
Media = Literal["jpeg", "raw", "h264"]


class StartOptions(_Message):
    media: Media = Field(
        default="jpeg",
        description="Frame encoding: JPEG bytes per frame, raw RGB per frame (height*width*3 bytes), or H.264: "
        "one fragmented-MP4 fragment per chunk (yuv420p, no B-frames), the init segment in front where a stream "
        "starts.",
    )
    quality: Annotated[
        int | None,
        Field(
            ge=1,
            le=100,
            description="JPEG quality, or H.264's constant quality (CRF = round((100 - quality) * 51 / 99)); "
            "absent: 90 for JPEG, 65 (CRF 18) for H.264.",
        ),
    ] = None
    bitrate_kbps: Annotated[
        int | None,
        Field(
            ge=16,
            le=100_000,
            description="H.264 only: the cap on its bitrate, kbit/s; absent: 0.3 bits per pixel per frame, "
            "at least 128 kbit/s.",
        ),
    ] = None
    parts: bool = Field(
        default=False,
        description="jpeg and raw: take a chunk's frames in parts as the model makes them (chunk.part messages "
        "ahead of the chunk, a latent frame at a time), where the model makes them so (its spec's frame_parts) "
        "and its worker encodes them; the chunk then carries only the frames not sent yet (frames.sent). h264 "
        "and a model that makes its chunks whole: no parts, as without.",
    )

    @model_validator(mode="after")
    def _bitrate_is_h264s(self) -> StartOptions:
        if self.bitrate_kbps is not None and self.media != "h264":
            raise ValueError("bitrate_kbps applies to media h264 only")
        return self


class ShareOptions(_Message):
    """Who else may open this world: ``session.started`` then carries a token for each."""

    viewers: bool = Field(default=False, description="Give a viewer token: joiners receive every chunk.")
    controllers: bool = Field(default=False, description="Give a controller token: joiners may also send events.")


class SessionStart(_ClientMessage):
    """Start this connection's session (one per connection)."""

    type: Literal["session.start"]
    prompt: Annotated[str | None, Field(max_length=MAX_PROMPT_CHARS)] = None
    seed: Annotated[int, Field(ge=0, lt=2**32)] = 0
    model: Annotated[str | None, Field(max_length=64)] = None
    image: Annotated[
        str | None,
        Field(
            max_length=MAX_IMAGE_CHARS,
            description="Start image, base64: PNG or JPEG, or raw RGB bytes, of the model's frame size (the "
            "whole message is held to the server's --max-start-bytes).",
        ),
    ] = None
    references: Annotated[
        dict[Annotated[str, Field(max_length=32)], Annotated[str, Field(max_length=1_500_000)]] | None,
        Field(
            max_length=16,
            description="Reference images, for a model that takes them (its spec's reference_slots): one per "
            "slot name, all of them or none; each base64 PNG or JPEG of any size (resized to reference_size "
            "square, as the model's own pipeline does), or raw RGB of reference_size square.",
        ),
    ] = None
    options: StartOptions = StartOptions()
    share: ShareOptions = ShareOptions()
    queue: bool = Field(
        default=False,
        description="When the server is full, wait in line (session.queued notices, then session.started) "
        "instead of an admission_refused error.",
    )
    reservation: str | None = Field(
        default=None,
        max_length=64,
        description="From session.moved: this start's place on this front-end, where the service's line "
        "placed it (admitted at once; an unknown or lapsed one waits as any start does).",
    )


_TOKEN = Annotated[str, Field(min_length=1, max_length=128)]
_SESSION_ID = Annotated[str, Field(min_length=1, max_length=128)]


class SessionResume(_ClientMessage):
    """Take a parked session back after a dropped connection (within ``--resume-grace-s``)."""

    type: Literal["session.resume"]
    session_id: _SESSION_ID
    token: _TOKEN = Field(description="The resume_token of session.started (or session.joined).")
    last_seq: Annotated[int, Field(ge=-1, description="The last chunk seq received; -1 for none.")]
    keyframe: bool = Field(
        default=False,
        description="H.264: this client has no decoder state (a reloaded page, a restarted process, another "
        "device): start its stream again at an IDR frame with the init segment in front; the chunks before it "
        "are reported in chunk.skipped. Other media ignore it (every frame decodes alone).",
    )
    media: Media | None = Field(
        default=None,
        description="What this member is sent from now on (absent: as before); another media than before "
        "starts like a late joiner's (H.264: at the next IDR frame).",
    )


class SessionJoin(_ClientMessage):
    """Open a shared world as a viewer or a controller, with a token from its host's session.started."""

    type: Literal["session.join"]
    session_id: _SESSION_ID
    token: _TOKEN
    role: Literal["viewer", "controller"]
    media: Media | None = Field(
        default=None,
        description="What this member is sent (absent: the world's media, its host's): e.g. jpeg for a viewer "
        "that cannot decode the host's H.264. The world encodes each chunk once per media its members use, "
        "at that media's default quality (the host's media at the host's).",
    )


class InputEvent(_ClientMessage):
    """A prompt and/or control update; applied at the next chunk boundary."""

    type: Literal["input.event"]
    event_id: Annotated[int, Field(ge=0, lt=2**53)]
    prompt: Annotated[str | None, Field(max_length=MAX_PROMPT_CHARS)] = None
    controls: Annotated[list[ControlModel], Field(max_length=MAX_CONTROLS)] = []
    transition_chunks: Annotated[
        int | None,
        Field(
            ge=0,
            le=1024,
            description=(
                "With a prompt: blend the change over this many chunks, the k-th k/N of the way, the N-th the "
                "new prompt alone (vllm-omni's transition_chunks; 0 or 1: at once). Carried to the model as the "
                "prompt_transition control {chunks: N - 1}; a model that does not declare that track refuses it."
            ),
        ),
    ] = None


class SessionReset(_ClientMessage):
    type: Literal["session.reset"]


class SessionClose(_ClientMessage):
    type: Literal["session.close"]


class Ping(_ClientMessage):
    type: Literal["ping"]


class ChunkCancel(_ClientMessage):
    """Cancel the chunk being generated: the session goes on from its last commit, its events still queued."""

    type: Literal["chunk.cancel"]


class ChunkAck(_ClientMessage):
    """The client has played (or consumed) the chunk with this ``seq``; drives backpressure."""

    type: Literal["chunk.ack"]
    seq: Annotated[int, Field(ge=0)]


#: Any client message, parsed.
AnyClientMessage = (
    SessionStart
    | InputEvent
    | SessionReset
    | SessionClose
    | Ping
    | ChunkAck
    | SessionResume
    | SessionJoin
    | ChunkCancel
)

ClientMessage = Annotated[
    AnyClientMessage,
    Field(discriminator="type"),
]


@functools.cache
def optional_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of a server message (or of an object in one) that are left out when they do not apply:
    those whose default is None. Every other field is always present: required ones (a nullable one
    declared without a default is sent as ``null``) and those with another default."""
    return frozenset(
        name for name, field in model.model_fields.items() if not field.is_required() and field.default is None
    )


def _required_is_always_present(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The JSON Schema's ``required`` of a server message lists every field it always carries."""
    optional = optional_fields(model)
    schema["required"] = [field.alias or name for name, field in model.model_fields.items() if name not in optional]


class _Outgoing(_Message):
    """What the server sends: always-present fields are ``required`` in the schema (see :func:`optional_fields`)."""

    model_config = ConfigDict(json_schema_extra=_required_is_always_present)


class _ServerMessage(_Outgoing):
    id: str | None = None


class ShareTokens(_Outgoing):
    viewer: str | None = None
    controller: str | None = None


#: ``--lead`` as the sessions' messages tell it (started, joined, resumed): what a player's buffer
#: holds by design.
LeadChunks = Annotated[
    int,
    Field(
        description="Whole chunks the server makes ahead of playback (0: just in time, --lead jit): a player's "
        "queue holds about this many chunks beyond its own slack by design (always present)."
    ),
]


class SessionStarted(_ServerMessage):
    type: Literal["session.started"] = "session.started"
    session_id: str
    model: dict[str, Any]
    media: Media
    max_pending_events: int
    max_lag_chunks: int
    lead_chunks: LeadChunks
    resume_token: str | None = Field(
        default=None, description="Send it with session.resume after a dropped connection (absent: resume is off)."
    )
    resume_grace_s: float | None = Field(
        default=None, description="How long a dropped member's place is kept for session.resume (with resume_token)."
    )
    share: ShareTokens | None = Field(default=None, description="Tokens for session.join, as share asked.")
    url: str | None = Field(
        default=None,
        description="This front-end's own /v1/world URL, where a resume goes straight (absent: one front-end, "
        "no --public-url).",
    )


class SessionMoved(_ServerMessage):
    """Go to another front-end of this service: the world of a ``session.resume`` or ``session.join`` lives
    there, or a ``session.start`` waiting in the service's line starts there. Send the same message there
    (a new connection to ``url``, the same token; a start with ``reservation``). Nothing changed on this
    connection; it may close."""

    type: Literal["session.moved"] = "session.moved"
    url: str = Field(description="The /v1/world WebSocket URL of the front-end to go to.")
    session_id: str | None = Field(default=None, description="The world that lives there (a resume or join).")
    reservation: str | None = Field(
        default=None, description="A waiting start's place there: send session.start again with it (a start)."
    )


class SessionQueued(_ServerMessage):
    """The server is full: this start waits in line (first come, first served); sent at once, and
    again when the position changes or the estimate moved by a second or more (at most once a
    second). ``session.started`` follows when a slot opens; ``session.close`` leaves the line."""

    type: Literal["session.queued"] = "session.queued"
    position: int = Field(description="1: next to start.")
    ahead: int = Field(description="Starts ahead of this one.")
    eta_s: float | None = Field(
        description="About how many seconds until it starts, from the lengths of the sessions that ended on this "
        "server, counting down while it waits (always present: null until one has ended).",
    )


class SessionJoined(_ServerMessage):
    type: Literal["session.joined"] = "session.joined"
    session_id: str
    role: Literal["viewer", "controller"]
    model: dict[str, Any]
    media: Media
    max_pending_events: int
    max_lag_chunks: int
    lead_chunks: LeadChunks
    seq: int = Field(
        description="The world's last chunk seq, in this connection's numbering; the next chunk it gets is seq + 1."
    )
    resume_token: str | None = None
    resume_grace_s: float | None = Field(
        default=None, description="How long a dropped member's place is kept for session.resume (with resume_token)."
    )


class SessionResumed(_ServerMessage):
    type: Literal["session.resumed"] = "session.resumed"
    session_id: str
    role: Literal["host", "viewer", "controller"]
    model: dict[str, Any]
    media: Media
    max_pending_events: int
    max_lag_chunks: int
    lead_chunks: LeadChunks
    seq: int = Field(description="The world's last chunk seq now.")
    replayed: int = Field(description="Buffered chunks after last_seq that follow this message.")


class ChunkSkipped(_ServerMessage):
    """Chunks ``from_seq`` to ``to_seq`` (inclusive) were made but will not be sent to this connection."""

    type: Literal["chunk.skipped"] = "chunk.skipped"
    from_seq: int
    to_seq: int
    applied_event_ids: list[int] = Field(
        default_factory=list, description="This connection's events that the skipped chunks applied."
    )
    reason: Literal["lagged", "keyframe", "resume"] = Field(
        description="Why: lagged (a viewer max_lag_chunks behind), keyframe (H.264: this connection's stream "
        "starts at the next IDR frame, asked for at once: a late joiner, a resume with keyframe: true), resume "
        "(made while this connection was away and no longer buffered)."
    )


class ChunkTrack(_ServerMessage):
    """Over WebRTC (``/v1/webrtc``): chunk ``seq``'s first frame on the video track (its ``frame``-th) went out
    with RTP timestamp ``rtp``; every frame after it, until the next ``chunk.track``'s, is this chunk's (frames a
    peer is behind on are dropped, so a chunk may have fewer on the track than its header says, or none and no
    message)."""

    type: Literal["chunk.track"] = "chunk.track"
    seq: int
    frame: int = Field(ge=0, description="Its index in the chunk: 0 unless the frames before it were dropped.")
    rtp: int = Field(
        ge=0, lt=2**32, description="The RTP timestamp (90 kHz, with the stream's origin) of its first frame."
    )


class InputAccepted(_ServerMessage):
    type: Literal["input.accepted"] = "input.accepted"
    event_id: int
    status: Literal["accepted", "duplicate"]
    pending: int


class ChunkFrames(_Outgoing):
    """What the binary messages after a ``chunk`` hold: one per entry of ``sizes``, in order."""

    count: int = Field(description="Frames in the chunk.")
    media: Media
    width: int
    height: int
    sizes: list[int] = Field(
        description="The byte length of each binary message that follows: one per frame for jpeg and raw, "
        "one (the chunk's fMP4 fragment) for h264."
    )
    keyframe: bool | None = Field(default=None, description="h264: the fragment starts with an IDR frame.")
    init_bytes: int | None = Field(
        default=None,
        description="h264: the binary message starts with the stream's init segment (ftyp + moov) of this many "
        "bytes, then the fragment; 0: the fragment alone. Sent where this connection's stream starts: its first "
        "chunk, after a gap, or when the encoder started a new stream.",
    )
    sent: int | None = Field(
        default=None,
        description="In a chunk: its first frames already sent in chunk.part messages of the same seq (this "
        "connection asked for parts); sizes then list only the frames after them. Absent: none.",
    )


class ChunkTimes(_Outgoing):
    """Where one chunk's time went on the server, as instants of the server's monotonic clock (ms).

    Consecutive instants, so each part is a difference: ``accepted_ms`` (per applied event) ->
    ``tick_ms`` waiting for the tick that took it; ``tick_ms`` -> ``dispatched_ms`` the step's
    queue (snapshot, waiting in the engine for company or a worker); ``dispatched_ms`` ->
    ``stepped_ms`` the model's step (the batch's round trip to the worker, its encoding left
    out); ``stepped_ms`` -> ``encoded_ms`` encoding (the worker's for its batch and/or the
    server's); ``encoded_ms`` -> ``sent_ms`` handing the chunk to this connection."""

    clock: Literal["monotonic"] = Field(
        default="monotonic",
        description="The server's clock: CLOCK_MONOTONIC of its host (ms), comparable with a client on the same "
        "host; elsewhere only differences mean something.",
    )
    accepted_ms: list[float] = Field(description="Per applied event, in order: when the server accepted it.")
    tick_ms: float = Field(description="The tick that made this chunk was issued (its events snapshot).")
    dispatched_ms: float = Field(description="Its batch was dispatched to the worker.")
    stepped_ms: float = Field(description="The model's step was done (before any worker encoding).")
    encoded_ms: float = Field(description="The frames were encoded as this world's media.")
    sent_ms: float = Field(description="The chunk was handed to this connection's writer.")
    part_ms: float | None = Field(
        default=None,
        description="Its first part (chunk.part) was handed to this connection's writer: its first frames "
        "left then, before the step ended (stepped_ms and after are the whole chunk's). Absent: sent whole.",
    )


class ChunkMessage(_ServerMessage):
    """Header of one generated chunk; ``len(frames.sizes)`` binary messages follow it."""

    type: Literal["chunk"] = "chunk"
    seq: int
    epoch: int
    chunk_index: int
    request_id: str
    applied_event_ids: list[int]
    frames: ChunkFrames
    timings: dict[str, float] = Field(
        description="tick_ms: next_chunk() on the server (snapshot to commit); queued_ms: waiting in the engine "
        "for company or a worker; model_ms: the model's step for the whole batch; engine_ms: dispatch to result; "
        "encode_ms: encoding the frames (by the worker, for the whole batch, when workers encode; else by the "
        "server, for this chunk)."
    )
    batch_size: int = Field(description="Sessions in the model step that produced this chunk.")
    applied_latency_ms: list[float] = Field(
        description="Per applied event, in order: from its acceptance to this chunk's commit, on the server."
    )
    times: ChunkTimes | None = Field(
        default=None,
        description="Key-to-photon, the server's part: the instants of this chunk's way through the server "
        "(optional: a client may ignore it).",
    )
    supersedes: int | None = Field(
        default=None,
        description="A preemption: the seq of an earlier chunk, sent but not yet due to play, that input made "
        "again; this chunk takes its place (same chunk_index, its applied events again and any newer). Drop what "
        "is left of that one unplayed. Never sent to a world with an H.264 member (a fragment sent may be "
        "decoded already).",
    )


class ChunkPartMessage(_ServerMessage):
    """Frames of a chunk still being made (``session.start``'s ``options.parts``): ``len(frames.sizes)`` binary
    messages follow it, frames ``first`` .. ``first + frames.count - 1`` of the chunk ``seq`` will be. Its
    ``chunk`` message comes after its last part, with ``frames.sent``; a session that fails first never
    sends it (drop the parts then)."""

    type: Literal["chunk.part"] = "chunk.part"
    seq: int
    epoch: int
    chunk_index: int
    first: int = Field(description="The index in the chunk of this part's first frame.")
    frames: ChunkFrames


#: ``input.dropped``'s reasons: :class:`worldserve.session.DropReason`'s values.
DroppedReason = Literal["reset", "closed", "failed", "superseded"]


class InputDropped(_ServerMessage):
    type: Literal["input.dropped"] = "input.dropped"
    event_ids: list[int]
    reason: DroppedReason = Field(
        description="superseded: a newer event on the same continuous tracks replaced them in the queue "
        "(detail names it); it is applied in their place, and the chunks are the same as if they had been applied."
    )
    detail: str = ""


class SessionFailed(_ServerMessage):
    type: Literal["session.failed"] = "session.failed"
    code: str
    message: str


class SessionResetDone(_ServerMessage):
    type: Literal["session.reset"] = "session.reset"
    epoch: int


class SessionClosed(_ServerMessage):
    type: Literal["session.closed"] = "session.closed"
    reason: str


class ErrorMessage(_ServerMessage):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    event_id: int | None = None
    retry_after_ms: Annotated[
        int | None,
        Field(
            ge=0,
            description="A hint: try again after this many milliseconds (always set on admission_refused).",
        ),
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _hint_admission(cls, data: Any) -> Any:
        refused = isinstance(data, dict) and data.get("code") == ErrorCode.ADMISSION_REFUSED
        if refused and data.get("retry_after_ms") is None:
            data["retry_after_ms"] = ADMISSION_RETRY_AFTER_MS
        return data


class ChunkCancelled(_ServerMessage):
    """The reply to ``chunk.cancel``: chunk ``chunk_index`` will not be sent; the next chunk has that index."""

    type: Literal["chunk.cancelled"] = "chunk.cancelled"
    chunk_index: int


class Pong(_ServerMessage):
    type: Literal["pong"] = "pong"


ServerMessage = Annotated[
    SessionStarted
    | SessionMoved
    | SessionQueued
    | SessionJoined
    | SessionResumed
    | ChunkSkipped
    | ChunkTrack
    | InputAccepted
    | ChunkMessage
    | ChunkPartMessage
    | InputDropped
    | SessionFailed
    | SessionResetDone
    | SessionClosed
    | ErrorMessage
    | ChunkCancelled
    | Pong,
    Field(discriminator="type"),
]

_CLIENT_ADAPTER: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)
_SERVER_ADAPTER: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)
_CLIENT_TYPES = (
    "session.start",
    "input.event",
    "session.reset",
    "session.close",
    "ping",
    "chunk.ack",
    "session.resume",
    "session.join",
    "chunk.cancel",
)


class ClientMessageError(ValueError):
    """A client message that cannot be taken; ``code`` says why, ``message_id`` echoes its id."""

    def __init__(self, code: ErrorCode, message: str, message_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message_id = message_id


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False)[:4]:
        location = ".".join(str(step) for step in item["loc"][1:]) or "message"
        parts.append(f"{location}: {item['msg']}")
    return "; ".join(parts)


def parse_client_message(text: str) -> AnyClientMessage:
    """Parse one text message; raise :class:`ClientMessageError` with a stable code."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ClientMessageError(ErrorCode.INVALID_JSON, f"message is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ClientMessageError(ErrorCode.INVALID_MESSAGE, "message must be a JSON object with a 'type'.")
    message_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    if "\\u" in text and (where := _unpaired_surrogate(raw, "message")) is not None:
        # JSON may escape half of a UTF-16 pair ("\ud800"); no reply could carry it back.
        echo = None if message_id is None or _unpaired_surrogate(message_id, "") is not None else message_id
        raise ClientMessageError(
            ErrorCode.INVALID_MESSAGE, f"{where} holds an unpaired UTF-16 surrogate (not valid Unicode text).", echo
        )
    kind = raw.get("type")
    if kind not in _CLIENT_TYPES:
        raise ClientMessageError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}; expected one of {list(_CLIENT_TYPES)}.", message_id
        )
    try:
        return _CLIENT_ADAPTER.validate_python(raw)
    except ValidationError as error:
        raise ClientMessageError(ErrorCode.INVALID_MESSAGE, f"invalid {kind}: {_describe(error)}", message_id) from None


def _unpaired_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) in ``value`` that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "value"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _unpaired_surrogate(key, f"{path} key") or _unpaired_surrogate(item, f"{path}.{key}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _unpaired_surrogate(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def parse_server_message(text: str) -> Any:
    """Parse a server message (clients and tests use this)."""
    return _SERVER_ADAPTER.validate_json(text)


def wire_json(message: BaseModel) -> str:
    """``message`` as the server writes it: every always-present field, ``null`` or not; the optional
    ones (:func:`optional_fields`) only where they are set, in nested objects too."""
    return message.model_dump_json(by_alias=True, exclude=_unset_optionals(message) or None)


def _unset_optionals(message: BaseModel) -> dict[str, Any]:
    left_out: dict[str, Any] = {}
    optional = optional_fields(type(message))
    for name in type(message).model_fields:
        value = getattr(message, name)
        if value is None and name in optional:
            left_out[name] = True
        elif isinstance(value, BaseModel) and (inner := _unset_optionals(value)):
            left_out[name] = inner
    return left_out


def protocol_json_schema() -> dict[str, Any]:
    """JSON Schema of both directions, for ``docs/protocol.md``."""
    return {
        "client_to_server": _CLIENT_ADAPTER.json_schema(by_alias=True),
        "server_to_client": _SERVER_ADAPTER.json_schema(by_alias=True),
    }


if __name__ == "__main__":  # python -m worldserve.server.messages > docs/protocol.schema.json
    print(json.dumps(protocol_json_schema(), indent=2, sort_keys=True))
