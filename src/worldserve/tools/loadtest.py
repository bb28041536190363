"""``worldserve bench``: N concurrent clients against a running server, one table out.

Owns: a scripted client (start, steer with held-key and prompt events at a steady
rate, consume and acknowledge chunks), the books that prove no event was lost (each
accepted event is applied in exactly one chunk or reported in ``input.dropped``),
playback as a player would see it (chunk *k* plays at the first chunk's arrival plus
*k* periods, re-anchored after a stall: the late-chunk ratio and stall time per
session), arrivals (all at once, staggered by uniform random offsets, or open-loop at a
rate with a lifetime each), the capacity search (the most sessions held at <= 1 % late
chunks, by stepping the client count; a chunk is late when it finds the client's jitter buffer
run dry, or, asked, when it arrives after its fixed playout instant), and the summary tables: time to first chunk,
frames/s, late chunks, mean batch, event->applied latency percentiles against the bound
of one chunk period plus one chunk's compute. With
``viewers``, each session is shared and that many viewers join it (a run without
viewers goes first, so one table compares the server's CPU time per chunk and the
frames/s of both sides, read from the server's ``/metrics``); with ``drop_resume``,
every client loses its socket mid-run and resumes, and the books must still close
(0 lost, 0 applied twice across the resumes). And key-to-photon: per applied event, from
its send to the playout instant of the first frame of the chunk that applied it (as the
page's adaptive jitter buffer, :class:`~worldserve.tools.jitter.JitterBuffer`, plays it), split
into its parts (the server's from the chunk's ``times``, mapped to this client's clock)
with a check per chunk that the parts sum to the total within one frame.

Must not know: the server's internals (it is a plain client over the socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import math
import os
import random
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

from worldserve.client import ClientChunk, ClientPart, SessionInfo, WorldClient, WorldClientError, WorldError, keys
from worldserve.protocol import ControlInput
from worldserve.tools.jitter import JitterBuffer

__all__ = [
    "TABLE_NOTES",
    "BenchResult",
    "CapacityStep",
    "K2P_PARTS",
    "ClientReport",
    "LateBy",
    "KeyToPhoton",
    "ServerSample",
    "ViewerReport",
    "check_server",
    "find_capacity",
    "clock_offset",
    "format_capacity_table",
    "format_k2p_table",
    "format_table",
    "format_viewers_table",
    "held",
    "playout_instants",
    "playout_lateness",
    "run_bench",
    "run_viewers_bench",
    "start_image",
]

#: A session is held when at most this share of its chunks came late (see :data:`LateBy`).
LATE_LIMIT = 0.01

#: What counts a chunk late for the capacity search: ``"player"``, the chunks that found the client's
#: jitter buffer run dry (an underrun: what a viewer of the page sees stall), or ``"arrival"``, the
#: chunks that arrived after a fixed playout instant (chunk 0's arrival plus the slack, then a period
#: each, re-anchored after a stall; the figure before the page had a jitter buffer).
LateBy = Literal["player", "arrival"]
#: How a bench client's session travels: a WebSocket (/v1/world) or WebRTC (/v1/webrtc: the protocol on a data
#: channel, the frames on a video track).
Transport = Literal["ws", "webrtc"]

_HELD_CHOICES = ((), ("W",), ("A",), ("S",), ("D",), ("W", "D"), ("S", "A"))
_PROMPTS = ("islands", "desert dunes", "deep forest", "snowy tundra")


#: Key-to-photon's parts, in order (each ends where the next begins): the input's way to the
#: server; waiting for the tick that takes it; the step's queue; the model's step; encoding;
#: the server handing the chunk to the connection; the way back (until its last byte is in);
#: decoding; and the wait behind frames already queued in the player (until its playout).
K2P_PARTS = ("up", "wait_tick", "queue", "model", "encode", "handoff", "down", "decode", "playout")


@dataclass(frozen=True)
class KeyToPhoton:
    """One applied event's instants: ``sent``, ``arrived``, ``decoded``, ``shown`` on the client's
    clock (time.monotonic); ``accepted`` .. ``handed`` on the server's (its chunk's ``times``, s)."""

    sent: float
    accepted: float
    tick: float
    dispatched: float
    stepped: float
    encoded: float
    handed: float
    arrived: float
    decoded: float
    shown: float
    frame: float  # one frame of the model, seconds

    @property
    def total(self) -> float:
        return self.shown - self.sent

    def parts(self, offset: float) -> dict[str, float]:
        """The parts in seconds, the server's instants moved to the client's clock (server - ``offset``)."""
        instants = (
            self.sent,
            self.accepted - offset,
            self.tick - offset,
            self.dispatched - offset,
            self.stepped - offset,
            self.encoded - offset,
            self.handed - offset,
            self.arrived,
            self.decoded,
            self.shown,
        )
        return {name: end - begin for name, begin, end in zip(K2P_PARTS, instants[:-1], instants[1:], strict=True)}

    def sums(self, offset: float) -> bool:
        """The parts add up to the total within one frame."""
        return abs(sum(self.parts(offset).values()) - self.total) <= self.frame


def clock_offset(samples: list[KeyToPhoton], same_clock: bool) -> float:
    """The server's clock minus the client's: 0 when both read one host's CLOCK_MONOTONIC, else
    estimated NTP-style from the fastest one-way trips (assumed equal both ways): half the
    difference of the least (accepted - sent) and the least (arrived - handed)."""
    if same_clock or not samples:
        return 0.0
    up = min(sample.accepted - sample.sent for sample in samples)
    down = min(sample.arrived - sample.handed for sample in samples)
    return (up - down) / 2.0


def _same_host(url: str) -> bool:
    """The server is this machine (a loopback address): its monotonic clock is ours."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ClientReport:
    """What one client saw."""

    ttfc: float | None = None
    frames: int = 0
    chunks: int = 0
    seconds: float = 0.0
    sent: int = 0
    accepted: int = 0
    duplicates: int = 0
    applied_once: int = 0
    applied_twice: int = 0
    dropped: int = 0
    superseded: int = 0  # of dropped: replaced in the queue by a newer held-key event (reported, not lost)
    superseded_chunks: int = 0  # chunks received that a preemption replaced (not counted: their replacements are)
    lost: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_messages: list[str] = field(default_factory=list)  # what the server said, for the codes in ``errors``
    latencies: list[float] = field(default_factory=list)  # event sent -> its chunk received (client), seconds
    applied: list[float] = field(default_factory=list)  # event accepted -> its chunk committed (server), seconds
    boundary_wait: list[float] = field(default_factory=list)  # the same minus that chunk's own tick time
    compute: list[float] = field(default_factory=list)  # server compute per chunk, seconds
    queued: list[float] = field(default_factory=list)  # of that: waiting for a batch to start, seconds
    model: list[float] = field(default_factory=list)  # of that: inside the model's step, seconds
    batch_sizes: list[int] = field(default_factory=list)  # sessions in the step that made each chunk
    chunk_period: float = 0.0
    resumes: int = 0
    seq_gaps: int = 0  # chunks missing from the seq sequence (across resumes too)
    arrivals: list[float] = field(default_factory=list)  # when each chunk arrived (client clock)
    started_at: float | None = None  # when this client began (after its start offset)
    k2p: list[KeyToPhoton] = field(default_factory=list)  # per applied event of this client's
    playout_slack: float = 0.0  # its player shows chunk 0 this long after it arrives (seconds)
    underruns: int = 0  # its player's jitter buffer ran dry while live (tools/jitter.py)
    jitter_target: float | None = None  # that buffer's target at the end (frames)
    jitter_most: float | None = None  # and its largest (frames)
    #: Per chunk shown: when its first frame was shown (client clock) and when it was encoded (server clock).
    ages: list[tuple[float, float]] = field(default_factory=list)

    @property
    def late(self) -> tuple[int, float]:
        """Chunks that arrived after their playout instant, and the total stall (seconds)."""
        return playout_lateness(self.arrivals, self.chunk_period, self.playout_slack)

    @property
    def played_fps(self) -> float | None:
        """Frames a player at the model's rate shows per second: frames / (chunks x period + stall)."""
        if not self.arrivals or self.chunk_period <= 0 or self.chunks == 0:
            return None
        _, stall = self.late
        return self.frames / (len(self.arrivals) * self.chunk_period + stall)

    @property
    def late_ratio(self) -> float:
        late, _ = self.late
        return self._per_chunk_after_first(late)

    @property
    def underrun_ratio(self) -> float:
        """The player's view: underruns of its jitter buffer per chunk after the first (a viewer's stalls)."""
        return self._per_chunk_after_first(self.underruns)

    def _per_chunk_after_first(self, count: int) -> float:
        return count / (len(self.arrivals) - 1) if len(self.arrivals) > 1 else 0.0

    def late_by(self, by: LateBy) -> float:
        """The late ratio a capacity search holds to: ``"player"`` (the jitter buffer's underruns, what a
        viewer of the page sees) or ``"arrival"`` (chunks after a fixed-slack playout instant)."""
        return self.underrun_ratio if by == "player" else self.late_ratio


