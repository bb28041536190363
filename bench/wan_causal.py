"""Benchmark the block-causal Wan model: ``python bench/wan_causal.py`` (tiny config, CPU).

Two parts (``--parts``), each one Markdown table whose rows print as they are measured.

``blocks``: per AR block (every denoising step, the commit pass and the streaming VAE decode of all
sessions in the batch) it prints the latency of ONE batched forward over B sessions at
different positions and, measured in alternation in the same run, of the same B sessions
stepped one per forward (how vllm-omni serves: ``max_num_seqs=1``); frames/s per session;
whether a session holds real time (a block no slower than its 12 frames' playback); peak
device memory (CUDA) and the arithmetic per session (KV + VAE cache bytes, FLOPs per block,
the transformer's and the VAE decode's), and per window the cost of one prompt switch's
re-cache (``prompt_switch=recache``). The last column times TAEHV's decode (``decoder=taehv``, random
weights: the cost is the weights' shape, not their values) of the same batch, next to the VAE's; the
column before it, the VAE's decode of the block's first latent frame alone (its first 4 frames): what a
key would wait for of the decode if a chunk's frames went out as each latent frame is decoded.

``attention``: one transformer forward over B sessions whose caches have different lengths,
with the self-attention as ONE batched call per layer (the sessions' caches gathered, each row
masked past its own length) and as the per-session loop (one call per session per layer), in
alternation in one run; ``--attention-layers`` and ``--attention-grid`` shrink the model (the
1.3b widths on a small grid fit a CPU).

The prepared GPU run (dummy weights, one run well under 5 minutes on one H100/H200)::

    python bench/wan_causal.py --config 1.3b --device cuda --dtype bfloat16 --windows 3 9 18
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from worldserve.models.base import SessionOptions
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.decoders import DecoderChoice, build_frame_decoder
from worldserve.models.wan.sampler import recache_context
from worldserve.models.wancausal.adapter import WanCausalModel
from worldserve.models.world import keys_control
from worldserve.protocol import ControlInput, TickRequest

KEYS = keys_control("W")


def tick(session: str, index: int, controls: tuple[ControlInput, ...] = (KEYS,)) -> TickRequest:
    return TickRequest(session, f"{session}-{index}", index, controls=controls)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Rollouts:
    """Sessions of one model, each with its own chunk counter; created as batch sizes need them.

    ``bench/matrix_game.py`` subclasses it for its model's sessions and controls.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.states: list[Any] = []
        self.index: list[int] = []

    def new_state(self, seed: int) -> Any:
        return self.model.new_state(f"s{seed}", SessionOptions(prompt="snowy peaks", seed=seed))

    def controls(self, row: int) -> tuple[ControlInput, ...]:
        return (KEYS,)

    @property
    def latent_config(self) -> WanCausalConfig:
        """The configuration whose latent shape one block has (for the decode timed alone)."""
        config: WanCausalConfig = self.model.config
        return config

    def ensure(self, count: int) -> None:
        while len(self.states) < count:
            self.states.append(self.new_state(len(self.states)))
            self.index.append(0)

    def step(self, rows: list[int]) -> float:
        """One block for ``rows`` in one step (one batched forward per pass); seconds."""
        batch = [(self.states[r], tick(self.states[r].session_id, self.index[r], self.controls(r))) for r in rows]
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


