"""Control-plane cost: worldserve side by side with the seed (vllm-omni 0.30.0), one run, alternating.

The seed's implementation is vllm-omni 0.30.0's ``vllm_omni/experimental/ar_diffusion/{tick_protocol,
session}.py``. It is never copied into this project: the script ``pip download``s the wheel into a
temporary folder and loads those two files from it (``--seed-dir`` points at an unpacked copy instead).

Workload, identical for both (checked before timing: both must emit the same ticks), per round:
4 events, then one chunk that applies them (see ``WORKLOAD``).

- per event: construction included, i.e. ``ControlInput``s + ``SessionEvent`` + ``accept_event``,
  averaged over the round's 4 events;
- per chunk: ``next_chunk()`` with a trivial consumer (returns ``ChunkMetadata.from_tick``) and a
  lifecycle that does nothing.

Each sample times ``--rounds`` rounds of one implementation on a fresh session (GC collected before,
disabled during, as ``timeit`` does); samples alternate A, B, A, B, ...; the table shows medians.

Usage: python bench/control_plane.py [--samples N] [--rounds N] [--seed-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED_REQUIREMENT = "vllm-omni==0.30.0"
SEED_PACKAGE = "vllm_omni.experimental.ar_diffusion"
SEED_FILES = ("tick_protocol", "session")  # tick_protocol first: session imports it

EVENTS_PER_CHUNK = 4
SAMPLES_PER_POSE = 12
POSE_TRACKS = ("camera", "avatar", "left_hand", "right_hand")
WORKLOAD = (
    "4 events/chunk: a prompt; 4 controls x 12 samples {x,y,yaw,pitch} in one event; "
    "keys {held:[w,shift]}; mouse {buttons:[left],dx,dy}"
)


@dataclass(frozen=True)
class Impl:
    """The five names the workload needs from one implementation of the control plane."""

    name: str
    ControlInput: Any
    SessionEvent: Any
    Session: Any
    ChunkMetadata: Any


def worldserve_impl() -> Impl:
    import worldserve

    return Impl(
        "worldserve", worldserve.ControlInput, worldserve.SessionEvent, worldserve.Session, worldserve.ChunkMetadata
    )


# -- the seed ----------------------------------------------------------------------------------------------------


@contextmanager
def _seed_import_names() -> Iterator[None]:
    """Stand-in parent packages for the seed's absolute imports; ``sys.modules`` is restored after."""
    parts = SEED_PACKAGE.split(".")
    packages = [".".join(parts[: i + 1]) for i in range(len(parts))]
    names = [*packages, *(f"{SEED_PACKAGE}.{name}" for name in SEED_FILES)]
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for package in packages:
            module = types.ModuleType(package)
            module.__path__ = []
            sys.modules[package] = module
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def load_seed(directory: Path) -> Impl:
    """Load the seed's two modules from ``directory`` (the files, or an unpacked ``vllm_omni`` tree)."""
    nested = directory / Path(*SEED_PACKAGE.split("."))
    if nested.is_dir():
        directory = nested
    modules: dict[str, types.ModuleType] = {}
    with _seed_import_names():
        for name in SEED_FILES:
            qualified = f"{SEED_PACKAGE}.{name}"
            spec = importlib.util.spec_from_file_location(qualified, directory / f"{name}.py")
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {qualified} from {directory}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[qualified] = module
            spec.loader.exec_module(module)
            modules[name] = module
    tick_protocol, session = modules["tick_protocol"], modules["session"]
    return Impl(
        "vllm-omni 0.30.0 (seed)",
        tick_protocol.ARDiffusionControlInput,
        session.ARDiffusionSessionEvent,
        session.ARDiffusionSession,
        tick_protocol.ARDiffusionChunkMetadata,
    )


def download_seed(destination: Path) -> Path:
    """``pip download`` the seed's wheel into ``destination`` and extract its two modules there."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    subprocess.run([*pip, "--dest", str(destination), SEED_REQUIREMENT], check=True)
    wheel = next(destination.glob("vllm_omni-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        for name in SEED_FILES:
            member = f"{SEED_PACKAGE.replace('.', '/')}/{name}.py"
            (destination / f"{name}.py").write_bytes(archive.read(member))
    return destination


# -- the workload ------------------------------------------------------------------------------------------------


def _pose_samples(offset: int) -> list[dict[str, float]]:
    return [
        {"x": 0.5 * i + offset, "y": -0.25 * i, "yaw": 1.5 * i, "pitch": -0.75 * i + offset}
        for i in range(SAMPLES_PER_POSE)
    ]


def make_events(impl: Impl, first_event_id: int) -> list[Any]:
    """The round's 4 events, built from plain JSON-like data as a transport would receive it."""
    control, event = impl.ControlInput, impl.SessionEvent
    poses = tuple(
        control(track=track, schema="bench.pose.v1", data={"samples": _pose_samples(first_event_id + i)})
        for i, track in enumerate(POSE_TRACKS)
    )
    return [
        event(event_id=first_event_id, prompt=f"a forest path, round {first_event_id}"),
        event(event_id=first_event_id + 1, controls=poses),
        event(
            event_id=first_event_id + 2,
            controls=(control(track="keys", schema="bench.keys.v1", data={"held": ["w", "shift"]}),),
        ),
        event(
            event_id=first_event_id + 3,
            controls=(control(track="mouse", schema="bench.mouse.v1", data={"buttons": ["left"], "dx": 3, "dy": -2}),),
        ),
    ]