@dataclass(frozen=True)
class _Counted:
    """What one chunk added to a client's report, so that a preemption replacing it takes it back."""

    seq: int
    lengths: tuple[tuple[str, int], ...]
    chunks: int
    frames: int
    applied_event_ids: tuple[int, ...]

    _SERIES = ("arrivals", "compute", "queued", "model", "batch_sizes", "applied", "boundary_wait", "latencies", "k2p")

    @classmethod
    def mark(cls, chunk: ClientChunk, report: ClientReport) -> _Counted:
        """The report as it is before ``chunk`` is counted."""
        lengths = tuple((name, len(getattr(report, name))) for name in cls._SERIES)
        return cls(chunk.seq, lengths, report.chunks, report.frames, chunk.applied_event_ids)

    def undo(self, report: ClientReport, applied: Counter[int]) -> None:
        """Take the chunk back out: its samples, its frames, and its events' applications."""
        for name, length in self.lengths:
            del getattr(report, name)[length:]
        report.chunks, report.frames = self.chunks, self.frames
        for event_id in self.applied_event_ids:
            applied[event_id] -= 1
            if applied[event_id] <= 0:
                del applied[event_id]


@dataclass
class ViewerReport:
    """What one viewer joined to a session saw."""

    frames: int = 0
    chunks: int = 0
    seconds: float = 0.0
    skipped: int = 0  # chunks the server skipped for it (chunk.skipped)
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class ServerSample:
    """The server process's CPU seconds and its counters, read from ``/metrics``."""

    cpu_seconds: float
    chunks: float
    frames_sent: float
    media_bytes_sent: float = 0.0  # bytes of frames sent to every client, all media


@dataclass
class BenchResult:
    clients: int
    duration: float
    reports: list[ClientReport]
    viewers: list[ViewerReport] = field(default_factory=list)
    viewers_per_session: int = 0
    server: tuple[ServerSample, ServerSample] | None = None  # before, after
    arrivals: str = "all at once"
    same_clock: bool = True  # the server is on this host: one monotonic clock for both sides
    load: tuple[float, float] | None = None  # this host's 1-minute load average at the start and the end
    transport: Transport = "ws"

    @property
    def k2p(self) -> list[KeyToPhoton]:
        return [sample for report in self.reports for sample in report.k2p]

    @property
    def ages(self) -> list[float]:
        """Per chunk shown: how old it was as its first frame was shown, from when the server encoded it (s)."""
        offset = self.offset
        return [shown - (encoded - offset) for report in self.reports for shown, encoded in report.ages]

    @property
    def offset(self) -> float:
        """The server's clock minus the client's (see :func:`clock_offset`)."""
        return clock_offset(self.k2p, self.same_clock)


def playout_instants(arrivals: list[float], period: float, slack: float = 0.0) -> list[float]:
    """When a player shows each chunk's first frame (the model of :func:`playout_lateness`):
    chunk 0 ``slack`` after its arrival (a jitter buffer's start; 0: on arrival), chunk *k* one
    period after chunk *k-1*, or on its arrival if later."""
    shown: list[float] = []
    for arrival in arrivals:
        shown.append(arrival + slack if not shown else max(arrival, shown[-1] + period))
    return shown


def playout_lateness(arrivals: list[float], period: float, slack: float = 0.0) -> tuple[int, float]:
    """A player's view of chunk arrival times: how many came late, and the stall they caused.

    Chunk 0 plays ``slack`` after it arrives (0: on arrival); chunk *k* is due one period after
    chunk *k-1*'s playout. A chunk that arrives after it is due stalls playback until it
    arrives, and playback goes on from there (re-anchored).
    """
    if not arrivals or period <= 0:
        return 0, 0.0
    late, stall = 0, 0.0
    due = arrivals[0] + slack
    for arrival in arrivals[1:]:
        due += period
        if arrival > due:
            late += 1
            stall += arrival - due
            due = arrival
    return late, stall


