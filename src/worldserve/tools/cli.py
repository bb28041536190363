"""The ``worldserve`` command: ``serve``, ``bench``, ``record``, ``replay`` and ``inspect``.

Owns: argument parsing, turning arguments into a :class:`ServerConfig` and a runtime,
starting the runtime (its workers load the model) before uvicorn listens, and running
uvicorn with a shutdown that tells every world's members before their sockets close.
Bad input is answered the same way everywhere: one line on stderr,
``worldserve <command>: error: <what is wrong>``, and exit status 2, found before any
work starts (the parser's types check each value; each command then checks what its
values mean together, and its files, before it connects or starts a worker).

Must not know: what happens inside a connection or a session.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn

from worldserve.runtime.config import (
    RuntimeConfig,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

__all__ = ["UsageError", "build_parser", "main"]

#: The output formats ``record`` and ``replay`` write.
VIDEO_SUFFIXES = (".gif", ".mp4")


class UsageError(Exception):
    """Bad input found after parsing (what the values mean together, files, a server that is not
    there): reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message (see prog --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help (none for flags, or where the help says it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unset = default is None or default is argparse.SUPPRESS or isinstance(default, bool) or default == []
        shown = not unset and not isinstance(action, _NO_DEFAULT)
        if shown and "%(default)" not in text and "(default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


_NO_DEFAULT = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._VersionAction, argparse._HelpAction)


def _port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {text!r}")
    return value


def _message_bytes(text: str) -> int:
    value = positive_int(text)
    if value < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1024, got {text!r}")
    return value


def _ws_url(text: str) -> str:
    if not text.startswith(("ws://", "wss://")):
        raise argparse.ArgumentTypeError(
            f"a WebSocket URL starts with ws:// or wss://, got {text!r} (e.g. ws://127.0.0.1:8000/v1/world)"
        )
    return text


def _video_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise argparse.ArgumentTypeError(f"writes {' or '.join(VIDEO_SUFFIXES)}, got {text!r}")
    return path


def build_parser() -> argparse.ArgumentParser:
    from worldserve import __version__

    parser = _Parser(
        prog="worldserve",
        description="Serve realtime, interactive world models over WebSocket; drive and measure them.",
        formatter_class=_Help,
    )
    parser.add_argument("--version", action="version", version=f"worldserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = commands.add_parser(
            name, help=help, description=description, formatter_class=_Help
        )
        return sub

    serve = command(
        "serve",
        "run the HTTP + WebSocket server (browser player at /)",
        "Run the server: the player at /, WS /v1/world, WS /v1/realtime/video (vllm-omni's realtime video "
        "protocol), /healthz, /v1/models, /metrics. The workers load "
        "the model before the server listens; a model or option they refuse ends it with one line.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    serve.add_argument(
        "--token",
        default=None,
        help="require this bearer token for /v1/*, /metrics and the WebSocket (default: none, open)",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="browser origin allowed besides the server's own; repeatable, '*' allows any (default: none)",
    )
    serve.add_argument("--event-rate", type=positive_float, default=60.0, help="input events/s per connection")
    serve.add_argument("--event-burst", type=positive_int, default=120, help="input event burst per connection")
    serve.add_argument(
        "--max-message-bytes", type=_message_bytes, default=256 * 1024, help="largest client message, in bytes"
    )
    serve.add_argument(
        "--max-start-bytes",
        type=_message_bytes,
        default=4 * 1024 * 1024,
        help="largest session.start (it may carry a start image and reference images), in bytes",
    )
    serve.add_argument(
        "--idle-timeout", type=positive_float, default=300.0, help="close a connection silent this long (s)"
    )
    serve.add_argument(
        "--max-lag-chunks", type=positive_int, default=3, help="un-acked chunks before generation pauses"
    )
    serve.add_argument(
        "--chunk-clock",
        choices=["on", "off"],
        default="on",
        help="on: sessions on one worker issue ticks at shared instants, so they batch; off: each session paces alone",
    )
    serve.add_argument(
        "--lead",
        type=_lead_chunks,
        default=0,
        metavar="jit|N",
        help="how far generation runs ahead of playback: jit (the default: just in time, each tick on its "
        "worker's instant, its chunk played one frame after it is due to be ready; a slow step is seen as a "
        "stall, which the player's jitter buffer then absorbs) or N whole chunks (a slow step hidden, a key "
        "answered about N chunks later; docs/latency.md, 'A chunk ahead, or just in time')",
    )
    serve.add_argument(
        "--preempt",
        choices=("auto", "off"),
        default="auto",
        help="auto: an input that comes while the chunk made without it has not begun to play makes that chunk "
        "again with it (once per chunk, when it can still be ready in time and its worker has the headroom; the "
        "page swaps it in); off: the input waits for the next chunk (docs/latency.md, 'Preemption')",
    )
    serve.add_argument(
        "--resume-grace-s",
        type=non_negative_float,
        default=30.0,
        help="keep a session whose connection dropped this long for session.resume (0: off)",
    )
    serve.add_argument(
        "--replay-chunks",
        type=positive_int,
        default=8,
        help="chunks kept to re-send on resume (raised to --max-lag-chunks when below it)",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    serve.add_argument(
        "--evict-idle-s",
        type=positive_float,
        default=30.0,
        help="a world is in use (never evicted for a newcomer) while a connected member acked a chunk or sent an "
        "event within this many seconds; worlds whose members are all parked may be evicted",
    )
    serve.add_argument(
        "--queue-max",
        type=non_negative_int,
        default=None,
        help="at most this many session.start {queue: true} wait in line while the server is full "
        "(default: four times the session slots, at least 8; 0: no line)",
    )
    serve.add_argument(
        "--queue-timeout-s",
        type=positive_float,
        default=300.0,
        help="a start waiting in line longer than this is refused with admission_refused",
    )
    serve.add_argument(
        "--realtime-start-timeout-s",
        type=positive_float,
        default=10.0,
        help="/v1/realtime/video: session.start must come within this long (s)",
    )
    serve.add_argument(
        "--realtime-stall-timeout-s",
        type=positive_float,
        default=60.0,
        help="/v1/realtime/video: end a session with no chunk sent and no session.ping this long (s)",
    )
    serve.add_argument(
        "--public-url",
        default=None,
        metavar="URL",
        help="how clients outside reach this front-end (http://10.0.0.2:8000, or a balancer's path to it: "
        "http://lb.example/fe/1): told in session.started; with --directory, where the other front-ends send a "
        "resume or join for a world that lives here (docs/deploy.md, 'Many front-ends')",
    )
    serve.add_argument(
        "--drain-timeout-s",
        type=non_negative_float,
        default=0.0,
        help="SIGTERM (or POST /admin/drain) drains: no more starts (each refused with a retry hint; /healthz "
        "answers 503 draining), the worlds here go on until they end or this many seconds pass, then the server "
        "stops; 0: a SIGTERM stops at once. A second SIGTERM, or Ctrl-C, stops at once",
    )
    serve.add_argument(
        "--directory",
        choices=("off", "ray"),
        default="off",
        help="ray: one of several front-ends of one service: publish this front-end's worlds in the session "
        "directory kept on the Ray cluster (--ray-address, or the one the Ray executor joined), and answer a "
        "resume or join for a world on another front-end with session.moved {url}; needs --public-url",
    )
    serve.add_argument(
        "--ice-server",
        action="append",
        default=[],
        metavar="URL",
        help="a STUN or TURN server for the server's WebRTC peers (sessions, POST /v1/webrtc, and viewers, POST "
        "/v1/whep/SESSION): stun:HOST[:PORT], or turn:USER:CREDENTIAL@HOST[:PORT][?transport=udp|tcp] (turns: for "
        "TLS; percent-encode a : or @ in USER or CREDENTIAL); repeat for more (none: host candidates only, for a LAN)",
    )
    serve.add_argument(
        "--whep-media",
        choices=("auto", "raw"),
        default="auto",
        help="what a WHEP viewer is sent: auto, the world's H.264 stream, encoded once for all its H.264 viewers "
        "and only packetised per peer, when the viewer's offer takes H.264 (else raw frames); raw, raw frames "
        "that each peer encodes for itself (default: auto)",
    )
    serve.add_argument(
        "--service",
        default="default",
        metavar="NAME",
        help="with --directory: the service this front-end belongs to (its directory and waiting line; several "
        "services may share one Ray cluster)",
    )
    RuntimeConfig.add_cli_arguments(serve)

    bench = command(
        "bench",
        "drive N concurrent clients against a server; print a table",
        "Load test: N clients start sessions, steer them, and check every event's fate; the tables report "
        "frames played, late chunks and key-to-photon (each event's send to its chunk's first frame played, "
        "and its parts: docs/latency.md).",
    )
    bench.add_argument("--url", type=_ws_url, default="ws://127.0.0.1:8000/v1/world", help="the server's WebSocket")
    bench.add_argument("--clients", type=positive_int, default=32, help="concurrent sessions (closed loop)")
    bench.add_argument("--duration", type=positive_float, default=60.0, help="seconds per client")
    bench.add_argument(
        "--event-interval", type=positive_float, default=0.25, help="mean seconds between a client's events"
    )
    bench.add_argument("--token", default=None, help="the server's bearer token (default: none)")
    bench.add_argument(
        "--stagger",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="start each client after a uniform random offset in [0, SECONDS]",
    )
    bench.add_argument(
        "--arrival-rate",
        type=positive_float,
        default=None,
        metavar="PER_S",
        help="open loop: sessions arrive at this rate for --duration seconds, instead of --clients (default: off)",
    )
    bench.add_argument(
        "--session-seconds",
        type=positive_float,
        default=None,
        help="open loop: each session's lifetime (default: --duration)",
    )
    bench.add_argument(
        "--find-capacity",
        action="store_true",
        help="step the client count (from --clients, doubling then bisecting) to find the most sessions "
        "held at <= 1%% late chunks (--late-by)",
    )
    bench.add_argument(
        "--late-by",
        choices=("player", "arrival"),
        default="player",
        help="--find-capacity: a chunk is late when it finds the client's jitter buffer run dry (player: what "
        "a viewer of the page sees stall) or when it arrives after a fixed playout instant (arrival: chunk 0 "
        "--slack-frames after it arrives, then one period each)",
    )
    bench.add_argument("--max-clients", type=positive_int, default=64, help="--find-capacity: the most to try")
    bench.add_argument("--seed", type=int, default=0, help="seed of the start offsets and arrivals")
    bench.add_argument(
        "--viewers",
        type=non_negative_int,
        default=0,
        help="viewers joined to each session; runs the load without viewers first and compares",
    )
    bench.add_argument(
        "--media",
        choices=("raw", "jpeg", "h264"),
        default="raw",
        help="how the sessions' frames travel (the clients decode them all; every mode but --newcomers)",
    )
    bench.add_argument(
        "--parts",
        action="store_true",
        help="each client takes its chunks' frames in parts as the model makes them (a model whose spec says "
        "frame_parts, --media raw or jpeg) and plays them as they come (the closed- and open-loop runs)",
    )
    bench.add_argument(
        "--transport",
        choices=("ws", "webrtc"),
        default="ws",
        help="how each session travels: a WebSocket (/v1/world), or WebRTC (/v1/webrtc: the protocol on a data "
        "channel, frames on a video track, each shown as decoded; needs the webrtc extra; --media does not apply)",
    )
    bench.add_argument(
        "--same-clock",
        action="store_true",
        help="the server reads this machine's monotonic clock though --url is not a loopback address (another "
        "network namespace of this machine): key-to-photon's parts need no clock offset estimate",
    )
    bench.add_argument(
        "--slack-frames",
        type=non_negative_float,
        default=1.0,
        help="each client's player starts its jitter buffer at this many frames of slack, as the page does (1); "
        "it grows after an underrun and shrinks back (docs/latency.md); 0: chunk 0 plays on arrival",
    )
    bench.add_argument(
        "--drop-resume",
        action="store_true",
        help="each client loses its socket once mid-run and resumes (checks 0 lost, 0 duplicated)",
    )
    bench.add_argument(
        "--newcomers",
        type=non_negative_int,
        default=0,
        help="after --find-capacity (or alone): fill the server, line up this many queue: true starts (and as "
        "many plain ones), let the players leave one by one; checks no world in use is evicted and the line "
        "is first come, first served",
    )
    bench.add_argument(
        "--leave-every",
        type=positive_float,
        default=1.0,
        help="--newcomers: seconds between two players leaving",
    )

    record = command(
        "record",
        "play a scripted event list; write MP4/GIF and a JSON sidecar",
        "Play a script against a server and save the frames plus a sidecar of chunks and events. "
        'Script: {"prompt", "seed", "chunks", "events": [{"after_chunk": k, "prompt"?, "controls"?}]}; '
        "an event is sent once chunk k (the (k+1)-th chunk) has arrived, -1: right after the start. "
        "Exits 1 if the server refused any event (the sidecar says why).",
    )
    record.add_argument("script", type=Path, help="JSON script (see docs/protocol.md, Tools)")
    record.add_argument("--url", type=_ws_url, default="ws://127.0.0.1:8000/v1/world", help="the server's WebSocket")
    record.add_argument(
        "--out", type=_video_path, default=Path("world.gif"), help=".gif or .mp4; the sidecar beside it"
    )
    record.add_argument("--scale", type=positive_int, default=4, help="pixel upscaling")
    record.add_argument("--token", default=None, help="the server's bearer token (default: none)")

    replay = command(
        "replay",
        "regenerate a journaled session (serve --record-dir) through the runtime; write MP4/GIF",
        "Replay a session journal: the same model, options and per-chunk snapshots, frame for frame. A journal "
        "cut off mid-line (the server died) replays its complete lines, with a warning.",
    )
    replay.add_argument("journal", type=Path, help="a session journal (<record-dir>/<session_id>.jsonl)")
    replay.add_argument("--out", type=_video_path, default=Path("replay.mp4"), help=".gif or .mp4")
    replay.add_argument("--frames", type=Path, default=None, help="also save the raw frames (.npy) (default: no)")
    replay.add_argument("--scale", type=positive_int, default=4, help="pixel upscaling")
    replay.add_argument(
        "--executor", choices=("multiprocess", "inprocess"), default="multiprocess", help="how the model runs"
    )

    inspect = command(
        "inspect",
        "say what weight files or a folder of downloads are, and the serve command that serves them",
        "For each path (a checkpoint file, or a folder of downloads): the parts found by their published names "
        "and what their keys and shapes say, the parts missing, the model that serves them (wan-causal; "
        "matrix-game-2 for Matrix-Game 2.0's files, with the variant its shapes say; abot-world for ABot-World's "
        "folder), the family and config, "
        "the exact `worldserve serve` command line, and the memory per session at each window on a GPU of --gpu-gib. "
        "Reads shapes only. Needs the wan extra.",
    )
    inspect.add_argument("paths", type=Path, nargs="+", help="files or folders")
    inspect.add_argument("--gpu-gib", type=positive_float, default=80.0, help="GPU memory, GiB (80: an H100)")
    inspect.add_argument(
        "--windows", type=positive_int, nargs="+", default=[3, 6, 9, 15], help="windows, latent frames"
    )
    return parser


# -- serve ---------------------------------------------------------------------------------


def _lead_chunks(text: str) -> int:
    """``--lead``: ``jit`` is 0 chunks (just in time), else a positive number of chunks."""
    if text == "jit":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be jit or a number of chunks; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be jit or at least 1 chunk; got {text!r}")
    return value


def _serve(args: argparse.Namespace) -> int:
    from worldserve.server.config import ServerConfig

    try:
        config = ServerConfig(
            token=args.token,
            allowed_origins=tuple(args.allow_origin),
            max_message_bytes=args.max_message_bytes,
            max_start_bytes=max(args.max_start_bytes, args.max_message_bytes),
            event_rate=args.event_rate,
            event_burst=args.event_burst,
            idle_timeout=args.idle_timeout,
            max_lag_chunks=args.max_lag_chunks,
            lead_chunks=args.lead,
            preempt=args.preempt,
            chunk_clock=args.chunk_clock == "on",
            resume_grace_s=args.resume_grace_s,
            replay_chunks=max(args.replay_chunks, args.max_lag_chunks),
            evict_idle_s=args.evict_idle_s,
            queue_max=args.queue_max,
            queue_timeout_s=args.queue_timeout_s,
            realtime_start_timeout_s=args.realtime_start_timeout_s,
            realtime_stall_timeout_s=args.realtime_stall_timeout_s,
            public_url=args.public_url,
            drain_timeout_s=args.drain_timeout_s,
            ice_servers=tuple(args.ice_server),
            whep_media=args.whep_media,
        )
        if args.directory != "off" and args.public_url is None:
            raise ValueError("--directory ray needs --public-url: the URL the other front-ends send clients to")
        runtime_config = RuntimeConfig.from_cli_arguments(args)
    except ValueError as error:
        raise UsageError(str(error).rstrip(".")) from None
    _check_listen(args.host, args.port)  # before the workers spend time loading the model
    uses_ray = runtime_config.executor == "ray" or args.directory == "ray"
    try:
        code = asyncio.run(_serve_async(args, config, runtime_config))
    except UsageError as error:
        if not uses_ray:
            raise
        print(f"worldserve {args.command}: error: {error}", file=sys.stderr)
        code = 2
    if uses_ray and (code != 0 or runtime_config.executor != "ray"):
        # Ray's exit hook would shut its driver down again, for seconds (a minute without a
        # head, for ever for a front-end that joined for the directory alone), after the server
        # already released what it could: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _check_listen(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (in use, not this machine's), as uvicorn would
    later: bound once here, with the same SO_REUSEADDR, and released."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


async def _serve_async(args: argparse.Namespace, config: Any, runtime_config: RuntimeConfig) -> int:
    """Start the runtime (workers placed, models loaded), then serve until a signal stops it.

    The start runs before the server binds its port, with its own SIGTERM/SIGINT handlers: a
    signal at any moment of it (joining a cluster, placing workers, loading models) stops the
    process at once (exit 1); a start the runtime refuses is one line (exit 2). A runtime that
    loses every worker for good (the Ray head is gone) stops the server: each world is told why.
    """
    import uvicorn

    from worldserve.errors import SessionError
    from worldserve.runtime import Runtime
    from worldserve.server.app import create_app, end_worlds

    runtime = Runtime(config=runtime_config)
    directory: Any = None

    async def start() -> None:
        nonlocal directory
        await runtime.start()  # the workers load the model
        if args.directory == "ray":  # after the runtime: a Ray executor has joined the cluster already
            from worldserve.server.directory import Directory
            from worldserve.server.directory_ray import connect_directory

            store = await connect_directory(
                runtime_config.ray_address, service=args.service, connect_timeout=runtime_config.ray_connect_timeout_s
            )
            directory = Directory(store, config.public_url)

    starting = asyncio.ensure_future(start())
    loop = asyncio.get_running_loop()
    stopped_by: list[str] = []

    def interrupt(name: str) -> None:
        stopped_by.append(name)
        starting.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, interrupt, signum.name)
    try:
        await starting
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(3.0):
                await runtime.aclose()
        print(f"worldserve: stopped by {stopped_by[0] if stopped_by else 'a signal'} while starting.", file=sys.stderr)
        return 1
    except (SessionError, ValueError, TypeError, ImportError) as error:  # a model or option the workers refuse
        with contextlib.suppress(Exception):
            async with asyncio.timeout(3.0):
                await runtime.aclose()
        said = str(error).rstrip(".")
        raise UsageError(said if "could not load model" in said else f"cannot start the runtime: {said}") from None
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)

    print(startup_summary(runtime, config), file=sys.stderr, flush=True)
    if directory is not None:
        print(
            f"worldserve: a front-end of a service at {directory.url}; its worlds are published in the session "
            f"directory, {directory.where}",
            file=sys.stderr,
            flush=True,
        )

    @asynccontextmanager
    async def started() -> AsyncIterator[Runtime]:
        yield runtime

    app = create_app(config, started, directory)
    server = _shutdown_aware_server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            ws="websockets-sansio",
            # Above /v1/realtime/video's 4 MiB session.start, so that the route refuses a larger one itself.
            ws_max_size=max(8 * 1024 * 1024, 2 * args.max_message_bytes, 2 * args.max_start_bytes),
            ws_ping_interval=20.0,
            ws_ping_timeout=20.0,
        ),
        before_shutdown=lambda: end_worlds(app),
        drain=lambda: app.state.worldserve.get("drain"),
        drain_on_sigterm=config.drain_timeout_s > 0,
    )

    def stop_when_lost(watch: asyncio.Future[Any]) -> None:
        if not watch.cancelled():
            server.should_exit = True  # each world is told why (session.failed) as the server stops

    lost = asyncio.ensure_future(runtime.wait_lost())
    lost.add_done_callback(stop_when_lost)
    try:
        await server.serve()
    finally:
        lost.cancel()
        await runtime.aclose()
    if runtime.lost is not None:
        print(f"worldserve: stopped: {runtime.lost}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def startup_summary(runtime: Any, server: Any) -> str:
    """What the server chose and the user should know before the first world: the model, the
    precision it serves in, each worker's compute threads and why, the pacing lead, and the
    model's own notes."""
    spec, config = runtime.spec, runtime.config
    threads, why = config.worker_threads()
    threads_said = (
        "the libraries' default threads" if threads is None else f"{threads} thread{'s' if threads != 1 else ''}"
    )
    workers = f"{config.workers} worker{'s' if config.workers != 1 else ''}"
    lines = [
        f"worldserve: serving {spec.name} ({spec.precision or 'default precision'}) on {workers} x {threads_said} "
        f"({why}; --threads-per-worker N to change)"
    ]
    preempt = server.preempt_for(spec)
    if preempt.enabled:
        preempting = "input preempts a chunk not yet playing"
    elif server.preempt == "off":
        preempting = "no preemption"
    else:
        preempting = f"no preemption ({spec.name} cannot roll a session back)"
    lines.append(f"worldserve: pacing: {server.lead_for(spec).describe()} (--lead), {preempting} (--preempt)")
    lines += [f"worldserve: note: {note}" for note in spec.notes]
    return "\n".join(lines)


def _shutdown_aware_server(
    config: Any,
    *,
    before_shutdown: Callable[[], Awaitable[None]],
    drain: Callable[[], Any] = lambda: None,
    drain_on_sigterm: bool = False,
) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, telling every world's members ``session.closed {reason: "shutdown"}``
        (and closing their sockets with 1001) before uvicorn closes what is left with 1012.

        uvicorn re-raises the signal that stopped it as ``serve()`` returns, which would end the
        process before the runtime closes (workers left to die with their pipes, journals not
        closed, shared memory not unlinked); here a stop asked for by a signal returns instead,
        and the caller closes the runtime and exits 0."""

        def __init__(self, config: uvicorn.Config, *, before_shutdown: Callable[[], Awaitable[None]]) -> None:
            super().__init__(config)
            self._before_shutdown = before_shutdown
            self._drain_asked = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            """A first SIGTERM begins a drain (``--drain-timeout-s``; its loop ends the server when the drain
            is over); anything else, a second SIGTERM included, stops at once."""
            running = drain()
            first = drain_on_sigterm and not self._drain_asked and running is not None and not running.draining
            if first and sig == signal.SIGTERM:
                self._drain_asked = True  # begun from the loop (on_tick), not inside a signal handler
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            running = drain()
            if running is not None:
                if self._drain_asked and not running.draining:
                    running.begin("SIGTERM")
                if running.over():
                    return True
            return bool(await super().on_tick(counter))

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()  # handled: the server stopped gracefully; the caller exits 0

        async def shutdown(self, sockets: Any = None) -> None:
            for listener in self.servers:  # no new connection while the worlds end
                listener.close()
            try:
                await self._before_shutdown()
            except Exception:
                logging.getLogger("worldserve.server").exception("ending the worlds at shutdown failed")
            await super().shutdown(sockets)

    return Server(config, before_shutdown=before_shutdown)


# -- bench ---------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    from worldserve.tools.loadtest import (
        check_server,
        find_capacity,
        format_capacity_table,
        format_table,
        format_viewers_table,
        run_bench,
        run_viewers_bench,
    )

    if args.session_seconds is not None and args.arrival_rate is None:
        raise UsageError("--session-seconds needs --arrival-rate (closed-loop sessions last --duration)")
    if args.transport == "webrtc" and (args.find_capacity or args.newcomers or args.viewers):
        raise UsageError("--transport webrtc runs the plain bench: not with --find-capacity, --newcomers or --viewers")
    if args.find_capacity and (args.arrival_rate is not None or args.viewers):
        raise UsageError("--find-capacity steps a closed-loop client count: not with --arrival-rate or --viewers")
    problem = asyncio.run(check_server(args.url, args.token))
    if problem is not None:
        raise UsageError(problem)

    # what every mode of the bench takes from the command line alike
    common: dict[str, Any] = {"duration": args.duration, "event_interval": args.event_interval, "token": args.token}
    if args.find_capacity or args.newcomers:
        ok = True
        if args.find_capacity:
            capacity, steps = asyncio.run(
                find_capacity(
                    args.url,
                    start=args.clients,
                    max_clients=args.max_clients,
                    stagger=args.stagger,
                    seed=args.seed,
                    media=args.media,
                    playout_slack_frames=args.slack_frames,
                    late_by=args.late_by,
                    **common,
                )
            )
            print(format_capacity_table(capacity, steps))
            ok = all(r.lost == 0 for step in steps for r in step.result.reports)
        if args.newcomers:
            from worldserve.tools.newcomers import format_newcomers_table, run_newcomers

            phase = asyncio.run(
                run_newcomers(
                    args.url,
                    newcomers=args.newcomers,
                    max_players=args.max_clients,
                    leave_every=args.leave_every,
                    token=args.token,
                )
            )
            print()
            print(format_newcomers_table(phase))
            ok = ok and phase.ok
        return 0 if ok else 1
    if args.viewers > 0:
        alone, shared = asyncio.run(
            run_viewers_bench(
                args.url,
                clients=args.clients,
                viewers=args.viewers,
                drop_resume=args.drop_resume,
                media=args.media,
                **common,
            )
        )
        print(format_viewers_table(alone, shared))
        results = [alone, shared]
    else:
        result = asyncio.run(
            run_bench(
                args.url,
                clients=args.clients,
                drop_resume=args.drop_resume,
                stagger=args.stagger,
                arrival_rate=args.arrival_rate,
                session_seconds=args.session_seconds,
                seed=args.seed,
                media=args.media,
                playout_slack_frames=args.slack_frames,
                transport=args.transport,
                same_clock=True if args.same_clock else None,
                parts=args.parts,
                **common,
            )
        )
        print(format_table(result))
        results = [result]
    reports = [report for result in results for report in result.reports]
    ok = all(r.lost == 0 and r.applied_twice == 0 and r.seq_gaps == 0 and not r.errors for r in reports)
    return 0 if ok else 1


# -- record --------------------------------------------------------------------------------


def _record(args: argparse.Namespace) -> int:
    from worldserve.client import SessionFailedError, WorldClientError, WorldError
    from worldserve.tools.record import load_script, record, refused_events, write_video

    try:
        script = load_script(args.script)
    except (OSError, ValueError) as error:
        raise UsageError(str(error).rstrip(".")) from None
    try:
        recording = asyncio.run(record(args.url, script, token=args.token))
    except WorldClientError as error:
        raise UsageError(str(error).rstrip(".")) from None
    except SessionFailedError as error:
        raise UsageError(f"the session failed while recording: {error}") from None
    except WorldError as error:
        raise UsageError(f"the server refused the session: {error}") from None
    except TimeoutError:
        raise UsageError(f"no chunk came from {args.url} within 30 s (is the server overloaded or stuck?)") from None
    write_video(recording.frames, args.out, fps=float(recording.sidecar["model"]["fps"]), scale=args.scale)
    sidecar = args.out.with_suffix(".json")
    sidecar.write_text(json.dumps(recording.sidecar, indent=2))
    print(f"wrote {args.out} ({len(recording.frames)} frames) and {sidecar}")
    refused = refused_events(recording.sidecar)
    if refused:
        first = refused[0]
        print(
            f"worldserve record: the server refused {len(refused)} of {len(recording.sidecar['events'])} events "
            f"(first: script event {first['script_index']}, {first['error']['code']}: {first['error']['message']})",
            file=sys.stderr,
        )
        return 1
    return 0


# -- replay --------------------------------------------------------------------------------


def _replay(args: argparse.Namespace) -> int:
    from worldserve.errors import SessionError
    from worldserve.runtime.config import model_name
    from worldserve.runtime.journal import read_journal
    from worldserve.tools.record import write_video
    from worldserve.tools.replay import replay

    try:
        journal = read_journal(args.journal)
        model_name(journal.start.model)  # a model this installation knows, before a worker starts
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"{args.journal}: {error}") from None
    except OSError as error:
        raise UsageError(f"cannot read journal {args.journal}: {error.strerror or error}") from None
    except ValueError as error:
        raise UsageError(str(error).rstrip(".")) from None
    for warning in journal.warnings:
        print(f"worldserve replay: warning: {warning}", file=sys.stderr)
    try:
        result = asyncio.run(replay(journal, executor=args.executor))
    except (SessionError, ValueError) as error:
        raise UsageError(f"cannot replay {args.journal}: {error}") from None
    write_video(result.frames, args.out, fps=result.start.fps, scale=args.scale)
    if args.frames is not None:
        import numpy as np

        np.save(args.frames, result.frames)
    note = (
        ""
        if result.same_model
        else (
            f" (journal: {result.start.model_version} {result.start.precision}; replayed with "
            f"{result.model_version} {result.precision}: frames match only within the model's tolerance)"
        )
    )
    print(
        f"replayed {result.chunks} chunks ({len(result.frames)} frames) of {result.start.session_id} "
        f"to {args.out}{note}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from worldserve.tools.inspect import format_inspection, inspect_path

    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        raise UsageError(f"no such file or folder: {', '.join(missing)}")
    status = 0
    for path in args.paths:
        try:
            print(format_inspection(inspect_path(path, gpu_gib=args.gpu_gib, windows=tuple(args.windows))))
        except ValueError as error:  # WeightsError included: a part's file that is no weight file, named
            from worldserve.models.wan.statedict import WeightsError

            itself = isinstance(error, WeightsError) and error.source == path.expanduser().resolve()
            print(str(error) if itself else f"{path}: {error}", file=sys.stderr)
            status = 1
        print()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"serve": _serve, "bench": _bench, "record": _record, "replay": _replay, "inspect": _inspect}
    try:
        return handlers[args.command](args)
    except UsageError as error:
        print(f"worldserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