class TrivialConsumer:
    """Echoes the tick's metadata at once: the control plane's own cost, no model."""

    def __init__(self, impl: Impl) -> None:
        self._from_tick = impl.ChunkMetadata.from_tick
        self.last_tick: Any = None

    async def execute_tick(self, tick: Any) -> Any:
        self.last_tick = tick
        return self._from_tick(tick)

    def chunk_metadata(self, output: Any) -> Any:
        return output


class NullLifecycle:
    async def reset_session(self, session_id: str) -> None:
        del session_id

    async def close_session(self, session_id: str) -> None:
        del session_id


def new_session(impl: Impl, request_id_factory: Callable[[str, int], str] | None = None) -> tuple[Any, TrivialConsumer]:
    consumer = TrivialConsumer(impl)
    session = impl.Session(
        "bench-world",
        tick_consumer=consumer,
        lifecycle=NullLifecycle(),
        max_pending_events=2 * EVENTS_PER_CHUNK,
        request_id_factory=request_id_factory,
    )
    return session, consumer


async def run_rounds(impl: Impl, session: Any, rounds: int, first_event_id: int = 1) -> tuple[int, int]:
    """Run ``rounds`` rounds; return (ns spent on events, ns spent on chunks)."""
    clock = time.perf_counter_ns
    event_ns = chunk_ns = 0
    event_id = first_event_id
    for _ in range(rounds):
        started = clock()
        for event in make_events(impl, event_id):
            await session.accept_event(event)
        accepted = clock()
        await session.next_chunk()
        chunk_ns += clock() - accepted
        event_ns += accepted - started
        event_id += EVENTS_PER_CHUNK
    return event_ns, chunk_ns


def workload_ticks(impl: Impl, rounds: int = 2) -> list[dict[str, Any]]:
    """The wire form (``to_extra_args``) of the ticks the workload produces, with fixed request ids."""
    session, consumer = new_session(impl, lambda session_id, chunk: f"{session_id}-{chunk}")
    ticks: list[dict[str, Any]] = []

    async def go() -> None:
        for round_index in range(rounds):
            await run_rounds(impl, session, 1, first_event_id=1 + EVENTS_PER_CHUNK * round_index)
            ticks.append(consumer.last_tick.to_extra_args())

    asyncio.run(go())
    return ticks


def sample(impl: Impl, rounds: int) -> tuple[float, float]:
    """One timed sample on a fresh session: (µs per event, µs per chunk)."""
    session, _ = new_session(impl)
    gc.collect()
    gc.disable()
    try:
        event_ns, chunk_ns = asyncio.run(run_rounds(impl, session, rounds))
    finally:
        gc.enable()
    return event_ns / (rounds * EVENTS_PER_CHUNK) / 1e3, chunk_ns / rounds / 1e3


# -- the report --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    metric: str
    worldserve_us: float
    seed_us: float
    target: float

    @property
    def ratio(self) -> float:
        return self.worldserve_us / self.seed_us

    @property
    def met(self) -> bool:
        return self.ratio <= self.target


def measure(ours: Impl, seed: Impl, samples: int, rounds: int) -> list[Row]:
    """Alternate samples A/B (starting side alternating too) and take medians."""
    times: dict[str, list[tuple[float, float]]] = {ours.name: [], seed.name: []}
    for index in range(samples):
        order = (ours, seed) if index % 2 == 0 else (seed, ours)
        for impl in order:
            times[impl.name].append(sample(impl, rounds))
    ours_events, ours_chunks = zip(*times[ours.name], strict=True)
    seed_events, seed_chunks = zip(*times[seed.name], strict=True)
    return [
        Row("per event (construct + accept)", statistics.median(ours_events), statistics.median(seed_events), 0.4),
        Row("per chunk (next_chunk)", statistics.median(ours_chunks), statistics.median(seed_chunks), 0.1),
    ]


def format_table(rows: Sequence[Row], *, samples: int, rounds: int) -> str:
    header = f"{'metric':<32} {'worldserve µs':>14} {'seed µs':>10} {'ratio':>7} {'target':>8}  met"
    lines = [
        "control plane: worldserve vs vllm-omni 0.30.0 (seed)",
        f"workload: {WORKLOAD}",
        f"medians of {samples} alternating samples per side, {rounds} rounds each; Python {sys.version.split()[0]}",
        "",
        header,
        "-" * len(header),
    ]
    for row in rows:
        lines.append(
            f"{row.metric:<32} {row.worldserve_us:>14.2f} {row.seed_us:>10.2f} "
            f"{row.ratio:>6.3f}x {'<= ' + format(row.target, '.1f') + 'x':>8}  {'yes' if row.met else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=21, help="timed samples per implementation (default 21)")
    parser.add_argument("--rounds", type=int, default=200, help="rounds (4 events + 1 chunk) per sample")
    parser.add_argument("--seed-dir", type=Path, help="load the seed from here instead of downloading it")
    args = parser.parse_args(argv)

    ours = worldserve_impl()
    with tempfile.TemporaryDirectory(prefix="worldserve-bench-") as scratch:
        seed = load_seed(args.seed_dir if args.seed_dir else download_seed(Path(scratch)))
    if workload_ticks(ours) != workload_ticks(seed):
        raise SystemExit("the two implementations emit different ticks for the workload; not comparable")
    for impl in (ours, seed):  # warm up both before the first timed sample
        sample(impl, max(1, args.rounds // 4))
    rows = measure(ours, seed, args.samples, args.rounds)
    print(format_table(rows, samples=args.samples, rounds=args.rounds))
    return 0 if all(row.met for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