def measure(rollouts: Rollouts, size: int, blocks: int, taehv: Any = None) -> dict[str, float]:
    """Median block latency of one forward over ``size`` sessions, and of ``size`` forwards of one; with
    ``taehv`` (a :class:`~worldserve.models.wan.taehv.TaehvStream`) also its decode of the same batch."""
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
    # The streaming VAE decode alone (the same batch, copies of the decoder caches), to split the block's time.
    model = rollouts.model
    cfg = rollouts.latent_config
    latents = torch.randn(size, cfg.latent_channels, cfg.block_frames, cfg.latent_height, cfg.latent_width)
    latents = latents.to(device)
    decodes = []
    firsts = []  # the block's first latent frame alone: the decode a key waits for if frames went out as made
    with torch.no_grad():
        for _ in range(blocks):
            caches = [list(rollouts.states[r].decoder) for r in rows]
            sync(device)
            started = time.perf_counter()
            model.decoder.decode(latents, caches)
            sync(device)
            decodes.append(time.perf_counter() - started)
            caches = [list(rollouts.states[r].decoder) for r in rows]
            sync(device)
            started = time.perf_counter()
            model.decoder.decode(latents[:, :, :1], caches)
            sync(device)
            firsts.append(time.perf_counter() - started)
        tiny = []
        if taehv is not None:  # TAEHV's memories, primed by one chunk (the model's sessions are primed too)
            memories = [taehv.new_cache() for _ in rows]
            taehv.decode(latents, memories, first=True)
            for _ in range(blocks):
                copies = [list(memory) for memory in memories]
                sync(device)
                started = time.perf_counter()
                taehv.decode(latents, copies)
                sync(device)
                tiny.append(time.perf_counter() - started)
    return {
        "batched_s": statistics.median(batched),
        "single_s": statistics.median(single),
        "peak_gib": peak,
        "decode_s": statistics.median(decodes),
        "first_s": statistics.median(firsts),
        "taehv_s": statistics.median(tiny) if tiny else -1.0,
    }


def transformer_rate(flops: float, latency: float, decode: float) -> str:
    """TFLOP/s of the block minus its decode; "-" when the decode, timed apart, is most of the block."""
    rest = latency - decode
    return f"{flops / rest / 1e12:.3g}" if rest > 0.1 * latency else "-"


