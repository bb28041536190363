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

from worldserve.models import DEFAULT_MODEL
from worldserve.runtime.engine import EngineConfig
from worldserve.runtime.framebuf import DEFAULT_FRAME_BUFFER_BYTES
from worldserve.runtime.messages import ResidencyLimits, WorkerConfig

__all__ = ["EXECUTOR_NAMES", "RuntimeConfig", "parse_bytes"]

#: The executors a configuration may name.
EXECUTOR_NAMES = ("multiprocess", "inprocess")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12})


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1048576"`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (try 1048576, 512MiB or 2GB).")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
    tick_deadline_s: float | None = 30.0
    hang_timeout_s: float | None = None
    rpc_timeout_s: float | None = 60.0
    frame_buffer_bytes: int = DEFAULT_FRAME_BUFFER_BYTES  # shared memory per worker process; 0: frames via the pipe
    #: CPU threads per worker process for its compute libraries; None: the machine's cores shared
    #: evenly among the workers (workers that each take every core slow each other down).
    threads_per_worker: int | None = None
    #: A newer event supersedes queued events on the tracks the model marks continuous
    #: (``spec.continuous_tracks``), so held controls never fill the queue; False: the seed's queue.
    coalesce_controls: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model name; got {self.model!r}.")
        object.__setattr__(self, "model_options", MappingProxyType(dict(self.model_options)))
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer; got {self.workers!r}.")
        if self.executor not in EXECUTOR_NAMES:
            raise ValueError(f"executor must be one of {list(EXECUTOR_NAMES)}; got {self.executor!r}.")
        if isinstance(self.max_pending_events, bool) or not isinstance(self.max_pending_events, int):
            raise ValueError(f"max_pending_events must be a positive integer; got {self.max_pending_events!r}.")
        if isinstance(self.frame_buffer_bytes, bool) or not isinstance(self.frame_buffer_bytes, int):
            raise ValueError(f"frame_buffer_bytes must be a non-negative integer; got {self.frame_buffer_bytes!r}.")
        if self.threads_per_worker is not None and (
            isinstance(self.threads_per_worker, bool)
            or not isinstance(self.threads_per_worker, int)
            or self.threads_per_worker < 1
        ):
            raise ValueError(f"threads_per_worker must be a positive integer or None; got {self.threads_per_worker!r}.")
        if type(self.coalesce_controls) is not bool:
            raise ValueError(f"coalesce_controls must be a bool; got {self.coalesce_controls!r}.")
        self.worker_config()  # validates the limits
        self.engine_config()  # validates the scheduling knobs

    def worker_config(self) -> WorkerConfig:
        limits = ResidencyLimits(self.max_sessions_per_worker, self.memory_budget_bytes)
        threads = self.threads_per_worker
        if threads is None and self.executor == "multiprocess":
            threads = max(1, (os.cpu_count() or 1) // self.workers)
        return WorkerConfig(self.model, dict(self.model_options), limits, threads)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            batch_wait_s=self.batch_wait_s,
            max_batch_size=self.max_batch_size,
            tick_deadline_s=self.tick_deadline_s,
            hang_timeout_s=self.hang_timeout_s,
            rpc_timeout_s=self.rpc_timeout_s,
        )

    # -- command line --------------------------------------------------------------------

    @staticmethod
    def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the runtime's flags (``--model``, ``--model-option``, ``--workers``, ...)."""
        group = parser.add_argument_group("runtime")
        group.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help="tinyworld (trained, the default), procedural (the exact world) or package.module:factory",
        )
        group.add_argument(
            "--model-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a model option (VALUE is JSON if it parses, else a string); repeatable",
        )
        group.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
        group.add_argument("--executor", choices=EXECUTOR_NAMES, default="multiprocess")
        group.add_argument("--max-sessions-per-worker", type=int, default=None)
        group.add_argument("--memory-budget", type=parse_bytes, default=None, help="state bytes per worker, e.g. 8GiB")
        group.add_argument("--max-pending-events", type=int, default=64)
        group.add_argument("--batch-wait-ms", type=float, default=2.0, help="longest wait for batch company")
        group.add_argument("--max-batch-size", type=int, default=None)
        group.add_argument("--tick-deadline-s", type=float, default=30.0, help="0 disables the deadline")
        group.add_argument("--hang-timeout-s", type=float, default=0.0, help="kill a worker stuck this long; 0: never")
        group.add_argument("--rpc-timeout-s", type=float, default=60.0)
        group.add_argument(
            "--frame-buffer", type=parse_bytes, default=DEFAULT_FRAME_BUFFER_BYTES, help="shared memory per worker"
        )
        group.add_argument(
            "--threads-per-worker",
            type=int,
            default=None,
            help="CPU threads per worker process (default: the cores shared evenly among the workers)",
        )
        group.add_argument(
            "--no-coalesce-controls",
            dest="coalesce_controls",
            action="store_false",
            help="queue every held-key/camera event as the seed does (by default a newer event on the model's "
            "continuous tracks supersedes queued ones, reported dropped with reason superseded)",
        )

    @classmethod
    def from_cli_arguments(cls, namespace: argparse.Namespace) -> RuntimeConfig:
        return cls(
            model=namespace.model,
            model_options=dict(_parse_option(item) for item in namespace.model_option),
            workers=namespace.workers,
            executor=namespace.executor,
            max_sessions_per_worker=namespace.max_sessions_per_worker,
            memory_budget_bytes=namespace.memory_budget,
            max_pending_events=namespace.max_pending_events,
            batch_wait_s=namespace.batch_wait_ms / 1000.0,
            max_batch_size=namespace.max_batch_size,
            tick_deadline_s=namespace.tick_deadline_s or None,
            hang_timeout_s=namespace.hang_timeout_s or None,
            rpc_timeout_s=namespace.rpc_timeout_s or None,
            frame_buffer_bytes=namespace.frame_buffer,
            threads_per_worker=namespace.threads_per_worker,
            coalesce_controls=namespace.coalesce_controls,
        )


def _parse_option(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--model-option takes KEY=VALUE; got {item!r}.")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text
