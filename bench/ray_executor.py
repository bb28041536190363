"""Ray executor benchmark: what a tick costs over Ray against worker processes, and how fast node loss is handled.

One run, side by side, on the fixed-cost model (``fixed_cost_model.py``) with 2 workers:

1. Ticks: ``multiprocess`` (2 worker processes) and ``ray`` (2 actors on 2 nodes of a local
   Ray cluster, ``ray.cluster_utils.Cluster`` on loopback) with 1 session (no batching: the
   per-tick cost) and 16 sessions (batched): chunks/s, p50 tick latency, and the engine's
   overhead per step (round trip minus the model's compute: IPC or Ray's task path and
   serialization). Ray runs twice: with its default system configuration, and with the one
   the executor uses for a local Ray (``LOCAL_SYSTEM_CONFIG``: tighter node health checks,
   replies up to 4 MiB sent straight back rather than through the object store).
2. Node loss: with 16 sessions ticking (``busy``) or none (``idle``), one node is removed
   without grace (its raylet and actor SIGKILLed); the time until the engine learns the
   worker died (its sessions fail with ``worker_died``), under both configurations, the
   executor's liveness pings on in both. Then the time to recover one failed session onto
   the live node (reset + its first chunk), and the node is added back.

3. Frames: the same model making realistic frames (``texture=True``: 12 frames of 480x832 a
   chunk, ~14 MB raw, JPEG q90 ~1.8 MB), 16 sessions, ``inprocess`` (worker threads),
   ``multiprocess`` and ``ray``, each with the frames encoded by the front-end (the
   server's way: raw arrays come back, each chunk is
   encoded in a thread before the session's next tick) and by the workers
   (``encode_frames="worker"``: only JPEG bytes come back): chunks/s, p50 tick (next chunk plus
   the front-end's encoding), the engine's overhead per step (round trip minus compute and the
   worker's encoding), encoding ms per tick (wherever it ran), and the bytes that cross from
   the worker per tick (and what they take on a 10 Gbit/s link). Twice: with the CPU-bound
   step, and with an accelerator-like one (``wait_ms``: the worker waits with its CPU idle,
   as while a GPU computes; there a worker's encoding adds to its step, while the server's
   runs during the next step).

Usage: ``python bench/ray_executor.py [--step-ms 10] [--seconds 3] [--trials 2] [--parts ticks loss frames]``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one BLAS thread per worker: a fixed, comparable cost
_BENCH = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(os.path.dirname(_BENCH), "src")
# Ray's worker processes import the model and worldserve by name (spawned processes get sys.path).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, _BENCH, os.environ.get("PYTHONPATH")) if p)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from runtime import calibrate, quantile, tick_loop  # noqa: E402
from worldserve import Session  # noqa: E402
from worldserve.media import EncodedFrames, FrameEncoding, encode  # noqa: E402
from worldserve.runtime import Chunk, Runtime, TickFailedError  # noqa: E402
from worldserve.runtime.executor.ray_actor import LOCAL_SYSTEM_CONFIG, RayExecutor  # noqa: E402

MODEL = "fixed_cost_model:FixedCostModel"
SLOT = {"worldserve": 1.0}


@dataclass
class TickRow:
    executor: str
    sessions: int
    chunks_per_s: float
    p50_ms: float
    batch: float
    overhead_ms: float


@dataclass
class FrameRow:
    executor: str
    step: str
    encode_at: str
    sessions: int
    chunks_per_s: float
    p50_ms: float
    batch: float
    overhead_ms: float
    encode_ms: float
    bytes_per_tick: float


@dataclass
class LossRow:
    health: str
    load: str
    detect_s: list[float]
    recover_s: list[float]


class LocalCluster:
    def __init__(self, health: dict[str, int] | None) -> None:
        config = {"num_cpus": 0, "_system_config": health} if health else {"num_cpus": 0}
        self.cluster = Cluster(initialize_head=True, head_node_args=config)
        self.nodes = [self.add(), self.add()]
        ray.init(address=self.cluster.address, log_to_driver=False)

    def add(self) -> Any:
        return self.cluster.add_node(num_cpus=1, resources=dict(SLOT))

    def kill(self, node_id: str) -> None:
        node = next(node for node in self.nodes if node.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def restore(self) -> None:
        self.nodes.append(self.add())

    def close(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


def runtime(executor: str, options: dict[str, int], **extra: Any) -> Runtime:
    if executor == "ray":
        extra.update(executor="ray", ray_num_cpus=0.0, ray_resources=SLOT)
    elif executor == "inprocess":
        extra.update(executor="inprocess")
    else:
        extra.update(executor="multiprocess", threads_per_worker=1)
    return Runtime(MODEL, model_options=options, workers=2, batch_wait_s=0.002, **extra)


async def measure_ticks(executor: str, sessions: int, options: dict[str, int], seconds: float) -> TickRow:
    async with runtime(executor, options) as rt:
        live = [await rt.create_session(seed=i) for i in range(sessions)]
        latencies, chunks, elapsed = await tick_loop(live, seconds, warm_s=0.5)
    return TickRow(
        executor=executor,
        sessions=sessions,
        chunks_per_s=len(chunks) / elapsed,
        p50_ms=quantile(latencies, 0.5) * 1000,
        batch=statistics.fmean(chunk.batch_size for chunk in chunks),
        overhead_ms=statistics.median(chunk.roundtrip_s - chunk.compute_s for chunk in chunks) * 1000,
    )


#: The frames part's model: 12 frames of 480x832 per chunk, textured so that JPEG has real work.
FRAME_OPTIONS = {"height": 480, "width": 832, "frames_per_chunk": 12, "texture": True}
JPEG = FrameEncoding("jpeg", 90)


async def measure_frames(
    executor: str, encode_at: str, sessions: int, options: dict[str, Any], seconds: float
) -> FrameRow:
    """Sessions tick back to back; each chunk is encoded (JPEG q90) by its worker or here, in a thread."""
    front_encode: list[float] = []

    async def deliver(chunk: Chunk) -> None:
        if not isinstance(chunk.frames, EncodedFrames):
            began = time.perf_counter()
            await asyncio.to_thread(encode, chunk.frames, JPEG)
            front_encode.append(time.perf_counter() - began)

    # Shared memory for a whole batch of raw chunks (16 x 14 MB) per worker process.
    extra: dict[str, Any] = {"encode_frames": encode_at, "frame_buffer_bytes": 16 * 15 * 2**20}
    async with runtime(executor, dict(options, **FRAME_OPTIONS), **extra) as rt:
        live = [await rt.create_session(seed=i, encoding=JPEG) for i in range(sessions)]
        latencies, chunks, elapsed = await tick_loop(live, seconds, warm_s=1.0, deliver=deliver)
    encoded = [chunk for chunk in chunks if isinstance(chunk.frames, EncodedFrames)]
    assert len(encoded) in (0, len(chunks)), "every session is encoded in one place"
    if encoded:
        encode_ms = statistics.median(chunk.encode_s / chunk.batch_size for chunk in chunks) * 1000
        sizes = [chunk.frames.nbytes for chunk in encoded if isinstance(chunk.frames, EncodedFrames)]
    else:
        encode_ms = statistics.median(front_encode) * 1000
        sizes = [chunk.array().nbytes for chunk in chunks]
    return FrameRow(
        executor=executor,
        step="",
        encode_at=encode_at,
        sessions=sessions,
        chunks_per_s=len(chunks) / elapsed,
        p50_ms=quantile(latencies, 0.5) * 1000,
        batch=statistics.fmean(chunk.batch_size for chunk in chunks),
        overhead_ms=statistics.median(chunk.overhead_s for chunk in chunks) * 1000,
        encode_ms=encode_ms,
        bytes_per_tick=statistics.fmean(sizes),
    )


def frames_table(rows: list[FrameRow]) -> str:
    head = (
        f"{'step':>5} {'executor':>12} {'encoded by':>10} {'sessions':>8} {'chunks/s':>9} {'p50 tick ms':>11} "
        f"{'batch':>6} {'ovh ms/step':>11} {'encode ms/tick':>14} {'MB/tick':>8} {'10GbE ms/tick':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.step:>5} {r.executor:>12} {r.encode_at:>10} {r.sessions:>8} {r.chunks_per_s:>9.1f} {r.p50_ms:>11.1f} "
            f"{r.batch:>6.1f} {r.overhead_ms:>11.2f} {r.encode_ms:>14.2f} {r.bytes_per_tick / 1e6:>8.2f} "
            f"{r.bytes_per_tick * 8 / 10e9 * 1000:>13.2f}"
        )
    return "\n".join(lines)


async def measure_loss(cluster: LocalCluster, health: str, options: dict[str, int], trials: int) -> list[LossRow]:
    rows = [LossRow(health, "busy", [], []), LossRow(health, "idle", [], [])]
    async with runtime("ray", options, max_sessions_per_worker=16) as rt:
        executor = rt.engine.executor
        assert isinstance(executor, RayExecutor)
        for _ in range(trials):
            for row in rows:
                sessions = [await rt.create_session(seed=i) for i in range(16)]
                victims = [s for s in sessions if rt.engine.worker_of(s.session_id) == 1]
                stop = asyncio.Event()

                async def play(session: Session[Chunk], stop: asyncio.Event = stop) -> None:
                    while not stop.is_set():
                        try:
                            await session.next_chunk()
                        except TickFailedError:
                            return

                players = [asyncio.ensure_future(play(s)) for s in sessions] if row.load == "busy" else []
                await asyncio.sleep(1.0)
                died = asyncio.Event()
                engine_callback = executor.on_worker_death
                assert engine_callback is not None

                def on_death(index: int, error: Any, callback: Any = engine_callback, died: Any = died) -> None:
                    callback(index, error)
                    died.set()

                executor.on_worker_death = on_death
                node = executor.node_of(1)
                assert node is not None
                loop = asyncio.get_running_loop()
                began = time.perf_counter()
                removal = loop.run_in_executor(None, cluster.kill, node)  # off the loop: it blocks
                await died.wait()
                row.detect_s.append(time.perf_counter() - began)
                await removal
                executor.on_worker_death = engine_callback
                stop.set()
                await asyncio.gather(*players)
                began = time.perf_counter()
                await victims[0].reset()  # onto worker 0 (worker 1's replacement may not be ready yet)
                await victims[0].next_chunk()
                row.recover_s.append(time.perf_counter() - began)
                for session in sessions:
                    await rt.close_session(session.session_id)
                cluster.restore()  # (on the main thread, as Ray wants) the waiting replacement lands there
                await rt.engine.wait_workers_ready(timeout=120)
    return rows


def ticks_table(rows: list[TickRow]) -> str:
    head = f"{'executor':>14} {'sessions':>8} {'chunks/s':>9} {'p50 ms':>8} {'batch':>6} {'ovh ms/step':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.executor:>14} {r.sessions:>8} {r.chunks_per_s:>9.1f} {r.p50_ms:>8.2f} {r.batch:>6.1f} "
            f"{r.overhead_ms:>11.3f}"
        )
    return "\n".join(lines)


def loss_table(rows: list[LossRow]) -> str:
    head = f"{'ray config':>14} {'load':>5} {'node loss -> worker_died s':>27} {'recover on live node s':>23}"
    lines = [head, "-" * len(head)]
    for r in rows:
        detect = " ".join(f"{value:.2f}" for value in r.detect_s)
        recover = " ".join(f"{value:.2f}" for value in r.recover_s)
        lines.append(f"{r.health:>14} {r.load:>5} {detect:>27} {recover:>23}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    repeats = calibrate(args.step_ms, 256)
    options = {"matrix": 256, "repeats": repeats}
    parts = set(args.parts)
    print(
        f"model step ~{args.step_ms:g} ms (fixed-cost, 1 BLAS thread); 2 workers; Ray {ray.__version__}, a local "
        f"cluster (head without CPUs + 2 nodes); {os.cpu_count()} cores, load average before: "
        f"{' '.join(f'{load:.2f}' for load in os.getloadavg())}"
    )
    if parts & {"ticks", "loss"}:
        print(f"ticks and node loss: frames 4x48x48x3 uint8; {args.seconds:g} s per row")
    tick_rows: list[TickRow] = []
    loss_rows: list[LossRow] = []
    frame_rows: list[FrameRow] = []
    for health_name, health in (("ray defaults", None), ("worldserve", dict(LOCAL_SYSTEM_CONFIG))):
        if health is None and not parts & {"ticks", "loss"}:
            continue
        cluster = LocalCluster(health)
        try:
            for sessions in (1, 16) if "ticks" in parts else ():
                executors = ("ray",) if health is None else ("multiprocess", "ray")
                for executor in executors:
                    row = await measure_ticks(executor, sessions, options, args.seconds)
                    if health is None:
                        row.executor = "ray (defaults)"
                    tick_rows.append(row)
            if health is not None and "frames" in parts:
                # The same CPU-bound step, then an accelerator-like one: a wait with the CPU idle.
                waited = {"matrix": 256, "repeats": 1, "wait_ms": args.frame_wait_ms}
                for step, step_options in (("cpu", options), ("wait", waited)):
                    for executor in ("inprocess", "multiprocess", "ray"):
                        for encode_at in ("server", "worker"):
                            row = await measure_frames(
                                executor, encode_at, args.frame_sessions, step_options, args.frame_seconds
                            )
                            row.step = step
                            frame_rows.append(row)
            if "loss" in parts:
                loss_rows.extend(await measure_loss(cluster, health_name, options, args.trials))
        finally:
            cluster.close()
    if tick_rows:
        print(ticks_table(tick_rows))
    if loss_rows:
        print()
        print(loss_table(loss_rows))
    if frame_rows:
        print(
            f"\nframes: 12x480x832x3 uint8 per chunk (textured), JPEG q90; {args.frame_sessions} sessions, "
            f"{args.frame_seconds:g} s per row; step cpu: ~{args.step_ms:g} ms of matrix products, "
            f"step wait: {args.frame_wait_ms:g} ms with the CPU idle (an accelerator's step)"
        )
        print(frames_table(frame_rows))
    print(f"load average after: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    if not tick_rows or not loss_rows:
        return 0
    by = {(r.executor, r.sessions): r for r in tick_rows}
    print()
    for sessions in (1, 16):
        extra = by["ray", sessions].overhead_ms - by["multiprocess", sessions].overhead_ms
        per_tick = extra / by["ray", sessions].batch
        print(
            f"{sessions} sessions: ray adds {extra:.2f} ms per step ({per_tick:.2f} ms per tick of its batch) "
            "over worker processes (target <= 3 ms per tick)"
        )
    ratio = by["ray", 16].chunks_per_s / by["multiprocess", 16].chunks_per_s
    print(f"16 sessions, batched: ray {ratio:.2f}x the chunks/s of worker processes")
    worst = max(value for row in loss_rows for value in row.detect_s)
    print(f"node loss -> worker_died: at most {worst:.2f} s (target <= 5 s)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=10.0, help="cost of one model step")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per tick row")
    parser.add_argument("--trials", type=int, default=2, help="node losses per load and health-check setting")
    parser.add_argument("--parts", nargs="+", choices=("ticks", "loss", "frames"), default=["ticks", "loss", "frames"])
    parser.add_argument("--frame-sessions", type=int, default=16, help="sessions of the frames part")
    parser.add_argument("--frame-seconds", type=float, default=5.0, help="measured time per frames row")
    parser.add_argument(
        "--frame-wait-ms", type=float, default=200.0, help="frames part: the accelerator-like step's wait"
    )
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