def attention_part(args: argparse.Namespace) -> None:
    """Batched self-attention (one call per layer) vs the per-session loop, one forward, caches of different lengths."""
    from dataclasses import replace

    from worldserve.models.wan.build import build_transformer
    from worldserve.models.wan.cache import KVCache
    from worldserve.models.wan.config import get_config
    from worldserve.models.wan.options import resolve_dtype
    from worldserve.models.wan.rope import FrameRope
    from worldserve.models.wancausal.actions import ActionEmbedding
    from worldserve.models.wancausal.forward import CachedForward

    device = torch.device(args.device)
    _, dtype, _ = resolve_dtype(args.dtype, device, "wan-causal attention")
    config = get_config(args.config)
    if args.attention_layers:
        config = replace(config, num_layers=args.attention_layers)
    if args.attention_grid:
        height, width = (int(v) for v in args.attention_grid.split("x"))
        config = replace(config, height=height, width=width)
    window = args.windows[0] if args.windows[0] is not None else config.window_frames
    config = config.with_window(window)
    with torch.device(device):
        torch.manual_seed(0)
        transformer = build_transformer(config).to(dtype).eval()
        actions = ActionEmbedding(config.action_dim, config.dim).to(dtype).eval()
    batched = CachedForward(transformer, actions, config)
    loop = CachedForward(transformer, actions, config, attention="loop")
    rope = FrameRope(config, device)
    print(
        f"attention: config {config.name} ({config.num_layers} layers, {config.num_heads} x {config.head_dim}, "
        f"{config.height}x{config.width} -> {config.tokens_per_frame} tokens per latent frame), window {window}, "
        f"device {args.device}, {dtype}; one forward over B sessions, cache lengths cycling through the window"
    )
    print()
    print("| batch | one call per layer (batched, masked) | B calls per layer (loop) | speed-up | attention calls |")
    print("|---|---|---|---|---|", flush=True)
    for size in args.batches:
        caches = []
        for row in range(size):  # the sessions' caches hold different numbers of frames
            cache = KVCache(config, device, dtype)
            cache.keys.normal_()
            cache.values.normal_()
            cache.sink_filled = config.sink_frames
            cache.ring_written = row % (config.window_frames + 1)
            cache.next_frame = config.sink_frames + cache.ring_written
            caches.append(cache)
        x = torch.randn(size, config.latent_channels, config.block_frames, config.latent_height, config.latent_width)
        x = x.to(device)
        timesteps = torch.full((size, config.block_frames), 937.5, device=device)
        text = torch.randn(size, config.text_len, config.text_dim, device=device)
        acts = torch.zeros(size, config.block_frames, config.action_dim, device=device)
        table = rope([c.next_frame for c in caches], config.block_frames)
        times: dict[str, list[float]] = {"batched": [], "loop": []}
        with torch.no_grad():
            for attempt in range(args.blocks + 1):  # the first round warms up
                for name, forward in (("batched", batched), ("loop", loop)):
                    sync(device)
                    started = time.perf_counter()
                    forward(x, timesteps, text, acts, caches, table)
                    sync(device)
                    if attempt:
                        times[name].append(time.perf_counter() - started)
        one, many = statistics.median(times["batched"]), statistics.median(times["loop"])
        print(
            f"| {size} | {one * 1000:.1f} ms | {many * 1000:.1f} ms | {many / one:.2f}x | "
            f"{config.num_layers} vs {size * config.num_layers} |",
            flush=True,
        )
        del caches
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", help="tiny, 1.3b or 14b")
    parser.add_argument("--parts", nargs="+", default=["blocks", "attention"], choices=["blocks", "attention"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--windows", type=int, nargs="+", default=[None], help="KV window sizes, latent frames")
    parser.add_argument("--blocks", type=int, default=3, help="measured blocks per batch size (medians)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="the model option compile=1 (torch.compile)")
    parser.add_argument("--attention-layers", type=int, default=None, help="attention part: this many layers")
    parser.add_argument("--attention-grid", default=None, help="attention part: HxW video (e.g. 64x64)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if "blocks" in args.parts:
        blocks_part(args)
    if "attention" in args.parts:
        attention_part(args)
    return 0


def blocks_part(args: argparse.Namespace) -> None:
    from worldserve.models.wan.options import resolve_dtype

    served, _, note = resolve_dtype(args.dtype, torch.device(args.device), "wan-causal")
    print(f"wan-causal bench: config {args.config}, device {args.device}, dtype {served}, dummy weights")
    if note is not None:
        print(f"note: {note}")
    print()
    print(
        "| window | batch | block latency, one forward | B forwards of 1 (one per forward) | speed-up | "
        "frames/s per session | real time (16 fps) | peak GiB | state MiB/session | model TFLOP/s | "
        "VAE decode | its first latent frame | transformer TFLOP/s | VAE TFLOP/s | TAEHV decode (decoder=taehv) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
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
            compile=args.compile,
        )
        cfg = model.config
        chunk_s = model.spec.frames_per_chunk / model.spec.fps
        flops = cfg.block_flops() + cfg.vae_decode_flops()
        rollouts = Rollouts(model)
        taehv = build_frame_decoder(DecoderChoice("taehv"), model.vae, cfg, model.device, model.dtype, 0)
        for size in args.batches:  # each row prints as soon as it is measured
            try:
                row = measure(rollouts, size, args.blocks, taehv)
            except torch.OutOfMemoryError:
                print(f"| {cfg.window_frames} | {size} | out of memory | | | | | | | | | | | | |", flush=True)
                break
            latency = row["batched_s"]
            fps = model.spec.frames_per_chunk / latency
            holds = "yes" if latency <= chunk_s else "no"
            peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] >= 0 else "n/a (CPU)"
            print(
                f"| {cfg.window_frames} | {size} | {latency * 1000:.0f} ms | {row['single_s'] * 1000:.0f} ms | "
                f"{row['single_s'] / latency:.2f}x | {fps:.1f} | {holds} | {peak} | "
                f"{model.spec.state_bytes / 2**20:.0f} | {size * flops / latency / 1e12:.3g} | "
                f"{row['decode_s'] * 1000:.0f} ms | {row['first_s'] * 1000:.0f} ms | "
                f"{transformer_rate(size * cfg.block_flops(), latency, row['decode_s'])} | "
                f"{size * cfg.vae_decode_flops() / row['decode_s'] / 1e12:.3g} | {row['taehv_s'] * 1000:.0f} ms |",
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
    print(footer)


if __name__ == "__main__":
    raise SystemExit(main())