async def check_server(url: str, token: str | None = None) -> str | None:
    """Before a run: None when a WebSocket to ``url`` opens (it is closed at once, cleanly);
    else why not, in one line (no server there, a refused token, not a WebSocket URL)."""
    try:
        async with WorldClient(url, token=token, open_timeout=10.0):
            pass
    except WorldClientError as error:
        return str(error)
    return None


def _http_get(url: str, token: str | None, path: str) -> str | None:
    """GET ``path`` of the server behind the WebSocket ``url`` (None: unreachable or refused)."""
    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "wss" else "http"
    request = urllib.request.Request(f"{scheme}://{parts.netloc}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())
    except OSError:
        return None


def _read_sample(url: str, token: str | None) -> ServerSample | None:
    text = _http_get(url, token, "/metrics")
    if text is None:
        return None
    values: dict[str, float] = {}
    media_bytes = 0.0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("process_cpu_seconds_total", "worldserve_chunks_total", "worldserve_frames_sent_total"):
            values[name] = float(value)
        elif name.startswith("worldserve_media_bytes_sent_total{"):
            media_bytes += float(value)
    if "process_cpu_seconds_total" not in values:
        return None
    return ServerSample(
        values["process_cpu_seconds_total"],
        values.get("worldserve_chunks_total", 0.0),
        values.get("worldserve_frames_sent_total", 0.0),
        media_bytes,
    )


def _read_spec(url: str, token: str | None) -> dict[str, Any] | None:
    """The served model's spec from ``/v1/models`` (None: not there, or not readable)."""
    text = _http_get(url, token, "/v1/models")
    try:
        data = None if text is None else json.loads(text)
    except ValueError:
        return None
    models = data.get("data") if isinstance(data, dict) else None
    return models[0] if isinstance(models, list) and models and isinstance(models[0], dict) else None


def start_image(height: int, width: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """A start image for a model that needs one (``requires_image``): smooth colour gradients, some
    bands and a horizon, different per ``seed``; the bench sends it with each session's start."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    phase = rng.uniform(0.0, 2 * np.pi, size=3).astype(np.float32)
    horizon = (y > rng.uniform(0.35, 0.65)).astype(np.float32)
    channels = [0.5 + 0.35 * np.sin(6.0 * x + 3.0 * y + p) - 0.2 * horizon for p in phase]
    image: npt.NDArray[np.uint8] = (np.clip(np.stack(channels, axis=-1), 0.0, 1.0) * 255.0).astype(np.uint8)
    return image


def _webrtc_client(url: str, token: str | None) -> WorldClient:
    try:
        from worldserve.webrtc_client import WebRTCWorldClient
    except ImportError as error:  # pragma: no cover - depends on the extra
        raise SystemExit("--transport webrtc needs the webrtc extra: pip install 'worldserve[webrtc]'.") from error
    return WebRTCWorldClient(url, token=token, auto_ack=False, ack_on_show=True)


def _takes_keys(spec: dict[str, Any]) -> bool:
    """Whether ``spec``'s model has the ``keys`` track the bench steers with."""
    return any(control.get("track") == "keys" for control in spec.get("controls", []))


async def _run_viewer(url: str, token: str | None, session: SessionInfo, stop: asyncio.Event) -> ViewerReport:
    report = ViewerReport()
    assert session.viewer_token is not None
    try:
        async with WorldClient(url, token=token) as client:
            await client.join(session.session_id, session.viewer_token)
            started = time.monotonic()

            async def consume() -> None:
                last: tuple[int, int] | None = None  # (seq, frames) of the last chunk
                async for chunk in client.chunks():
                    if chunk.supersedes is not None and last is not None and last[0] == chunk.supersedes:
                        report.chunks -= 1  # a preemption replaced it: its replacement is counted instead
                        report.frames -= last[1]
                    report.chunks += 1
                    report.frames += int(chunk.frames.shape[0])
                    last = (chunk.seq, int(chunk.frames.shape[0]))

            consumer = asyncio.create_task(consume())
            await stop.wait()
            report.seconds = time.monotonic() - started
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            report.skipped = sum(last - first + 1 for first, last in client.skipped)
    except (WorldError, WorldClientError, OSError) as error:
        report.errors[getattr(error, "code", type(error).__name__)] += 1
    return report


async def _run_client(
    url: str,
    token: str | None,
    duration: float,
    event_interval: float,
    seed: int,
    settle: float,
    *,
    viewers: int = 0,
    drop_resume: bool = False,
    viewer_reports: list[ViewerReport] | None = None,
    delay: float = 0.0,
    media: str = "raw",
    playout_slack_frames: float = 0.0,
    image: npt.NDArray[np.uint8] | None = None,
    transport: Transport = "ws",
    parts: bool = False,
) -> ClientReport:
    report = ClientReport()
    rng = random.Random(seed)
    if delay > 0:
        await asyncio.sleep(delay)
    report.started_at = time.monotonic()
    sent_at: dict[int, float] = {}
    applied: Counter[int] = Counter()
    accepted: set[int] = set()
    try:
        # It acks a chunk as its player shows the chunk's first frame, as the page does. Over WebRTC frames come
        # paced by the server and a player shows each as it is decoded: the client acks then itself.
        webrtc = transport == "webrtc"
        client = _webrtc_client(url, token) if webrtc else WorldClient(url, token=token, auto_ack=False)
        async with client:
            started = time.monotonic()
            info = await client.start(
                prompt=rng.choice(_PROMPTS),
                seed=seed,
                image=image,
                media=media,
                share_viewers=viewers > 0,
                parts=parts,
            )
            report.chunk_period = info.model["frames_per_chunk"] / info.model["fps"]
            stop_viewers = asyncio.Event()
            viewer_tasks = [asyncio.create_task(_run_viewer(url, token, info, stop_viewers)) for _ in range(viewers)]

            progress = asyncio.Event()
            connected = asyncio.Event()
            connected.set()
            last_seq: int | None = None
            frame = 1.0 / float(info.model["fps"])
            report.playout_slack = playout_slack_frames * frame
            # The page's player: its adaptive jitter buffer, starting at the slack given.
            per_chunk = int(info.model["frames_per_chunk"])
            player = JitterBuffer(frame, per_chunk, start=playout_slack_frames, ahead=info.lead_chunks * per_chunk)
            previous: _Counted | None = None  # what the last chunk added to the report (a preemption undoes it)
            acks: dict[int, asyncio.TimerHandle] = {}  # seq -> its ack, due as its first frame plays
            loop = asyncio.get_running_loop()

            sending: set[asyncio.Task[None]] = set()  # acks on their way (a reference keeps each alive)

            def send_ack(seq: int) -> None:
                acks.pop(seq, None)
                task = loop.create_task(client.ack(seq))
                sending.add(task)
                task.add_done_callback(sending.discard)

            def ack_at(seq: int, at: float | None) -> None:
                delay = 0.0 if at is None else max(0.0, at - time.monotonic())
                acks[seq] = loop.call_later(delay, send_ack, seq)

            # A chunk in parts: its frames queue as each part is decoded; its first frame's instant is kept
            # for when the chunk itself comes (it is acked then at the soonest: the server knows its seq then).
            part_played: dict[int, float | None] = {}
            part_ready: dict[int, float] = {}  # seq -> when its first frame could play with none of its parts late

            def on_part(part: ClientPart) -> None:
                played = player.arrive(part.seq, int(part.frames.shape[0]), part.received_at, first=part.first)
                ready = part.received_at - part.first * frame
                if part.first == 0:
                    part_played[part.seq] = played
                    part_ready[part.seq] = ready
                else:
                    part_ready[part.seq] = max(part_ready.get(part.seq, ready), ready)

            client.on_part = on_part

            async def consume() -> None:
                nonlocal last_seq, previous
                while True:
                    try:
                        chunk = await client.next_chunk()
                    except WorldClientError:
                        if connected.is_set():
                            return  # closed for good
                        await connected.wait()  # dropped: the resume brings the chunks back
                        continue
                    progress.set()
                    if chunk.supersedes is not None and previous is not None and previous.seq == chunk.supersedes:
                        # A preemption: the last chunk was made again with newer input; it is never shown.
                        previous.undo(report, applied)
                        player.supersede(previous.seq, chunk.received_at)  # the new one plays instead
                        if (handle := acks.pop(previous.seq, None)) is not None:
                            handle.cancel()  # never played: never acked
                        report.superseded_chunks += 1
                    mark = _Counted.mark(chunk, report)
                    ready = part_ready.pop(chunk.seq, None) if chunk.parted else None
                    if ready is not None and chunk.frames.shape[0] > chunk.parted:  # the rest came with the chunk
                        ready = max(ready, chunk.received_at - chunk.parted * frame)
                    report.arrivals.append(chunk.received_at if ready is None else ready)
                    if webrtc:  # its first frame was shown as it was decoded (none: it never showed)
                        seen = chunk.frames.shape[0] > 0
                        shown = chunk.received_at
                    elif chunk.parted:  # its first frames came in parts (queued then); the rest now
                        rest = int(chunk.frames.shape[0]) - chunk.parted
                        player.arrive(chunk.seq, rest, chunk.received_at, first=chunk.parted)
                        played = part_played.pop(chunk.seq, None)
                        shown = played if played is not None else (chunk.first_part_at or chunk.received_at)
                        seen = True
                        ack_at(chunk.seq, played)
                    else:
                        played = player.arrive(chunk.seq, int(chunk.frames.shape[0]), chunk.received_at)
                        shown = chunk.received_at if played is None else played
                        seen = True
                        ack_at(chunk.seq, played)
                    if last_seq is not None and chunk.seq > last_seq + 1:
                        report.seq_gaps += chunk.seq - last_seq - 1
                    last_seq = chunk.seq
                    if report.ttfc is None:
                        report.ttfc = chunk.received_at - started
                    report.chunks += 1
                    report.frames += int(chunk.frames.shape[0])
                    tick = chunk.timings.get("tick_ms", 0.0) / 1000.0
                    report.compute.append(tick)
                    report.queued.append(chunk.timings.get("queued_ms", 0.0) / 1000.0)
                    report.model.append(chunk.timings.get("model_ms", 0.0) / 1000.0)
                    report.batch_sizes.append(chunk.batch_size)
                    for ms in chunk.applied_latency_ms:
                        report.applied.append(ms / 1000.0)
                        report.boundary_wait.append(ms / 1000.0 - tick)
                    for event_id in chunk.applied_event_ids:
                        applied[event_id] += 1
                        if event_id in sent_at:
                            report.latencies.append(chunk.received_at - sent_at[event_id])
                    times = chunk.times
                    if times is not None and seen:
                        report.ages.append((shown, times["encoded_ms"] / 1000.0))
                    if times is not None and chunk.arrived_at is not None and seen:
                        # A chunk in parts: its first frames left with its first part, made and encoded before the
                        # step ended (the step's part runs to that part's handing-over; encode is in it).
                        part_ms = times.get("part_ms") if chunk.parted else None
                        first_out = None if part_ms is None else part_ms / 1000.0
                        dispatched = times["dispatched_ms"] / 1000.0
                        for event_id, accepted_ms in zip(chunk.applied_event_ids, times["accepted_ms"], strict=False):
                            if event_id not in sent_at:
                                continue
                            report.k2p.append(
                                KeyToPhoton(
                                    sent=sent_at[event_id],
                                    accepted=accepted_ms / 1000.0,
                                    tick=times["tick_ms"] / 1000.0,
                                    dispatched=dispatched,
                                    stepped=times["stepped_ms"] / 1000.0 if first_out is None else first_out,
                                    encoded=times["encoded_ms"] / 1000.0 if first_out is None else first_out,
                                    handed=times["sent_ms"] / 1000.0 if first_out is None else first_out,
                                    arrived=chunk.arrived_at
                                    if first_out is None or chunk.first_part_arrived_at is None
                                    else chunk.first_part_arrived_at,
                                    decoded=chunk.received_at
                                    if first_out is None or chunk.first_part_at is None
                                    else chunk.first_part_at,
                                    shown=shown,
                                    frame=frame,
                                )
                            )
                    previous = mark

            consumer = asyncio.create_task(consume())
            event_id = 0
            steer_keys = _takes_keys(info.model)
            steering = time.monotonic()  # it steers for ``duration`` once its session started, however slow that was
            deadline = steering + duration
            drop_at = steering + duration * rng.uniform(0.3, 0.7) if drop_resume else None
            while time.monotonic() < deadline:
                if drop_at is not None and time.monotonic() >= drop_at:
                    drop_at = None
                    connected.clear()
                    player.set_live(False, time.monotonic())  # running dry now is no underrun
                    await client.drop()  # no close handshake: the server parks the session
                    await asyncio.sleep(report.chunk_period)  # the chunk in flight commits meanwhile
                    await client.resume()
                    player.set_live(True, time.monotonic())
                    connected.set()
                    report.resumes += 1
                await asyncio.sleep(event_interval * rng.uniform(0.5, 1.5))
                event_id += 1
                controls: list[ControlInput] = [keys(*rng.choice(_HELD_CHOICES))] if steer_keys else []
                # A model without keys is steered by its prompt: every event carries one then.
                prompt = rng.choice(_PROMPTS) if rng.random() < 0.1 or not controls else None
                sent_at[event_id] = time.monotonic()
                report.sent += 1
                try:
                    acceptance = await client.send_event(event_id=event_id, prompt=prompt, controls=controls)
                except WorldError as error:
                    report.errors[error.code] += 1
                    report.error_messages.append(str(error))
                    continue
                if acceptance.status == "accepted":
                    accepted.add(event_id)
                else:
                    report.duplicates += 1
            # Let every accepted event reach a chunk, then close (which reports any drops).
            settle_until = time.monotonic() + settle
            while (
                not accepted <= set(applied) | {event for notice in client.dropped for event in notice.event_ids}
                and (remaining := settle_until - time.monotonic()) > 0
            ):
                progress.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await progress.wait()
            report.seconds = time.monotonic() - started
            player.set_live(False, time.monotonic())
            report.underruns, report.jitter_target, report.jitter_most = player.underruns, player.target, player.most
            stop_viewers.set()
            reports = await asyncio.gather(*viewer_tasks)
            if viewer_reports is not None:
                viewer_reports.extend(reports)
            await client.close()
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            for handle in acks.values():  # the session is closed: nothing more to ack
                handle.cancel()
            dropped = {event for notice in client.dropped for event in notice.event_ids}
            for event_id in client.skipped_applied:  # applied in chunks this client never got
                applied[event_id] += 1
            report.seq_gaps -= sum(last - first + 1 for first, last in client.skipped)  # told, so not missing
            superseded = {
                event for notice in client.dropped if notice.reason == "superseded" for event in notice.event_ids
            }
    except (WorldError, WorldClientError, OSError) as error:
        report.errors[getattr(error, "code", type(error).__name__)] += 1
        report.error_messages.append(str(error))
        return report
    report.accepted = len(accepted)
    report.applied_once = sum(1 for event in accepted if applied[event] == 1)
    report.applied_twice = sum(1 for event in accepted if applied[event] > 1)
    report.dropped = len((accepted - set(applied)) & dropped)
    report.superseded = len((accepted - set(applied)) & superseded)
    report.lost = len(accepted - set(applied) - dropped)
    return report


async def run_bench(
    url: str,
    *,
    clients: int = 32,
    duration: float = 60.0,
    event_interval: float = 0.25,
    token: str | None = None,
    settle: float = 5.0,
    viewers: int = 0,
    drop_resume: bool = False,
    stagger: float = 0.0,
    arrival_rate: float | None = None,
    session_seconds: float | None = None,
    seed: int = 0,
    media: str = "raw",
    playout_slack_frames: float = 0.0,
    transport: Transport = "ws",
    same_clock: bool | None = None,
    parts: bool = False,
) -> BenchResult:
    """Run sessions against ``url`` and gather what each client (and each viewer) saw.

    Closed loop (the default): ``clients`` sessions, each steered for ``duration`` seconds
    from the moment it started (a slow start does not shorten it), each starting after a
    uniform random offset in ``[0, stagger]``. Open loop
    (``arrival_rate``): sessions arrive at that rate (exponential gaps) for ``duration``
    seconds and each lives ``session_seconds`` (default: ``duration``). ``viewers`` join
    each session; with ``drop_resume`` every client loses its socket once and resumes.
    ``media``: how the sessions' frames travel (raw, jpeg or h264; clients decode them all).
    ``playout_slack_frames``: each client's player shows its first chunk this many frames after it
    arrives (0: on arrival), which the late-chunk figures count from; it is also where each
    client's jitter buffer (:class:`~worldserve.tools.jitter.JitterBuffer`, the page's rule, which
    key-to-photon's playout follows) starts its target (the page: 1).
    ``transport``: ``webrtc`` runs each session over ``/v1/webrtc`` (frames decoded from its video track, each
    chunk shown as its first frame is decoded; viewers stay on WebSockets). ``same_clock``: the server reads this
    machine's monotonic clock (``None``: when ``url`` is a loopback address; another network namespace of this
    machine is the same clock too), else its offset is estimated. ``parts``: each client takes its chunks'
    frames in parts as the model makes them (``options.parts``; JPEG or raw) and plays them as they come.
    """
    rng = random.Random(seed)
    lifetime = session_seconds if session_seconds is not None else duration
    if arrival_rate is not None:
        if not arrival_rate > 0:
            raise ValueError(f"arrival_rate must be positive; got {arrival_rate!r}.")
        offsets: list[float] = []
        at = rng.expovariate(arrival_rate)
        while at < duration:
            offsets.append(at)
            at += rng.expovariate(arrival_rate)
        arrivals = f"open loop: {arrival_rate:g} sessions/s for {duration:g} s, {lifetime:g} s each"
    else:
        offsets = [rng.uniform(0.0, stagger) if stagger > 0 else 0.0 for _ in range(clients)]
        arrivals = f"staggered: uniform offsets in [0, {stagger:g}] s" if stagger > 0 else "all at once"
    before = await asyncio.to_thread(_read_sample, url, token)
    spec = await asyncio.to_thread(_read_spec, url, token)
    image_size = (int(spec["height"]), int(spec["width"])) if spec and spec.get("requires_image") else None
    load_before = _load()
    viewer_reports: list[ViewerReport] = []
    reports = await asyncio.gather(
        *(
            _run_client(
                url,
                token,
                lifetime,
                event_interval,
                index,
                settle,
                viewers=viewers,
                drop_resume=drop_resume,
                viewer_reports=viewer_reports,
                delay=offset,
                media=media,
                playout_slack_frames=playout_slack_frames,
                image=None if image_size is None else start_image(*image_size, index),
                transport=transport,
                parts=parts,
            )
            for index, offset in enumerate(offsets)
        )
    )
    after = await asyncio.to_thread(_read_sample, url, token)
    return BenchResult(
        clients=len(offsets),
        duration=lifetime,
        reports=list(reports),
        viewers=viewer_reports,
        viewers_per_session=viewers,
        server=None if before is None or after is None else (before, after),
        arrivals=arrivals,
        same_clock=_same_host(url) if same_clock is None else same_clock,
        transport=transport,
        load=None if load_before is None or (load_after := _load()) is None else (load_before, load_after),
    )


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def held(result: BenchResult, limit: float = LATE_LIMIT, by: LateBy = "player") -> bool:
    """Every session started, got chunks, hit no error and had at most ``limit`` late chunks, counted
    ``by`` its player's underruns or by arrival (:meth:`ClientReport.late_by`)."""
    return bool(result.reports) and all(
        report.chunks > 1 and not report.errors and report.late_by(by) <= limit for report in result.reports
    )


@dataclass
class CapacityStep:
    clients: int
    result: BenchResult
    held: bool
    late_by: LateBy = "player"  # what counted a chunk late for ``held``


async def find_capacity(
    url: str,
    *,
    start: int = 1,
    max_clients: int = 64,
    limit: float = LATE_LIMIT,
    duration: float = 20.0,
    stagger: float = 0.0,
    event_interval: float = 0.25,
    token: str | None = None,
    settle: float = 5.0,
    seed: int = 0,
    media: str = "raw",
    playout_slack_frames: float = 1.0,
    late_by: LateBy = "player",
) -> tuple[int, list[CapacityStep]]:
    """The most concurrent sessions held at <= ``limit`` late chunks, and every step measured.

    Steps the client count up from ``start`` (doubling) until a count is not held, then
    bisects between the last held count and it. Each step is a closed-loop
    :func:`run_bench` with these arguments (``media``: how its sessions' frames travel;
    ``playout_slack_frames``: where each client's jitter buffer starts, the page's 1 frame by
    default). ``late_by``: what counts a chunk late (:data:`LateBy`).
    """
    steps: list[CapacityStep] = []

    async def probe(clients: int) -> bool:
        result = await run_bench(
            url,
            clients=clients,
            duration=duration,
            stagger=stagger,
            event_interval=event_interval,
            token=token,
            settle=settle,
            seed=seed,
            media=media,
            playout_slack_frames=playout_slack_frames,
        )
        ok = held(result, limit, late_by)
        steps.append(CapacityStep(clients, result, ok, late_by))
        return ok

    good, bad = 0, None
    clients = max(1, start)
    while clients <= max_clients:
        if not await probe(clients):
            bad = clients
            break
        good = clients
        clients = min(clients * 2, max_clients) if clients < max_clients else max_clients + 1
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if await probe(middle):
            good = middle
        else:
            bad = middle
    return good, steps


async def run_viewers_bench(
    url: str,
    *,
    clients: int,
    duration: float,
    event_interval: float,
    viewers: int,
    token: str | None = None,
    drop_resume: bool = False,
    media: str = "raw",
) -> tuple[BenchResult, BenchResult]:
    """The same load without viewers, then with ``viewers`` joined to each session: the two sides of one table."""
    common: dict[str, Any] = {
        "clients": clients,
        "duration": duration,
        "event_interval": event_interval,
        "token": token,
        "drop_resume": drop_resume,
        "media": media,
    }
    alone = await run_bench(url, **common)
    shared = await run_bench(url, viewers=viewers, **common)
    return alone, shared


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def format_table(result: BenchResult) -> str:
    """The bench summary as a fixed-width table."""
    reports = result.reports
    ttfc = [r.ttfc for r in reports if r.ttfc is not None]
    fps = [r.frames / r.seconds for r in reports if r.seconds > 0]
    played = [value for r in reports if (value := r.played_fps) is not None]
    latencies = [value for r in reports for value in r.latencies]
    server_side = [value for r in reports for value in r.applied]
    waits = [value for r in reports for value in r.boundary_wait]
    compute = [value for r in reports for value in r.compute]
    queued = [value for r in reports for value in r.queued]
    model = [value for r in reports for value in r.model]
    batch_sizes = [value for r in reports for value in r.batch_sizes]
    period = max((r.chunk_period for r in reports), default=0.0)
    bound = period + (statistics.median(compute) if compute else 0.0)
    p99 = _percentile(server_side, 0.99)
    wait_p99 = _percentile(waits, 0.99)
    errors: Counter[str] = Counter()
    for report in reports:
        errors.update(report.errors)
    late = [r.late_ratio for r in reports if r.chunks > 1]
    stalls = [r.late[1] for r in reports if r.chunks > 1]
    refused = sum(1 for r in reports if r.errors.get("admission_refused"))
    rows = [
        ("clients", f"{result.clients} ({result.arrivals}), over {result.transport}"),
        ("duration per client (s)", f"{result.duration:.0f}"),
        ("chunks received", f"{sum(r.chunks for r in reports)}"),
        (
            "frames/s per client, played (mean / min)",
            f"{statistics.mean(played):.1f} / {min(played):.1f}" if played else "-",
        ),
        ("frames/s per client (mean / min)", f"{statistics.mean(fps):.1f} / {min(fps):.1f}" if fps else "-"),
        (
            "late chunks % (mean / worst session); sessions over 1 %",
            f"{statistics.mean(late) * 100:.2f} / {max(late) * 100:.2f}; "
            f"{sum(1 for value in late if value > LATE_LIMIT)}"
            if late
            else "-",
        ),
        (
            "stall s per session (mean / worst)",
            f"{statistics.mean(stalls):.2f} / {max(stalls):.2f}" if stalls else "-",
        ),
        ("mean batch size (of the chunks received)", f"{statistics.mean(batch_sizes):.2f}" if batch_sizes else "-"),
        ("sessions refused (admission_refused)", f"{refused}"),
        (
            "time to first chunk ms (p50 / p99)",
            f"{_percentile(ttfc, 0.5) * 1000:.0f} / {_percentile(ttfc, 0.99) * 1000:.0f}" if ttfc else "-",
        ),
        ("chunk compute ms (p50)", f"{statistics.median(compute) * 1000:.1f}" if compute else "-"),
        (
            "  of it: queued for a batch / in the model (p50 ms); batch size (mean)",
            f"{_percentile(queued, 0.5) * 1000:.1f} / {_percentile(model, 0.5) * 1000:.1f}; "
            f"{statistics.mean(batch_sizes):.1f}"
            if batch_sizes
            else "-",
        ),
        (
            "event accepted->applied ms, server (p50 / p99 / max)",
            f"{_percentile(server_side, 0.5) * 1000:.0f} / {p99 * 1000:.0f} / {max(server_side, default=0) * 1000:.0f}",
        ),
        (
            "bound, overall: p99 vs chunk period + compute p50 (ms)",
            f"{p99 * 1000:.1f} vs {bound * 1000:.1f} ({'met' if p99 <= bound else 'MISSED'})"
            if server_side
            else "- (no events applied)",
        ),
        (
            "bound, per event: p99 of (applied - its chunk's compute) vs period (ms)",
            f"{wait_p99 * 1000:.1f} vs {period * 1000:.1f} ({'met' if wait_p99 <= period else 'MISSED'})"
            if waits
            else "- (no events applied)",
        ),
        (
            "event sent->chunk received ms, client (p50 / p99)",
            f"{_percentile(latencies, 0.5) * 1000:.0f} / {_percentile(latencies, 0.99) * 1000:.0f}",
        ),
        (
            "events sent / accepted / duplicate",
            f"{sum(r.sent for r in reports)} / {sum(r.accepted for r in reports)}"
            f" / {sum(r.duplicates for r in reports)}",
        ),
        (
            "applied exactly once / dropped (reported; of them superseded)",
            f"{sum(r.applied_once for r in reports)} / {sum(r.dropped for r in reports)}"
            f" ({sum(r.superseded for r in reports)})",
        ),
        ("lost / applied twice", f"{sum(r.lost for r in reports)} / {sum(r.applied_twice for r in reports)}"),
        (
            "drops resumed / chunks missing from seq",
            f"{sum(r.resumes for r in reports)} / {sum(r.seq_gaps for r in reports)}",
        ),
        ("errors", ", ".join(f"{code}={count}" for code, count in sorted(errors.items())) or "0"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 24}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    said = next((message for r in reports for message in r.error_messages), None)
    if said is not None:
        lines.append(f"first error: {said[:300]}")
    lines += ["", format_k2p_table(result), "", *TABLE_NOTES]
    return "\n".join(lines)


def format_k2p_table(result: BenchResult) -> str:
    """Key-to-photon: p50 / p95 / p99 of the total and of each part (ms), and the per-chunk sum check."""
    samples = result.k2p
    offset = result.offset
    parts = [sample.parts(offset) for sample in samples]
    columns = [("total", [sample.total for sample in samples])]
    columns += [(name, [part[name] for part in parts]) for name in K2P_PARTS]
    width = max(len("key-to-photon ms"), *(len(name) + 2 for name, _ in columns))
    lines = [
        f"{'key-to-photon ms':<{width}}  {'p50':>8}  {'p95':>8}  {'p99':>8}",
        f"{'-' * width}  {'-' * 8}  {'-' * 8}  {'-' * 8}",
    ]
    for index, (name, values) in enumerate(columns):
        label = name if index == 0 else f"  {name}"
        cells = [_percentile(values, q) * 1000 for q in (0.5, 0.95, 0.99)]
        lines.append(f"{label:<{width}}  " + "  ".join("-".rjust(8) if math.isnan(c) else f"{c:8.1f}" for c in cells))
    ages = result.ages
    if ages:
        aged = " / ".join(f"{_percentile(ages, q) * 1000:.0f}" for q in (0.5, 0.99, 1.0))
        lines.append(f"chunks shown: age of the first frame (shown - encoded) ms p50 / p99 / max: {aged}")
    mismatched = sum(1 for sample in samples if not sample.sums(offset))
    clock = (
        "one clock (the server is on this host: CLOCK_MONOTONIC both sides)"
        if result.same_clock
        else f"the server's clock mapped by an estimated offset of {offset * 1000:.1f} ms (fastest trips, "
        "assumed equal each way)"
    )
    lines.append(
        f"events measured: {len(samples)}; parts summing to the total within a frame: "
        f"{len(samples) - mismatched} ({mismatched} off); clock: {clock}"
    )
    targets = [r.jitter_target for r in result.reports if r.jitter_target is not None]
    if result.transport == "webrtc":
        lines.append(
            "over WebRTC: down runs from the handoff to the chunk's first frame decoded from the video track (the "
            "track's pacing at the model's frame rate, the encode, the network, aiortc's receiver and decoder); a "
            "WebRTC player shows a frame as it is decoded, so decode and playout are 0"
        )
    elif targets:
        most = max(r.jitter_most for r in result.reports if r.jitter_most is not None)
        lines.append(
            f"players' jitter buffers (frames; tools/jitter.py): final target p50 / max "
            f"{statistics.median(targets):g} / {max(targets):g}, largest {most:g}; "
            f"underruns {sum(r.underruns for r in result.reports)}"
        )
    if result.load is not None:
        lines.append(f"load average (1 min) at start / end: {result.load[0]:.2f} / {result.load[1]:.2f}")
    return "\n".join(lines)


def _bytes_per_second(result: BenchResult) -> str:
    """Frame bytes the server sent per second, over every client and viewer (kB/s)."""
    if result.server is None or result.duration <= 0:
        return "-"
    before, after = result.server
    return f"{(after.media_bytes_sent - before.media_bytes_sent) / result.duration / 1000:.1f}"


#: What the bench table's less obvious rows mean (printed under it).
TABLE_NOTES = (
    "frames/s played: frames / (chunks x chunk period + stall time), what a player showing each chunk "
    "at the model's rate plays (the model's fps unless chunks came late); frames/s (received): frames / "
    "seconds from the start request to the close, so the chunk generated ahead of playback and the "
    "un-acked window lift a short run above the model's fps.",
    "of it: a chunk's compute (its tick's time on the server, p50) split into the time its tick waited "
    "in the engine for a batch to start (queued_ms) and the model's step for the whole batch (model_ms); "
    "batch size: sessions in that step.",
    "bound, overall: an event waits at most one chunk period for the next snapshot, then one chunk's "
    "compute, so accepted->applied p99 should stay under period + compute p50.",
    "bound, per event: the same without the compute, per event: p99 of (accepted->applied minus the "
    "tick time of the chunk that applied it) against one chunk period.",
    "key-to-photon: from an event's send to the playout of the first frame of the chunk that applied it, "
    "as the page's adaptive jitter buffer plays it (tools/jitter.py: a chunk that finds the player stopped "
    "waits the target, from 1 frame (--slack-frames), after it is decoded, then frames play at the model's "
    "rate; the target grows a frame after each underrun, up to two chunks, and shrinks a frame after each "
    "calm 3 s); up: to the server's acceptance; wait_tick: to the tick that took it; queue: to its dispatch "
    "to a worker; model: the step; encode: the frames; handoff: to this connection's writer; down: to the "
    "chunk's last byte here; decode; playout: waiting behind the frames already queued to play.",
)


def _server_cost(result: BenchResult) -> tuple[str, str, str]:
    """Server CPU ms per chunk made, frames sent per chunk, CPU us per frame sent."""
    if result.server is None:
        return "-", "-", "-"
    before, after = result.server
    chunks = after.chunks - before.chunks
    frames = after.frames_sent - before.frames_sent
    cpu = after.cpu_seconds - before.cpu_seconds
    if chunks <= 0 or frames <= 0:
        return "-", "-", "-"
    return f"{cpu / chunks * 1000:.2f}", f"{frames / chunks:.1f}", f"{cpu / frames * 1e6:.0f}"


def format_viewers_table(alone: BenchResult, shared: BenchResult) -> str:
    """Both sides of a ``--viewers`` run: the same sessions without viewers and with them."""

    def fps(values: list[float]) -> str:
        return f"{statistics.mean(values):.1f} / {min(values):.1f}" if values else "-"

    def side(result: BenchResult) -> list[str]:
        host_fps = [r.frames / r.seconds for r in result.reports if r.seconds > 0]
        viewer_fps = [v.frames / v.seconds for v in result.viewers if v.seconds > 0]
        cpu, per_chunk, per_frame = _server_cost(result)
        errors: Counter[str] = Counter()
        for report in result.reports:
            errors.update(report.errors)
        for viewer in result.viewers:
            errors.update(viewer.errors)
        return [
            f"{result.viewers_per_session}",
            fps(host_fps),
            fps(viewer_fps),
            f"{sum(v.skipped for v in result.viewers)}",
            cpu,
            per_chunk,
            per_frame,
            _bytes_per_second(result),
            f"{sum(r.lost for r in result.reports)} / {sum(r.applied_twice for r in result.reports)}",
            ", ".join(f"{code}={count}" for code, count in sorted(errors.items())) or "0",
        ]

    names = [
        "viewers per session",
        "host frames/s (mean / min)",
        "viewer frames/s (mean / min)",
        "chunks skipped for viewers",
        "server CPU ms per chunk made",
        "frames sent per chunk made",
        "server CPU us per frame sent",
        "frame kB/s sent (all sockets)",
        "lost / applied twice",
        "errors",
    ]
    a, b = side(alone), side(shared)
    cost = "-"
    if alone.server is not None and shared.server is not None and shared.viewers_per_session > 0:
        try:
            extra = (float(b[4]) - float(a[4])) / shared.viewers_per_session
            cost = f"{extra:.2f}"
        except ValueError:
            pass
    width = max(len(name) for name in [*names, "server CPU ms per chunk, per extra viewer"])
    lines = [f"{'metric':<{width}}  {'no viewers':>16}  {'with viewers':>16}", f"{'-' * width}  {'-' * 16}  {'-' * 16}"]
    lines += [f"{name:<{width}}  {x:>16}  {y:>16}" for name, x, y in zip(names, a, b, strict=True)]
    lines.append(f"{'server CPU ms per chunk, per extra viewer':<{width}}  {'':>16}  {cost:>16}")
    return "\n".join(lines)


def format_capacity_table(capacity: int, steps: list[CapacityStep], *, label: str = "") -> str:
    """One row per step of a capacity search, and the figure found."""
    header = (
        "| clients | held | underruns % (mean / worst) | late % by arrival (mean / worst) | stall s by arrival (worst) "
        "| mean batch | frames/s per client (min) | event->applied p99 ms (bound) | errors |"
    )
    lines = [header, "|" + "|".join("---" for _ in range(9)) + "|"]
    for step in sorted(steps, key=lambda item: item.clients):
        lines.append("| " + " | ".join(_step_cells(step)) + " |")
    lines.append("")
    by = {step.late_by for step in steps}
    criteria = {"player": "the player's underruns", "arrival": "arrival after a fixed playout instant"}
    counted = criteria[next(iter(by))] if len(by) == 1 else "mixed criteria"
    lines.append(f"{label}sessions held at <= {LATE_LIMIT * 100:g} % late chunks (counted by {counted}): {capacity}")
    for step in sorted(steps, key=lambda item: item.clients):  # why sessions failed: the server's words
        said = next((message for r in step.result.reports for message in r.error_messages), None)
        if said is not None:
            lines.append(f"  at {step.clients} clients, first error: {said[:300]}")
    return "\n".join(lines)


def _step_cells(step: CapacityStep) -> list[str]:
    reports = step.result.reports
    late = [r.late_ratio for r in reports if r.chunks > 1]
    underruns = [r.underrun_ratio for r in reports if r.chunks > 1]
    stalls = [r.late[1] for r in reports if r.chunks > 1]
    batch_sizes = [value for r in reports for value in r.batch_sizes]
    fps = [r.frames / r.seconds for r in reports if r.seconds > 0]
    applied = [value for r in reports for value in r.applied]
    compute = [value for r in reports for value in r.compute]
    period = max((r.chunk_period for r in reports), default=0.0)
    bound = period + (statistics.median(compute) if compute else 0.0)
    errors: Counter[str] = Counter()
    for report in reports:
        errors.update(report.errors)
    return [
        f"{step.clients}",
        "yes" if step.held else "no",
        f"{statistics.mean(underruns) * 100:.2f} / {max(underruns) * 100:.2f}" if underruns else "-",
        f"{statistics.mean(late) * 100:.2f} / {max(late) * 100:.2f}" if late else "-",
        f"{max(stalls):.2f}" if stalls else "-",
        f"{statistics.mean(batch_sizes):.2f}" if batch_sizes else "-",
        f"{statistics.mean(fps):.1f} ({min(fps):.1f})" if fps else "-",
        f"{_percentile(applied, 0.99) * 1000:.0f} ({bound * 1000:.0f})" if applied else "-",
        ", ".join(f"{code}={count}" for code, count in sorted(errors.items())) or "0",
    ]
