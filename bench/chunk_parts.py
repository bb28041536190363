"""A chunk whole or in parts: how soon its frames can play, through real worker processes.

``python bench/chunk_parts.py`` (tiny configs, CPU). For each model that makes its chunks in parts
(``spec.frame_parts``: the Wan families, a latent frame at a time) and each number of sessions, the
sessions tick together (one batch) through a :class:`~worldserve.runtime.Runtime` with one worker
process that encodes JPEG, chunk after chunk, with the parts listener (``Runtime.listen_parts``) on
for every other chunk, so both ways are measured side by side in one run. Per chunk, from the tick:

- ``whole``: the chunk is in (commit), the listener off; ``in parts``: the same, the listener on
  (what handing parts on costs the step);
- ``first part``: the first part is in;
- ``playable``: the earliest instant the chunk's first frame could be shown with no frame of it
  late, given when each part came: ``max over parts (arrival - first frame's offset / fps)``;
- ``sooner``: ``whole - playable``, the p50s': how much later a tick could go for the same
  playout instant (or how much sooner a key shows) if frames were played as their parts come.

Usage: ``python bench/chunk_parts.py [--models wan-causal matrix-game-2] [--sessions 1 2] [--chunks 8]``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from worldserve.media import FrameEncoding  # noqa: E402
from worldserve.runtime import ChunkPart, Runtime  # noqa: E402
from worldserve.tools.loadtest import start_image  # noqa: E402

#: Each model's tiny configuration on the CPU (random weights: the cost is the shapes').
MODELS: dict[str, dict[str, object]] = {
    "wan-causal": {"config": "tiny", "threads": 1},
    "matrix-game-2": {"threads": 1},
    "abot-world": {"threads": 1},
}


@dataclass
class Times:
    """Milliseconds from the tick, per chunk."""

    whole: list[float] = field(default_factory=list)
    parted: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    playable: list[float] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)


async def measure(model: str, sessions: int, chunks: int) -> tuple[Times, float]:
    """Tick ``sessions`` sessions together ``chunks`` times after a warm-up; their times, and the fps."""
    async with Runtime(
        model, executor="multiprocess", model_options=MODELS[model], encode_frames="worker", threads_per_worker=1
    ) as rt:
        spec = rt.engine.spec
        image = start_image(spec.height, spec.width).tobytes() if spec.requires_image else None
        made = [
            await rt.create_session(seed=seed, image=image, encoding=FrameEncoding("jpeg")) for seed in range(sessions)
        ]
        await asyncio.gather(*(session.next_chunk() for session in made))  # warm-up: a first chunk is shorter
        times = Times()
        for index in range(chunks):
            parted = index % 2 == 0
            heard: dict[str, list[tuple[float, ChunkPart]]] = {session.session_id: [] for session in made}
            for session in made:
                rt.listen_parts(session.session_id, _listener(heard[session.session_id]) if parted else None)
            began = time.perf_counter()

            async def one(session: object, began: float = began) -> float:
                await session.next_chunk()  # type: ignore[attr-defined]
                return (time.perf_counter() - began) * 1000.0

            done = await asyncio.gather(*(one(session) for session in made))
            for session, ms in zip(made, done, strict=True):
                if not parted:
                    times.whole.append(ms)
                    continue
                parts = heard[session.session_id]
                times.parted.append(ms)
                times.parts.append(len(parts))
                times.first.append((parts[0][0] - began) * 1000.0)
                ready = max(at - part.first / spec.fps - began for at, part in parts)
                times.playable.append(ready * 1000.0)
        return times, spec.fps


def _listener(into: list[tuple[float, ChunkPart]]) -> Callable[[ChunkPart], None]:
    return lambda part: into.append((time.perf_counter(), part))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["wan-causal", "matrix-game-2"], choices=sorted(MODELS))
    parser.add_argument("--sessions", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--chunks", type=int, default=8, help="chunks per row after the warm-up (half in parts)")
    args = parser.parse_args()
    print(
        "| model | sessions | whole p50 (ms) | in parts p50 (ms) | first part p50 (ms) | playable p50 (ms) "
        "| sooner (ms) | parts/chunk |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.models:
        for sessions in args.sessions:
            times, _ = asyncio.run(measure(model, sessions, args.chunks))
            p50 = {name: statistics.median(getattr(times, name)) for name in ("whole", "parted", "first", "playable")}
            sooner = p50["whole"] - p50["playable"]
            print(
                f"| {model} | {sessions} | {p50['whole']:.0f} | {p50['parted']:.0f} | {p50['first']:.0f} "
                f"| {p50['playable']:.0f} | {sooner:.0f} | {statistics.median(times.parts):.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
