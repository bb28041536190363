"""The ``worldserve`` command: ``serve``, ``bench``, ``record``, ``replay`` and ``inspect``.

Owns: argument parsing, turning arguments into a :class:`ServerConfig` and a runtime,
and running uvicorn. Must not know: what happens inside a connection or a session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worldserve.runtime.config import RuntimeConfig

__all__ = ["build_parser", "main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be zero or positive")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be zero or positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worldserve",
        description="Serve realtime, interactive world models over WebSocket; drive and measure them.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the HTTP + WebSocket server (browser player at /)",
        description="Run the server: the player at /, WS /v1/world, /healthz, /v1/models, /metrics.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (%(default)s)")
    serve.add_argument("--token", default=None, help="require this bearer token for /v1/*, /metrics and WebSocket")
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="browser origin allowed besides the server's own (repeatable; '*' allows any)",
    )
    serve.add_argument("--event-rate", type=_positive_float, default=60.0, help="events/s per connection")
    serve.add_argument("--event-burst", type=_positive_int, default=120, help="event burst per connection")
    serve.add_argument(
        "--max-message-bytes", type=_positive_int, default=256 * 1024, help="largest client message (%(default)s)"
    )
    serve.add_argument("--idle-timeout", type=_positive_float, default=300.0, help="close idle connections after (s)")
    serve.add_argument("--max-lag-chunks", type=_positive_int, default=3, help="un-acked chunks before pausing")
    serve.add_argument(
        "--chunk-clock",
        choices=["on", "off"],
        default="on",
        help="on: sessions on one worker issue ticks at shared instants, so they batch; "
        "off: each session paces alone (%(default)s)",
    )
    serve.add_argument(
        "--resume-grace-s",
        type=_non_negative_float,
        default=30.0,
        help="keep a session whose connection dropped this long for session.resume (0: off; %(default)s)",
    )
    serve.add_argument(
        "--replay-chunks", type=_positive_int, default=8, help="chunks kept to re-send on resume (%(default)s)"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    RuntimeConfig.add_cli_arguments(serve)

    bench = commands.add_parser(
        "bench",
        help="drive N concurrent clients against a server; print a table",
        description="Load test: N clients start sessions, steer them, and check every event's fate.",
    )
    bench.add_argument("--url", default="ws://127.0.0.1:8000/v1/world")
    bench.add_argument("--clients", type=_positive_int, default=32)
    bench.add_argument("--duration", type=_positive_float, default=60.0, help="seconds per client")
    bench.add_argument("--event-interval", type=_positive_float, default=0.25, help="mean seconds between events")
    bench.add_argument("--token", default=None)
    bench.add_argument(
        "--stagger", type=float, default=0.0, metavar="SECONDS", help="start each client after a uniform random offset"
    )
    bench.add_argument(
        "--arrival-rate",
        type=_positive_float,
        default=None,
        metavar="PER_S",
        help="open loop: sessions arrive at this rate for --duration seconds (instead of --clients)",
    )
    bench.add_argument(
        "--session-seconds", type=_positive_float, default=None, help="open loop: each session's lifetime"
    )
    bench.add_argument(
        "--find-capacity",
        action="store_true",
        help="step the client count (from --clients, doubling then bisecting) to find the most sessions "
        "held at <= 1%% late chunks",
    )
    bench.add_argument("--max-clients", type=_positive_int, default=64, help="--find-capacity: the most to try")
    bench.add_argument("--seed", type=int, default=0, help="seed of the start offsets and arrivals")
    bench.add_argument(
        "--viewers",
        type=_non_negative_int,
        default=0,
        help="viewers joined to each session; runs the load without viewers first and compares (%(default)s)",
    )
    bench.add_argument(
        "--drop-resume",
        action="store_true",
        help="each client loses its socket once mid-run and resumes (checks 0 lost, 0 duplicated)",
    )

    record = commands.add_parser(
        "record",
        help="play a scripted event list; write MP4/GIF and a JSON sidecar",
        description="Play a script against a server and save the frames plus a sidecar of chunks and events.",
    )
    record.add_argument("script", type=Path, help="JSON script (see docs/protocol.md)")
    record.add_argument("--url", default="ws://127.0.0.1:8000/v1/world")
    record.add_argument("--out", type=Path, default=Path("world.gif"), help=".gif or .mp4 (%(default)s)")
    record.add_argument("--scale", type=_positive_int, default=4, help="pixel upscaling (%(default)s)")
    record.add_argument("--token", default=None)

    replay = commands.add_parser(
        "replay",
        help="regenerate a journaled session (serve --record-dir) through the runtime; write MP4/GIF",
        description="Replay a session journal: the same model, options and per-chunk snapshots, frame for frame.",
    )
    replay.add_argument("journal", type=Path, help="a session journal (<record-dir>/<session_id>.jsonl)")
    replay.add_argument("--out", type=Path, default=Path("replay.mp4"), help=".gif or .mp4 (%(default)s)")
    replay.add_argument("--frames", type=Path, default=None, help="also save the raw frames (.npy)")
    replay.add_argument("--scale", type=_positive_int, default=4, help="pixel upscaling (%(default)s)")
    replay.add_argument(
        "--executor", choices=("multiprocess", "inprocess"), default="multiprocess", help="(%(default)s)"
    )

    inspect = commands.add_parser(
        "inspect",
        help="say what weight files or a folder of downloads are, and the serve command that serves them",
        description=(
            "For each path (a checkpoint file, or a folder of downloads): the parts found by their published names "
            "and what their keys and shapes say, the parts missing, the family and config, the exact "
            "`worldserve serve` command line, and the memory per session at each window on a GPU of --gpu-gib. "
            "Reads shapes only. Needs the wan extra."
        ),
    )
    inspect.add_argument("paths", type=Path, nargs="+", help="files or folders")
    inspect.add_argument("--gpu-gib", type=_positive_float, default=80.0, help="GPU memory, GiB (%(default)s: H100)")
    inspect.add_argument(
        "--windows", type=_positive_int, nargs="+", default=[3, 6, 9, 15], help="windows, latent frames (%(default)s)"
    )
    return parser


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from worldserve.runtime import Runtime
    from worldserve.server.app import create_app
    from worldserve.server.config import ServerConfig

    config = ServerConfig(
        token=args.token,
        allowed_origins=tuple(args.allow_origin),
        max_message_bytes=args.max_message_bytes,
        event_rate=args.event_rate,
        event_burst=args.event_burst,
        idle_timeout=args.idle_timeout,
        max_lag_chunks=args.max_lag_chunks,
        chunk_clock=args.chunk_clock == "on",
        resume_grace_s=args.resume_grace_s,
        replay_chunks=max(args.replay_chunks, args.max_lag_chunks),
    )

    runtime_config = RuntimeConfig.from_cli_arguments(args)
    app = create_app(config, lambda: Runtime(config=runtime_config))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws="websockets-sansio",
        ws_max_size=max(4 * 1024 * 1024, 2 * args.max_message_bytes),
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from worldserve.tools.loadtest import (
        find_capacity,
        format_capacity_table,
        format_table,
        format_viewers_table,
        run_bench,
        run_viewers_bench,
    )

    # what every mode of the bench takes from the command line alike
    common: dict[str, Any] = {"duration": args.duration, "event_interval": args.event_interval, "token": args.token}
    if args.find_capacity:
        capacity, steps = asyncio.run(
            find_capacity(
                args.url,
                start=args.clients,
                max_clients=args.max_clients,
                stagger=args.stagger,
                seed=args.seed,
                **common,
            )
        )
        print(format_capacity_table(capacity, steps))
        return 0 if all(r.lost == 0 for step in steps for r in step.result.reports) else 1
    if args.viewers > 0:
        alone, shared = asyncio.run(
            run_viewers_bench(
                args.url, clients=args.clients, viewers=args.viewers, drop_resume=args.drop_resume, **common
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
                **common,
            )
        )
        print(format_table(result))
        results = [result]
    reports = [report for result in results for report in result.reports]
    ok = all(r.lost == 0 and r.applied_twice == 0 and r.seq_gaps == 0 and not r.errors for r in reports)
    return 0 if ok else 1


def _record(args: argparse.Namespace) -> int:
    from worldserve.tools.record import load_script, record, write_video

    script = load_script(args.script)
    recording = asyncio.run(record(args.url, script, token=args.token))
    write_video(recording.frames, args.out, fps=float(recording.sidecar["model"]["fps"]), scale=args.scale)
    sidecar = args.out.with_suffix(".json")
    sidecar.write_text(json.dumps(recording.sidecar, indent=2))
    print(f"wrote {args.out} ({len(recording.frames)} frames) and {sidecar}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from worldserve.tools.record import write_video
    from worldserve.tools.replay import replay

    result = asyncio.run(replay(args.journal, executor=args.executor))
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

    status = 0
    for path in args.paths:
        try:
            print(format_inspection(inspect_path(path, gpu_gib=args.gpu_gib, windows=tuple(args.windows))))
        except ValueError as error:  # WeightsError included: a file that is no weight file
            print(f"{path}: {error}", file=sys.stderr)
            status = 1
        print()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"serve": _serve, "bench": _bench, "record": _record, "replay": _replay, "inspect": _inspect}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
