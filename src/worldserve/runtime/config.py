"""Runtime configuration: one frozen value, buildable from keyword arguments or a CLI.

Owns: :class:`RuntimeConfig` (the model by name and options, workers, executor,
residency limits, scheduling knobs), its split into the worker's and the engine's
configuration, and its command-line flags (:meth:`RuntimeConfig.add_cli_arguments`,
:meth:`RuntimeConfig.from_cli_arguments`) for the server and tools.

Must not know: how any of it is carried out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from worldserve.models import BUILTIN_MODELS, DEFAULT_MODEL
from worldserve.runtime.engine import EngineConfig
from worldserve.runtime.framebuf import DEFAULT_FRAME_BUFFER_BYTES
from worldserve.runtime.messages import ResidencyLimits, WorkerConfig

__all__ = [
    "ENCODE_FRAMES",
    "EXECUTOR_NAMES",
    "RuntimeConfig",
    "byte_size",
    "model_name",
    "non_negative_float",
    "non_negative_int",
    "parse_bytes",
    "positive_float",
    "positive_int",
]

#: The executors a configuration may name.
EXECUTOR_NAMES = ("multiprocess", "inprocess", "ray")
#: Where a session's frames are encoded for the wire (see :attr:`RuntimeConfig.encode_frames`).
ENCODE_FRAMES = ("auto", "worker", "server")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12})


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1048576"`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (try 1048576, 512MiB or 2GB).")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


# -- argument types: each refuses a bad value with one sentence (argparse prints it on one line) --


def _number(kind: type[int] | type[float], text: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{'an integer' if kind is int else 'a number'} expected, got {text!r}"
        ) from None
    if value != value or value in (float("inf"), float("-inf")):  # nan, inf
        raise argparse.ArgumentTypeError(f"a finite number expected, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    value = int(_number(int, text))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (argparse type)."""
    value = int(_number(int, text))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (argparse type)."""
    value = float(_number(float, text))
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (argparse type)."""
    value = float(_number(float, text))
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """A byte size, ``"512MiB"``, ``"2GB"`` or ``"1048576"`` (argparse type)."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).rstrip(".")) from None


def model_name(text: str) -> str:
    """A built-in model's name, or ``package.module:factory`` (argparse type; the factory is
    only imported when a worker builds the model)."""
    if text in BUILTIN_MODELS:
        return text
    module, sep, factory = text.partition(":")
    if not sep or not module or not factory:
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; built-in models: {', '.join(sorted(BUILTIN_MODELS))} "
            "(or package.module:factory for your own)"
        )
    return text


def _key_value(flag: str, parse: Any) -> Any:
    def parse_item(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error).rstrip(".")) from None

    parse_item.__name__ = flag
    return parse_item


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def default_threads_per_worker(workers: int, cores: int | None = None) -> tuple[int, str]:
    """(compute threads per worker process, why) when ``--threads-per-worker`` is not given.

    One core is left to the server process (its event loop, sockets and the encoding it does)
    whenever there are more cores than workers, and the rest shared evenly: compute threads
    that outnumber the free cores wait on each other at every parallel region. Measured on a
    2-core AVX2 box: tinyworld's step with 2 threads while the server and a browser ran took
    1.2-4.8 s, with 1 thread 0.32-0.6 s in the same minute.
    """
    cores = usable_cores() if cores is None else cores
    spare = 1 if cores > workers else 0
    threads = max(1, (cores - spare) // workers)
    left = ", 1 left to the server" if spare else ""
    return threads, f"{cores} cores{left}, shared by {workers} worker{'s' if workers != 1 else ''}"


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Everything :class:`~worldserve.runtime.Runtime` needs to start."""

    model: str = DEFAULT_MODEL
    model_options: Mapping[str, Any] = field(default_factory=dict)
    workers: int = 1
    executor: str = "multiprocess"
    max_sessions_per_worker: int | None = None
    memory_budget_bytes: int | None = None  # per worker
    max_pending_events: int = 64
    batch_wait_s: float = 0.002
    max_batch_size: int | None = None
    gather_wait_s: float = 0.02
    step_budget: float = 0.9
    tick_deadline_s: float | None = 30.0
    hang_timeout_s: float | None = None
    rpc_timeout_s: float | None = 60.0
    frame_buffer_bytes: int = DEFAULT_FRAME_BUFFER_BYTES  # shared memory per worker process; 0: frames via the pipe
    #: CPU threads per worker process for its compute libraries; None: the machine's cores shared
    #: evenly among the workers (workers that each take every core slow each other down).
    threads_per_worker: int | None = None
    #: Keep a journal (JSON Lines, no frames) of every session here, for exact replay (None: off).
    record_dir: str | None = None
    #: executor="ray": the cluster to join (``"auto"``, ``"ray://head:10001"``, ``"head:6379"``);
    #: None starts a local Ray (or uses the one this process already connected to; an address
    #: naming another cluster than that one is refused: Ray connects a process to one).
    ray_address: str | None = None
    #: executor="ray": what each worker's actor reserves: CPUs, GPUs (None: 1 when the model
    #: asks for a GPU -- its ``device`` option names ``cuda`` -- else 0: decided by the model,
    #: never by what the cluster has when the front-end starts) and custom resources (e.g.
    #: ``{"worldserve": 1}`` on the nodes meant for it).
    ray_num_cpus: float = 1.0
    ray_num_gpus: float | None = None
    ray_resources: Mapping[str, float] = field(default_factory=dict)
    #: executor="ray": how often the front-end pings each worker's actor, and how long an
    #: unanswered ping may take before the actor is declared dead (and killed).
    ray_ping_interval_s: float = 1.0
    ray_ping_timeout_s: float = 3.0
    #: executor="ray": joining a cluster that does not answer fails after this many seconds.
    ray_connect_timeout_s: float = 20.0
    #: executor="ray": a head (GCS) that does not answer this long is lost, and every worker with it.
    ray_head_timeout_s: float = 10.0
    #: How long a worker may take to start: placed (Ray) and its model loaded; then the start fails.
    worker_start_timeout_s: float = 300.0
    #: A newer event supersedes queued events on the tracks the model marks continuous
    #: (``spec.continuous_tracks``), so held controls never fill the queue; False: the seed's queue.
    coalesce_controls: bool = True
    #: Where frames are encoded for a session created with an encoding (the server's sessions):
    #: "worker" (the runner, right after the step, on the worker's CPU threads: only compressed
    #: bytes come back), "server" (workers hand back raw arrays; the server encodes each chunk in
    #: a thread), or "auto": the measured better place, today the worker with every executor
    #: (docs/deploy.md, "Frames": raw chunks cost more to move, even through shared memory,
    #: than to encode, and a session whose chunk the server is still encoding misses its
    #: worker's next batch).
    encode_frames: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model name; got {self.model!r}.")
        object.__setattr__(self, "model_options", MappingProxyType(dict(self.model_options)))
        object.__setattr__(self, "ray_resources", MappingProxyType(dict(self.ray_resources)))
        for name, amount in [("ray_num_cpus", self.ray_num_cpus), ("ray_num_gpus", self.ray_num_gpus or 0)]:
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
                raise ValueError(f"{name} must be a non-negative number; got {amount!r}.")
        for name in (
            "ray_ping_interval_s",
            "ray_ping_timeout_s",
            "ray_connect_timeout_s",
            "ray_head_timeout_s",
            "worker_start_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds; got {value!r}.")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be a cluster address or None; got {self.ray_address!r}.")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer; got {self.workers!r}.")
        if self.executor not in EXECUTOR_NAMES:
            raise ValueError(f"executor must be one of {list(EXECUTOR_NAMES)}; got {self.executor!r}.")
        if (
            isinstance(self.max_pending_events, bool)
            or not isinstance(self.max_pending_events, int)
            or self.max_pending_events < 1
        ):
            raise ValueError(f"max_pending_events must be a positive integer; got {self.max_pending_events!r}.")
        if self.max_sessions_per_worker is not None and (
            isinstance(self.max_sessions_per_worker, bool)
            or not isinstance(self.max_sessions_per_worker, int)
            or self.max_sessions_per_worker < 1
        ):
            raise ValueError(
                f"max_sessions_per_worker must be a positive integer or None; got {self.max_sessions_per_worker!r}."
            )
        if isinstance(self.frame_buffer_bytes, bool) or not isinstance(self.frame_buffer_bytes, int):
            raise ValueError(f"frame_buffer_bytes must be a non-negative integer; got {self.frame_buffer_bytes!r}.")
        if self.threads_per_worker is not None and (
            isinstance(self.threads_per_worker, bool)
            or not isinstance(self.threads_per_worker, int)
            or self.threads_per_worker < 1
        ):
            raise ValueError(f"threads_per_worker must be a positive integer or None; got {self.threads_per_worker!r}.")
        if self.encode_frames not in ENCODE_FRAMES:
            raise ValueError(f"encode_frames must be one of {list(ENCODE_FRAMES)}; got {self.encode_frames!r}.")
        if type(self.coalesce_controls) is not bool:
            raise ValueError(f"coalesce_controls must be a bool; got {self.coalesce_controls!r}.")
        self.worker_config()  # validates the limits
        self.engine_config()  # validates the scheduling knobs

    @property
    def ray_gpus_per_worker(self) -> float:
        """The GPUs each Ray worker reserves: as configured, else 1 when the model's ``device``
        option names a CUDA device, else 0."""
        if self.ray_num_gpus is not None:
            return float(self.ray_num_gpus)
        return 1.0 if str(self.model_options.get("device", "")).startswith("cuda") else 0.0

    @property
    def encodes_in_worker(self) -> bool:
        """True when the workers encode the frames of sessions created with an encoding."""
        return self.encode_frames in ("auto", "worker")

    def worker_threads(self) -> tuple[int | None, str]:
        """(each worker's compute threads, why): as given, else :func:`default_threads_per_worker`
        for the multiprocess executor; None (the library's own default) for the others."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker, "--threads-per-worker"
        if self.executor != "multiprocess":
            return None, f"the {self.executor} executor leaves the compute libraries' defaults"
        return default_threads_per_worker(self.workers)

    def worker_config(self) -> WorkerConfig:
        limits = ResidencyLimits(self.max_sessions_per_worker, self.memory_budget_bytes)
        threads, _ = self.worker_threads()
        return WorkerConfig(self.model, dict(self.model_options), limits, threads)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            batch_wait_s=self.batch_wait_s,
            max_batch_size=self.max_batch_size,
            gather_wait_s=self.gather_wait_s,
            step_budget=self.step_budget,
            tick_deadline_s=self.tick_deadline_s,
            hang_timeout_s=self.hang_timeout_s,
            rpc_timeout_s=self.rpc_timeout_s,
        )

    # -- command line --------------------------------------------------------------------

    @staticmethod
    def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the runtime's flags (``--model``, ``--model-option``, ``--workers``, ...).

        Each flag's type refuses a value :class:`RuntimeConfig` would refuse, so a bad one is
        reported by the parser (one line) before any worker starts.
        """
        group = parser.add_argument_group("runtime")
        group.add_argument(
            "--model",
            type=model_name,
            default=DEFAULT_MODEL,
            help=(
                "tinyworld (trained), procedural (the exact world), wan-causal (block-causal "
                "Wan2.1 on diffusers: --model-option weights=DIR (the published files), config=tiny|1.3b|14b, "
                "load=dummy; see docs/wan-causal.md), matrix-game-2 (Matrix-Game 2.0, keyboard and mouse, from a "
                "start image: --model-option weights=DIR, variant=universal|gta-drive|templerun; see "
                "docs/matrix-game.md) "
                "or package.module:factory"
            ),
        )
        group.add_argument(
            "--model-option",
            type=_key_value("KEY=VALUE", _parse_option),
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a model option (VALUE is JSON if it parses, else a string), checked when the workers load "
            "the model, before the server listens; repeatable (default: none)",
        )
        group.add_argument("--workers", type=positive_int, default=1, help="worker processes (or Ray actors)")
        group.add_argument(
            "--executor",
            choices=EXECUTOR_NAMES,
            default="multiprocess",
            help="how workers run: local processes, in this process (tests), or Ray actors",
        )
        group.add_argument(
            "--max-sessions-per-worker",
            type=positive_int,
            default=None,
            help="sessions whose state one worker may hold (default: no limit but --memory-budget and real time)",
        )
        group.add_argument(
            "--memory-budget",
            type=byte_size,
            default=None,
            help="session state bytes per worker, e.g. 8GiB (default: no limit)",
        )
        group.add_argument(
            "--max-pending-events", type=positive_int, default=64, help="accepted events a session may queue"
        )
        group.add_argument(
            "--batch-wait-ms",
            type=non_negative_float,
            default=2.0,
            help="without a running chunk clock: longest wait for batch company",
        )
        group.add_argument(
            "--max-batch-size",
            type=positive_int,
            default=None,
            help="sessions per model step (default: the model's own limit)",
        )
        group.add_argument(
            "--gather-wait-ms",
            type=non_negative_float,
            default=20.0,
            help="on a worker's chunk clock: longest wait for the sessions due at an instant "
            "(from the instant, or from the end of a step that ran past it)",
        )
        group.add_argument(
            "--step-budget",
            type=positive_float,
            default=0.9,
            help="admit a session to a clocked worker only while its predicted step stays under this share "
            "of the chunk period",
        )
        group.add_argument(
            "--tick-deadline-s",
            type=non_negative_float,
            default=30.0,
            help="a chunk not made within this many seconds fails its session (0: no deadline)",
        )
        group.add_argument(
            "--hang-timeout-s",
            type=non_negative_float,
            default=0.0,
            help="kill a worker stuck in one step this long (0: never)",
        )
        group.add_argument(
            "--rpc-timeout-s",
            type=non_negative_float,
            default=60.0,
            help="longest wait for a worker's answer to a control call (0: no limit)",
        )
        group.add_argument(
            "--frame-buffer",
            type=byte_size,
            default=DEFAULT_FRAME_BUFFER_BYTES,
            help="shared memory per worker for handing frames over (0: through the pipe)",
        )
        group.add_argument(
            "--threads-per-worker",
            type=positive_int,
            default=None,
            help="CPU threads per worker process (default: the cores less one for the server, "
            "shared evenly among the workers; said at start-up)",
        )
        group.add_argument(
            "--record-dir",
            default=None,
            metavar="DIR",
            help="keep a journal of every session in DIR (JSON Lines, no frames) for `worldserve replay` "
            "(default: off)",
        )
        group.add_argument(
            "--ray-address",
            default=None,
            help="--executor ray: the Ray cluster to join (e.g. auto, head:6379) (default: start a local Ray)",
        )
        group.add_argument(
            "--ray-num-cpus", type=non_negative_float, default=1.0, help="--executor ray: CPUs per worker actor"
        )
        group.add_argument(
            "--ray-num-gpus",
            type=non_negative_float,
            default=None,
            help="--executor ray: GPUs per worker (default: 1 when --model-option device=cuda..., else 0)",
        )
        group.add_argument(
            "--ray-resource",
            type=_key_value("NAME=AMOUNT", _parse_resource),
            action="append",
            default=[],
            metavar="NAME=AMOUNT",
            help="--executor ray: a custom Ray resource each worker reserves; repeatable (default: none)",
        )
        group.add_argument(
            "--ray-ping-interval-s",
            type=positive_float,
            default=1.0,
            help="--executor ray: seconds between liveness pings of each worker actor",
        )
        group.add_argument(
            "--ray-ping-timeout-s",
            type=positive_float,
            default=3.0,
            help="--executor ray: an actor whose ping is unanswered this long is declared dead",
        )
        group.add_argument(
            "--ray-connect-timeout-s",
            type=positive_float,
            default=20.0,
            help="--executor ray: give up joining a Ray cluster that does not answer after this long",
        )
        group.add_argument(
            "--ray-head-timeout-s",
            type=positive_float,
            default=10.0,
            help="--executor ray: a Ray head (GCS) silent this long is lost: every session fails worker_died "
            "and the server stops",
        )
        group.add_argument(
            "--worker-start-timeout-s",
            type=positive_float,
            default=300.0,
            help="give up when a worker is not placed (Ray) and ready with its model after this long",
        )
        group.add_argument(
            "--no-coalesce-controls",
            dest="coalesce_controls",
            action="store_false",
            help="queue every held-key/camera event as the seed does (by default a newer event on the model's "
            "continuous tracks supersedes queued ones, reported dropped with reason superseded)",
        )
        group.add_argument(
            "--encode-frames",
            choices=ENCODE_FRAMES,
            default="auto",
            help="where a session's frames are encoded (JPEG/raw bytes): in the worker, right after the step, "
            "on its --threads-per-worker, so only compressed bytes come back; or in the server, from raw frames; "
            "auto: the measured better place, today the worker (docs/deploy.md)",
        )

    @classmethod
    def from_cli_arguments(cls, namespace: argparse.Namespace) -> RuntimeConfig:
        return cls(
            model=namespace.model,
            model_options=dict(namespace.model_option),
            workers=namespace.workers,
            executor=namespace.executor,
            max_sessions_per_worker=namespace.max_sessions_per_worker,
            memory_budget_bytes=namespace.memory_budget,
            max_pending_events=namespace.max_pending_events,
            batch_wait_s=namespace.batch_wait_ms / 1000.0,
            max_batch_size=namespace.max_batch_size,
            gather_wait_s=namespace.gather_wait_ms / 1000.0,
            step_budget=namespace.step_budget,
            tick_deadline_s=namespace.tick_deadline_s or None,
            hang_timeout_s=namespace.hang_timeout_s or None,
            rpc_timeout_s=namespace.rpc_timeout_s or None,
            frame_buffer_bytes=namespace.frame_buffer,
            threads_per_worker=namespace.threads_per_worker,
            record_dir=namespace.record_dir,
            ray_address=namespace.ray_address,
            ray_num_cpus=namespace.ray_num_cpus,
            ray_num_gpus=namespace.ray_num_gpus,
            ray_resources=dict(namespace.ray_resource),
            ray_ping_interval_s=namespace.ray_ping_interval_s,
            ray_ping_timeout_s=namespace.ray_ping_timeout_s,
            ray_connect_timeout_s=namespace.ray_connect_timeout_s,
            ray_head_timeout_s=namespace.ray_head_timeout_s,
            worker_start_timeout_s=namespace.worker_start_timeout_s,
            coalesce_controls=namespace.coalesce_controls,
            encode_frames=namespace.encode_frames,
        )


def _parse_resource(item: str) -> tuple[str, float]:
    name, sep, text = item.partition("=")
    try:
        amount = float(text)
    except ValueError:
        amount = -1.0
    if not sep or not name or not amount >= 0:
        raise ValueError(f"--ray-resource takes NAME=AMOUNT (a non-negative number); got {item!r}.")
    return name, amount


def _parse_option(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--model-option takes KEY=VALUE; got {item!r}.")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text
