"""Benchmark ``abot-world``: ``python bench/abot_world.py`` (tiny config, CPU).

Per AR block (every denoising step, the commit pass and the streaming decode of all sessions in the
batch, i.e. one ``model.step``) it prints the latency of ONE batched step over B sessions at different
positions, each holding its own keys, and, measured in alternation in the same run, of the same B
sessions stepped one per forward (how the reference's demo serves: one session per process); frames/s
per session; whether a session holds real time (a block no slower than its 12 frames' playback at
16 fps, 750 ms); peak device memory (CUDA) and the state per session; the achieved TFLOP/s of the
transformer (its FLOPs counted as Wan's, without the reference slots' few tokens); and the decode of
the same batch by Wan2.2's VAE and by TAEHV (``decoder=taehv``, ``taew2_2.pth``'s structure, random
weights), timed apart. ``--size HxW`` runs the configuration at another video size (the reference slots
stay 512x512); ``--quants none fp8`` measures each size with the serving dtype's GEMMs and with
``quant=fp8``'s. Rows print as they are measured; an out-of-memory batch ends the sweep.

The prepared GPU run (``bench/gpu.sh``'s ``abot`` part; dummy weights at the released 5B widths)::

    python bench/abot_world.py --config 5b --device cuda --dtype bfloat16 --batches 1 2 4 --sizes 704x1280 352x640
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from wan_causal import Rollouts, measure
from worldserve.models.abot.config import ABotConfig, get_config
from worldserve.models.abot.model import ABotWorldModel
from worldserve.models.base import SessionOptions
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.decoders import DecoderChoice, build_frame_decoder
from worldserve.models.wan.options import resolve_dtype
from worldserve.protocol import ControlInput

#: Each session holds other keys.
MOVES = [("W",), ("W", "L"), ("S",), ("D", "I"), ("W", "J"), ("A",), ("K",), ()]


class ABotRollouts(Rollouts):
    """:class:`wan_causal.Rollouts` with ABot-World's sessions: each its own seed and keys."""

    model: ABotWorldModel

    def new_state(self, seed: int) -> object:
        return self.model.new_state(f"s{seed}", SessionOptions(seed=seed))

    def controls(self, row: int) -> tuple[ControlInput, ...]:
        return (ControlInput("keys", "worldserve.keys.v1", {"held": list(MOVES[row % len(MOVES)])}),)

    @property
    def latent_config(self) -> WanCausalConfig:
        return self.model.config.wan


def sized(config: ABotConfig, size: str | None) -> ABotConfig:
    """``config`` at a video size ``HxW`` (None: its own)."""
    if size is None:
        return config
    height, width = (int(part) for part in size.lower().split("x"))
    return replace(config, wan=replace(config.wan, height=height, width=width))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", help="tiny or 5b")
    parser.add_argument("--sizes", nargs="+", default=[None], help="video sizes HxW (default: the config's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--blocks", type=int, default=3, help="measured blocks per batch size (medians)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--quants", nargs="+", default=["none"], choices=["none", "fp8"], help="none and/or fp8 (quant=fp8's GEMMs)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    served, _, note = resolve_dtype(args.dtype, torch.device(args.device), "abot-world")
    print(f"abot-world bench: config {args.config}, device {args.device}, dtype {served}, dummy weights")
    if note is not None:
        print(f"note: {note}")
    print()
    print(
        "| size | GEMMs | batch | block latency, one step | B steps of 1 (one per forward) | speed-up | "
        "frames/s per session | real time (16 fps) | peak GiB | state GiB/session | transformer TFLOP/s | "
        "VAE decode | TAEHV decode |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    footer = ""
    for size, quant in [(size, quant) for size in args.sizes for quant in args.quants]:
        config = sized(get_config(args.config), size)
        model = ABotWorldModel(
            config=config,
            load="dummy",
            device=args.device,
            dtype=args.dtype,
            quant=quant,
            max_batch_size=max(args.batches),
            threads=args.threads,
        )
        wan = config.wan
        label = f"{wan.height}x{wan.width} | {'fp8' if quant == 'fp8' else served}"
        chunk_s = model.spec.frames_per_chunk / model.spec.fps
        flops = wan.block_flops()
        taehv = build_frame_decoder(DecoderChoice("taehv"), model.vae, wan, model.device, model.dtype, 0)
        rollouts = ABotRollouts(model)
        for batch in args.batches:  # each row prints as soon as it is measured
            try:
                row = measure(rollouts, batch, args.blocks, taehv)
            except torch.OutOfMemoryError:
                print(f"| {label} | {batch} | out of memory | | | | | | | | | |", flush=True)
                break
            latency = row["batched_s"]
            rest = latency - row["decode_s"]
            rate = f"{batch * flops / rest / 1e12:.3g}" if rest > 0.1 * latency else "-"
            peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] >= 0 else "n/a (CPU)"
            print(
                f"| {label} | {batch} | {latency * 1000:.0f} ms | {row['single_s'] * 1000:.0f} ms | "
                f"{row['single_s'] / latency:.2f}x | {model.spec.frames_per_chunk / latency:.1f} | "
                f"{'yes' if latency <= chunk_s else 'no'} | {peak} | {model.spec.state_bytes / 2**30:.3g} | "
                f"{rate} | {row['decode_s'] * 1000:.0f} ms | {row['taehv_s'] * 1000:.0f} ms |",
                flush=True,
            )
        if quant == args.quants[0]:
            footer += (
                f"{wan.height}x{wan.width}: real time is a block ({wan.video_frames_per_block} frames) in "
                f"<= {chunk_s * 1000:.0f} ms; transformer {flops / 1e12:.4g} TFLOP per block per session "
                f"({len(wan.denoising_steps)} steps + commit, {wan.tokens_per_frame} tokens per latent frame, "
                f"{config.local_frames}-frame window)\n"
            )
        rollouts.release()
        del model, rollouts, taehv
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print()
    print(footer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
