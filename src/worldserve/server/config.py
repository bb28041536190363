"""Server settings: limits, pacing, security. One frozen value, validated once.

Must not know: sockets, sessions, models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from worldserve.ice import parse_ice_server
from worldserve.server.directory import world_url
from worldserve.server.pacing import Lead, Preempt

if TYPE_CHECKING:
    from worldserve.models.base import ModelSpec

__all__ = ["ServerConfig"]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What ``worldserve serve`` is configured with (see ``worldserve serve --help``)."""

    #: Bearer token required by ``/v1/*``, ``/metrics`` and the WebSocket (None: open).
    token: str | None = None
    #: Browser origins allowed to open the WebSocket, besides the server's own origin.
    allowed_origins: tuple[str, ...] = ()
    #: Largest client text message taken; larger ones get ``message_too_large`` ...
    max_message_bytes: int = 256 * 1024
    #: ... but for the one that starts a session (start and reference images), which may be this large.
    max_start_bytes: int = 4 * 1024 * 1024
    #: Input events per second a connection may send (token bucket refill rate) ...
    event_rate: float = 60.0
    #: ... and how many it may send in one burst.
    event_burst: int = 120
    #: A connection that sends nothing for this long is closed (seconds).
    idle_timeout: float = 300.0
    #: Generation pauses while this many chunks are un-acked (at most this many are in flight).
    max_lag_chunks: int = 3
    #: How many chunks generation may run ahead of playback time; 0 (the default): just in time
    #: (each chunk's tick on its worker's instant, playing ``lead_margin_s`` after it is due to be
    #: ready; pacing.py). N >= 1: N whole chunks ahead (a key waits behind them: docs/latency.md).
    lead_chunks: int = 0
    #: Just in time: the viewer's slack (seconds; None: one frame of the model).
    lead_margin_s: float | None = None
    #: Preemption on input (``auto``): an event that arrives while the chunk made (or being made)
    #: without it has not begun to play makes that chunk again with it, when it can still be
    #: ready a frame before its playout instant and its worker has the headroom (pacing.py);
    #: ``off``: the event waits for the next chunk.
    preempt: Literal["auto", "off"] = "auto"
    #: Issue each session's ticks at the instants of its worker's chunk clock, so sessions
    #: sharing a worker batch (False: each session paces alone, from its own first chunk).
    chunk_clock: bool = True
    #: A session whose connection drops (without a clean close) waits this long for ``session.resume``
    #: (seconds; 0: it closes at once, as a clean close does).
    resume_grace_s: float = 30.0
    #: A world is *in use* (never evicted to admit another) while a connected member acked a
    #: chunk, sent an event or arrived within this many seconds; a world whose members are all
    #: parked is not in use (seconds).
    evict_idle_s: float = 30.0
    #: ``session.start`` with ``queue: true`` waits in line while the server is full: at most
    #: this many wait (None: four times the session slots, at least 8) ...
    queue_max: int | None = None
    #: ... each at most this long (seconds); beyond either, ``admission_refused``.
    queue_timeout_s: float = 300.0
    #: The last chunks a session keeps, encoded, to re-send after a resume (at least ``max_lag_chunks``).
    replay_chunks: int = 8
    #: ``/v1/realtime/video``: the first message must be ``session.start`` within this long (vllm-omni: 10 s) ...
    realtime_start_timeout_s: float = 10.0
    #: ... and a session with no chunk sent and no ``session.ping`` this long ends (vllm-omni: 60 s).
    realtime_stall_timeout_s: float = 60.0
    #: How clients outside reach this front-end (``http://10.0.0.2:8000``, or a balancer's path to it:
    #: ``http://lb.example/fe/1``): told in ``session.started`` and, with a session directory, where the
    #: other front-ends send a resume or join for a world that lives here (None: one front-end).
    public_url: str | None = None
    #: A drain (SIGTERM, ``POST /admin/drain``) admits no more starts and lets the worlds here run this
    #: long at most before the server stops (seconds; 0: a SIGTERM stops at once, ending every world).
    drain_timeout_s: float = 0.0
    #: STUN/TURN servers for the server's WebRTC peers (``stun:stun.example:3478``,
    #: ``turn:USER:CREDENTIAL@turn.example:3478``: :func:`worldserve.ice.parse_ice_server`); none: host
    #: candidates only (a LAN, or tests on one machine).
    ice_servers: tuple[str, ...] = ()
    #: What a WHEP viewer's track carries: ``auto``, the world's own H.264 stream (encoded once for every
    #: H.264 member, only packetised per peer) when its offer takes H.264, else raw frames; ``raw``, raw frames
    #: always, which aiortc encodes per peer (VP8 or H.264, as the offer prefers).
    whep_media: Literal["auto", "raw"] = "auto"

    @property
    def world_url(self) -> str | None:
        """This front-end's ``/v1/world`` WebSocket URL, from ``public_url``."""
        return None if self.public_url is None else world_url(self.public_url)

    def __post_init__(self) -> None:
        if self.public_url is not None:
            world_url(self.public_url)  # refused now, with what a public URL must be
        if not self.drain_timeout_s >= 0:
            raise ValueError("drain_timeout_s must be non-negative.")
        if self.token is not None and not self.token.strip():
            raise ValueError("token must be non-empty when given.")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024.")
        if self.max_start_bytes < self.max_message_bytes:
            raise ValueError("max_start_bytes must be at least max_message_bytes.")
        if not self.event_rate > 0 or self.event_burst < 1:
            raise ValueError("event_rate must be positive and event_burst at least 1.")
        if not self.idle_timeout > 0:
            raise ValueError("idle_timeout must be positive.")
        if self.max_lag_chunks < 1 or self.lead_chunks < 0:
            raise ValueError("max_lag_chunks must be at least 1 and lead_chunks non-negative.")
        if self.lead_margin_s is not None and not self.lead_margin_s >= 0:
            raise ValueError("lead_margin_s must be non-negative.")
        for server in self.ice_servers:
            parse_ice_server(server)  # a bad URL stops the server at start, not its first peer
        if self.whep_media not in ("auto", "raw"):
            raise ValueError(f"whep_media must be 'auto' or 'raw'; got {self.whep_media!r}.")
        if self.preempt not in ("auto", "off"):
            raise ValueError(f"preempt must be 'auto' or 'off'; got {self.preempt!r}.")
        if not self.evict_idle_s > 0:
            raise ValueError("evict_idle_s must be positive.")
        if self.queue_max is not None and self.queue_max < 0:
            raise ValueError("queue_max must be zero or positive (0: no waiting line).")
        if not self.queue_timeout_s > 0:
            raise ValueError("queue_timeout_s must be positive.")
        if self.resume_grace_s < 0:
            raise ValueError("resume_grace_s must be non-negative.")
        if self.replay_chunks < self.max_lag_chunks:
            raise ValueError("replay_chunks must be at least max_lag_chunks.")
        if not self.realtime_start_timeout_s > 0 or not self.realtime_stall_timeout_s > 0:
            raise ValueError("realtime_start_timeout_s and realtime_stall_timeout_s must be positive.")

    def preempt_for(self, spec: ModelSpec) -> Preempt:
        """The preemption rule for a world of ``spec``'s model (off where it cannot roll back)."""
        return Preempt(self.preempt == "auto" and spec.can_rollback, 1.0 / spec.fps)

    def lead_for(self, spec: ModelSpec) -> Lead:
        """The pacing lead for a world of ``spec``'s model."""
        if self.lead_chunks:
            return Lead(self.lead_chunks)
        return Lead(0, 1.0 / spec.fps if self.lead_margin_s is None else self.lead_margin_s)
