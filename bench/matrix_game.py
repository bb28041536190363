"""Benchmark ``matrix-game-2``: ``python bench/matrix_game.py`` (tiny config, CPU).

Per AR block (every denoising step, the commit pass and the streaming VAE decode of all sessions in
the batch, i.e. one ``model.step``) it prints the latency of ONE batched step over B sessions at
different positions, each with its own keys and mouse, and, measured in alternation in the same run,
of the same B sessions stepped one per forward (how the reference and FastVideo serve: one session
per process); frames/s per session; whether a session holds real time (a block no slower than its 12
frames' playback at 25 fps, 480 ms); peak device memory (CUDA), the state per session, and the
achieved TFLOP/s of the whole block (transformer, action modules and VAE decode) and of the decode
alone (timed apart on the same batch). Rows print as they are measured; an out-of-memory batch ends
the sweep.

The prepared GPU run (``bench/gpu.sh``'s ``matrix`` part; dummy weights at the released 1.3b widths)::

    python bench/matrix_game.py --config 1.3b --device cuda --dtype bfloat16 --batches 1 2 4 8
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from wan_causal import Rollouts, measure
from worldserve.models.base import SessionOptions
from worldserve.models.matrixgame.adapter import MatrixGameModel, MatrixGameState
from worldserve.models.matrixgame.controls import keys_control, mouse_control
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.options import resolve_dtype
from worldserve.protocol import ControlInput

#: Each session holds other keys and turns the camera another way.
MOVES = [("W",), ("W", "A"), ("S",), ("D",), ("W", "D"), ("A",), ("S", "D"), ()]


class MatrixRollouts(Rollouts):
    """:class:`wan_causal.Rollouts` with Matrix-Game's sessions: each its own start image, keys and mouse."""

    model: MatrixGameModel

    def new_state(self, seed: int) -> MatrixGameState:
        spec = self.model.spec
        image = np.random.default_rng(seed).integers(0, 255, (spec.height, spec.width, 3), dtype=np.uint8)
        return self.model.new_state(f"s{seed}", SessionOptions(seed=seed, image=image.tobytes()))

    def controls(self, row: int) -> tuple[ControlInput, ...]:
        keys = [k for k in MOVES[row % len(MOVES)] if k in self.model.variant.key_names][
            : 1 if self.model.variant.one_hot else 4
        ]
        controls: tuple[ControlInput, ...] = (keys_control(*keys),)
        if self.model.variant.mouse:
            controls += (mouse_control(0.05 * (row % 3 - 1), 0.02 * (row % 2)),)
        return controls

    @property
    def latent_config(self) -> WanCausalConfig:
        return self.model.config.wan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", help="tiny or 1.3b")
    parser.add_argument("--variants", nargs="+", default=["universal"], help="universal, gta-drive, templerun")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--blocks", type=int, default=3, help="measured blocks per batch size (medians)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="the model option compile=1 (torch.compile)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    served, _, note = resolve_dtype(args.dtype, torch.device(args.device), "matrix-game-2")
    print(f"matrix-game-2 bench: config {args.config}, device {args.device}, dtype {served}, dummy weights")
    if note is not None:
        print(f"note: {note}")
    print()
    print(
        "| variant | batch | block latency, one step | B steps of 1 (one per forward) | speed-up | frames/s per "
        "session | real time (25 fps) | peak GiB | state GiB/session | block TFLOP/s | VAE decode | VAE TFLOP/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    footer = ""
    for variant in args.variants:
        model = MatrixGameModel(
            config=args.config,
            variant=variant,
            load="dummy",
            device=args.device,
            dtype=args.dtype,
            max_batch_size=max(args.batches),
            threads=args.threads,
            compile=args.compile,
        )
        cfg, wan = model.config, model.config.wan
        chunk_s = model.spec.frames_per_chunk / model.spec.fps
        kv_gib = cfg.kv_bytes(torch.tensor([], dtype=model.dtype).element_size()) / 2**30
        flops = cfg.block_flops() + wan.vae_decode_flops()
        rollouts = MatrixRollouts(model)
        for size in args.batches:  # each row prints as soon as it is measured
            try:
                row = measure(rollouts, size, args.blocks)
            except torch.OutOfMemoryError:
                print(f"| {variant} | {size} | out of memory | | | | | | | | | |", flush=True)
                break
            latency = row["batched_s"]
            peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] >= 0 else "n/a (CPU)"
            print(
                f"| {variant} | {size} | {latency * 1000:.0f} ms | {row['single_s'] * 1000:.0f} ms | "
                f"{row['single_s'] / latency:.2f}x | {model.spec.frames_per_chunk / latency:.1f} | "
                f"{'yes' if latency <= chunk_s else 'no'} | {peak} | {model.spec.state_bytes / 2**30:.3g} | "
                f"{size * flops / latency / 1e12:.3g} | {row['decode_s'] * 1000:.0f} ms | "
                f"{size * wan.vae_decode_flops() / row['decode_s'] / 1e12:.3g} |",
                flush=True,
            )
        footer += (
            f"{variant}: real time is a block ({wan.video_frames_per_block} frames) in <= {chunk_s * 1000:.0f} ms; "
            f"{flops / 1e12:.4g} TFLOP per block per session (transformer with its action modules, "
            f"{len(wan.denoising_steps)} steps + commit: {cfg.block_flops() / 1e12:.4g}; VAE decode: "
            f"{wan.vae_decode_flops() / 1e12:.4g}); KV cache {kv_gib:.3g} GiB per session over "
            f"{wan.cache_frames} latent frames\n"
        )
        rollouts.release()
        del model, rollouts
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print()
    print(footer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
