"""Benchmark the block-causal Wan model: ``python bench/wan_causal.py`` (tiny config, CPU).

Per AR block (every denoising step, the commit pass and the streaming VAE decode of all
sessions in the batch) it prints the latency of ONE batched forward over B sessions at
different positions and, measured in alternation in the same run, of the same B sessions
stepped one per forward (how vllm-omni serves: ``max_num_seqs=1``); frames/s per session;
whether a session holds real time (a block no slower than its 12 frames' playback); peak
device memory (CUDA) and the arithmetic per session (KV + VAE cache bytes, FLOPs per block).

The prepared GPU run (dummy weights, one run well under 5 minutes on one H100/H200)::

    python bench/wan_causal.py --config 1.3b --device cuda --dtype bfloat16 --windows 3 9 18
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worldserve.models.base import SessionOptions
from worldserve.models.wancausal.adapter import WanCausalModel, WanCausalState
from worldserve.models.wancausal.sampler import recache_context
from worldserve.models.world import keys_control
from worldserve.protocol import TickRequest

KEYS = keys_control("W")


def tick(session: str, index: int) -> TickRequest:
    return TickRequest(session, f"{session}-{index}", index, controls=(KEYS,))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Rollouts:
    """Sessions of one model, each with its own chunk counter; created as batch sizes need them."""

    def __init__(self, model: WanCausalModel) -> None:
        self.model = model
        self.states: list[WanCausalState] = []
        self.index: list[int] = []

    def ensure(self, count: int) -> None:
        while len(self.states) < count:
            seed = len(self.states)
            self.states.append(self.model.new_state(f"s{seed}", SessionOptions(prompt="snowy peaks", seed=seed)))
            self.index.append(0)

    def step(self, rows: list[int]) -> float:
        """One block for ``rows`` in one forward; seconds."""
        batch = [(self.states[r], tick(self.states[r].session_id, self.index[r])) for r in rows]
        sync(self.model.device)
        started = time.perf_counter()
        self.model.step(batch)
        sync(self.model.device)
        for r in rows:
            self.index[r] += 1
        return time.perf_counter() - started

    def release(self) -> None:
        for state in self.states:
            self.model.release(state)
        self.states.clear()


def recache_cost(rollouts: Rollouts, blocks: int) -> tuple[float, int]:
    """Median seconds of one prompt switch's re-cache (session 0's whole context), and the blocks it reruns."""
    model = rollouts.model
    rollouts.ensure(1)
    state = rollouts.states[0]
    embedding = model.text.one("a different prompt")[None]
    times = []
    for _ in range(max(1, blocks)):
        sync(model.device)
        started = time.perf_counter()
        recache_context(model.forward, state.cache, state.log, embedding, model.rope, model.config, keep_sink=False)
        sync(model.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times), len(state.log.blocks)


def measure(rollouts: Rollouts, size: int, blocks: int) -> dict[str, float]:
    """Median block latency of one forward over ``size`` sessions, and of ``size`` forwards of one."""
    device = rollouts.model.device
    rollouts.ensure(size)
    rows = list(range(size))
    rollouts.step(rows)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batched: list[float] = []
    single: list[float] = []
    for _ in range(blocks):  # alternate: one forward over all, then one forward per session
        batched.append(rollouts.step(rows))
        single.append(sum(rollouts.step([r]) for r in rows))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else -1.0
    return {"batched_s": statistics.median(batched), "single_s": statistics.median(single), "peak_gib": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", help="tiny or 1.3b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--windows", type=int, nargs="+", default=[None], help="KV window sizes, latent frames")
    parser.add_argument("--blocks", type=int, default=3, help="measured blocks per batch size (medians)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    print(f"wan-causal bench: config {args.config}, device {args.device}, dtype {args.dtype}, dummy weights")
    print()
    print(
        "| window | batch | block latency, one forward | B forwards of 1 (one per forward) | speed-up | "
        "frames/s per session | real time (16 fps) | peak GiB | state MiB/session | model TFLOP/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    footer = ""
    for window in args.windows:
        model = WanCausalModel(
            config=args.config,
            load="dummy",
            device=args.device,
            dtype=args.dtype,
            window=window,
            max_batch_size=max(args.batches),
            threads=args.threads,
        )
        cfg = model.config
        chunk_s = model.spec.frames_per_chunk / model.spec.fps
        flops = cfg.block_flops() + cfg.vae_decode_flops()
        rollouts = Rollouts(model)
        for size in args.batches:  # each row prints as soon as it is measured
            try:
                row = measure(rollouts, size, args.blocks)
            except torch.OutOfMemoryError:
                print(f"| {cfg.window_frames} | {size} | out of memory | | | | | | | |", flush=True)
                break
            latency = row["batched_s"]
            fps = model.spec.frames_per_chunk / latency
            holds = "yes" if latency <= chunk_s else "no"
            peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] >= 0 else "n/a (CPU)"
            print(
                f"| {cfg.window_frames} | {size} | {latency * 1000:.0f} ms | {row['single_s'] * 1000:.0f} ms | "
                f"{row['single_s'] / latency:.2f}x | {fps:.1f} | {holds} | {peak} | "
                f"{model.spec.state_bytes / 2**20:.0f} | {size * flops / latency / 1e12:.3g} |",
                flush=True,
            )
        switch_s, reran = recache_cost(rollouts, args.blocks)
        footer += (
            f"window {cfg.window_frames}: a prompt switch's re-cache (prompt_switch=recache) reruns the commit pass "
            f"of {reran} cached blocks: {switch_s * 1000:.0f} ms per switch per session\n"
        )
        footer += (
            f"window {cfg.window_frames}: real time is a block ({cfg.video_frames_per_block} frames) in "
            f"<= {chunk_s * 1000:.0f} ms; {flops / 1e9:.4g} GFLOP per block per session (transformer, "
            f"{len(cfg.denoising_steps)} steps + commit: {cfg.block_flops() / 1e9:.4g}; VAE decode: "
            f"{cfg.vae_decode_flops() / 1e9:.4g})\n"
        )
        rollouts.release()
        del model, rollouts
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print()
    print(footer, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
