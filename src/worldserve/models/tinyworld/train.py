"""Train tinyworld on the procedural world: ``python -m worldserve.models.tinyworld.train``.

Owns: the training loop. Teacher forcing in the network's full-sequence layout (every
chunk of a random true rollout is denoised at once, each at its own noise level drawn
from the sampler's few steps, attending to true keyframes through the block-causal,
sliding-window mask), with context corruption (noise and blur on the keyframes, so the
model learns to repair its own imperfect context instead of copying it: the anti-drift
measure), AdamW with warm-up and cosine decay, an EMA of the weights (what ships), bf16
autocast, a tqdm progress bar, a log file, and a checkpoint (model, EMA, optimiser, data
and noise RNG states, canvas-bank seeds) written every few minutes: the same command
resumes from it, and a run with the same seed draws the same batches and noise.

At the end (or with ``--export-only``) the EMA weights are written as safetensors.
Must not know: sessions, ticks, the adapter.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from worldserve.models.tinyworld.config import TinyWorldConfig
from worldserve.models.tinyworld.data import HELD_OUT_SEED, Batch, CanvasBank, make_batch
from worldserve.models.tinyworld.network import ChunkInputs, KeyframeInputs, TinyWorldNet
from worldserve.models.tinyworld.weights import DEFAULT_WEIGHTS, count_parameters, save_weights

__all__ = ["TrainOptions", "main", "train"]


@dataclass(slots=True)
class TrainOptions:
    out: Path = Path("runs/tinyworld")
    steps: int = 5000
    batch: int = 16
    chunks: int = 4
    lr: float = 1.5e-3
    warmup: int = 200
    weight_decay: float = 0.01
    seed: int = 0
    bank_seeds: int = 256
    bank_size: int = 224
    refresh_every: int = 50
    refresh_count: int = 8
    context_noise: float = 0.15
    context_noise_probability: float = 0.5
    context_blur_probability: float = 0.5
    #: Weight of the motion path's own loss: its shifted keyframe vs the true frame where valid.
    motion_loss: float = 0.5
    #: From this fraction of ``steps`` on, this share of batches trains on the model's own context
    #: (each keyframe after the first replaced by the model's sample of the chunk that ends in it).
    self_rollout_from: float = 0.4
    self_rollout_probability: float = 0.4
    #: From this fraction of ``steps`` on, this share of batches trains the first (pure-noise) step
    #: winner-takes-all over ``best_of`` noise draws (see :func:`training_loss`).
    best_of_from: float = 0.5
    best_of_probability: float = 0.3
    best_of: int = 4
    ema: float = 0.999
    bf16: bool = True
    checkpoint_minutes: float = 5.0
    max_minutes: float = 150.0
    log_every: int = 25
    export: Path | None = None
    export_only: bool = False
    #: Stop (resumably) after this many steps even if the schedule runs longer (0: never).
    stop_after: int = 0
    config: TinyWorldConfig = field(default_factory=TinyWorldConfig)


def _lr_at(step: int, options: TrainOptions) -> float:
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    progress = min(1.0, (step - options.warmup) / max(1, options.steps - options.warmup))
    return options.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


_BLUR = torch.tensor([1.0, 2.0, 1.0]) / 4.0


def corrupt_keyframes(frames: Tensor, generator: torch.Generator, options: TrainOptions) -> Tensor:
    """Noise and blur some sequences' keyframes ``[B, N, 3, H, W]`` (the model's context)."""
    b = frames.shape[0]
    out = frames
    blur = torch.rand(b, generator=generator) < options.context_blur_probability
    if blur.any():
        kernel = (_BLUR[:, None] * _BLUR[None, :]).expand(3, 1, 3, 3)
        passes = torch.randint(1, 4, (b,), generator=generator)
        blurred = out.flatten(0, 1)
        for index in range(1, 4):
            blurred = F.conv2d(F.pad(blurred, (1, 1, 1, 1), mode="replicate"), kernel, groups=3)
            chosen = (blur & (passes == index))[:, None, None, None, None]
            out = torch.where(chosen, blurred.view_as(out), out)
    noisy = torch.rand(b, generator=generator) < options.context_noise_probability
    sigma = torch.rand(b, generator=generator) * options.context_noise * noisy
    out = out + sigma[:, None, None, None, None] * torch.randn(out.shape, generator=generator)
    return out.clamp(-1.0, 1.0)


@torch.no_grad()
def self_rollout_keyframes(
    net: TinyWorldNet, batch: Batch, generator: torch.Generator, options: TrainOptions
) -> Tensor:
    """Keyframes with ``1 .. N-1`` replaced by the model's own few-step samples (Self-Forcing, one step deep).

    Every chunk is sampled from the true context with the serving sampler (all chunks at once
    through the full-sequence forward, which equals the cached path); the last frame of each
    sample, quantised to 8 bits like a served frame, becomes the next chunk's keyframe.
    """
    b, n = batch.chunks.shape[:2]
    steps = net.config.steps
    keyframes = KeyframeInputs(batch.keyframes, batch.keyframe_text, batch.keyframe_controls)
    noise = torch.randn((len(steps), *batch.chunks.shape), generator=generator)
    x = noise[0]
    x0 = x
    for index, level in enumerate(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.bf16):
            x0 = net(keyframes, ChunkInputs(x, torch.full((b, n), level), batch.chunk_text, batch.chunk_controls))
        x0 = x0.float()
        if index + 1 < len(steps):
            x = (1.0 - steps[index + 1]) * x0 + steps[index + 1] * noise[index + 1]
    sampled = ((x0.clamp(-1.0, 1.0) + 1.0) * 127.5).round() / 127.5 - 1.0
    out = batch.keyframes.clone()
    out[:, 1:] = sampled[:, :-1, -1]
    return out


def training_loss(
    net: TinyWorldNet,
    batch: Batch,
    generator: torch.Generator,
    options: TrainOptions,
    own_context: bool = False,
    best_of: int = 1,
    skip_first_level: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Mean squared x0 error over every chunk of the batch, each chunk at one of the sampler's noise levels.

    With ``best_of = K > 1`` every chunk is at the first level (pure noise) and only the best of
    ``K`` noise draws per chunk is trained on (winner-takes-all, as in IMLE): the first step then
    learns to turn its noise into one plausible chunk instead of the blurry mean of all of them.
    ``skip_first_level`` leaves that level out of an ordinary batch (it is then trained by the
    winner-takes-all batches alone).
    """
    b, n = batch.chunks.shape[:2]
    context = self_rollout_keyframes(net, batch, generator, options) if own_context else batch.keyframes
    levels = torch.tensor(net.config.steps)
    first = 1 if skip_first_level and len(levels) > 1 else 0
    t = levels[torch.randint(first, len(levels), (b, n), generator=generator)]
    eps = torch.randn(batch.chunks.shape, generator=generator)
    keyframes = corrupt_keyframes(context, generator, options)
    key_inputs = KeyframeInputs(keyframes, batch.keyframe_text, batch.keyframe_controls)
    if best_of > 1:
        t = torch.full((b, n), levels[0].item())
        best = eps
        with torch.no_grad():
            best_error = torch.full((b, n), float("inf"))
            for index in range(best_of):
                candidate = eps if index == 0 else torch.randn(batch.chunks.shape, generator=generator)
                noisy = (1.0 - t[0, 0]) * batch.chunks + t[0, 0] * candidate
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.bf16):
                    guess = net(key_inputs, ChunkInputs(noisy, t, batch.chunk_text, batch.chunk_controls))
                candidate_error = ((guess.float() - batch.chunks) ** 2).mean(dim=(2, 3, 4, 5))
                better = candidate_error < best_error
                best = torch.where(better[:, :, None, None, None, None], candidate, best)
                best_error = torch.minimum(best_error, candidate_error)
        eps = best
    tt = t[:, :, None, None, None, None]
    noisy = (1.0 - tt) * batch.chunks + tt * eps
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.bf16):
        x0, motion = net.forward_with_motion(key_inputs, ChunkInputs(noisy, t, batch.chunk_text, batch.chunk_controls))
    error = (x0.float() - batch.chunks) ** 2
    loss = error.mean()
    if motion is not None and options.motion_loss > 0:
        motion = motion.float()
        valid = (motion[:, :, :, 3:] > 0.99).float()
        shifted_error = (((motion[:, :, :, :3] - batch.chunks) ** 2) * valid).sum() / (3.0 * valid.sum() + 1.0)
        loss = loss + options.motion_loss * shifted_error
    moving = batch.chunk_controls[..., 2:].abs().sum(dim=(-1, -2)) > 0  # [B, N]
    stats = {"loss": float(error.detach().mean())}
    per_chunk = error.detach().mean(dim=(2, 3, 4, 5))
    if moving.any():
        stats["moving"] = float(per_chunk[moving].mean())
    return loss, stats


class ThreadTuner:
    """Picks 1 or 2 (..N) torch threads by measured step time, re-probing now and then.

    On a small shared machine another process's load can make a multi-threaded step many
    times slower (threads wait on each other at every barrier); one thread then wins.
    """

    def __init__(self, most: int, every: int = 30, probe: int = 3) -> None:
        self.choices = sorted({1, most})
        self.current = most
        self.every = every
        self.probe = probe
        self.recent: list[float] = []
        self.probing: int | None = None
        self.probe_times: list[float] = []
        self.steps = 0
        torch.set_num_threads(self.current)

    def record(self, seconds: float) -> None:
        self.steps += 1
        if self.probing is not None:
            self.probe_times.append(seconds)
            if len(self.probe_times) >= self.probe:
                mine = statistics.median(self.recent[-self.probe :]) if self.recent else float("inf")
                theirs = statistics.median(self.probe_times[1:])  # the first step after a switch warms up
                if theirs < 0.9 * mine:
                    self.current = self.probing
                    self.recent = self.probe_times[1:]
                self.probing = None
                self.probe_times = []
                torch.set_num_threads(self.current)
            return
        self.recent = [*self.recent[-10:], seconds]
        if len(self.choices) > 1 and (self.steps % self.every == 0 or self.steps == 3):
            self.probing = next(c for c in self.choices if c != self.current)
            torch.set_num_threads(self.probing)


def _bank_seed(index: int) -> int:
    """The ``index``-th training world seed (a fixed pseudo-random sequence below the held-out range)."""
    return (index * 2654435761 + 12345) % HELD_OUT_SEED


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def train(options: TrainOptions) -> Path:
    """Run (or resume) training; return the exported weights' path."""
    tuner = ThreadTuner(torch.get_num_threads())
    stop = {"signal": False}

    def on_signal(number: int, frame: object) -> None:
        stop["signal"] = True

    signal.signal(signal.SIGTERM, on_signal)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / "checkpoint.pt"
    log_path = out / "train.log"
    export = options.export or out / "tinyworld.safetensors"

    torch.manual_seed(options.seed)
    config = options.config
    net = TinyWorldNet(config)
    ema = copy.deepcopy(net)
    for parameter in ema.parameters():
        parameter.requires_grad_(False)
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, parameter in net.named_parameters():
        (no_decay if parameter.ndim < 2 or "embed" in name or name.endswith("pos") else decay).append(parameter)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": options.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=options.lr,
        betas=(0.9, 0.99),
    )
    rng = np.random.default_rng(options.seed)
    generator = torch.Generator().manual_seed(options.seed)
    next_seed = options.bank_seeds
    seeds = [_bank_seed(i) for i in range(options.bank_seeds)]
    step = 0
    elapsed = 0.0
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        if TinyWorldConfig.from_json(state["config"]) != config:
            raise SystemExit(f"{checkpoint_path} was trained with another config; use another --out")
        net.load_state_dict(state["net"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        generator.set_state(state["generator"])
        seeds = state["seeds"]
        next_seed = state["next_seed"]
        step = state["step"]
        elapsed = state["elapsed"]
    bank = CanvasBank(seeds, options.bank_size)

    def checkpoint() -> None:
        _save_checkpoint(
            checkpoint_path,
            {
                "config": config.to_json(),
                "net": net.state_dict(),
                "ema": ema.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": rng.bit_generator.state,
                "generator": generator.get_state(),
                "seeds": list(bank.seeds),
                "next_seed": next_seed,
                "step": step,
                "elapsed": elapsed,
            },
        )

    with log_path.open("a") as log:
        log.write(
            json.dumps(
                {"event": "start", "step": step, "parameters": count_parameters(net), "config": config.to_json()}
            )
            + "\n"
        )
        started = time.monotonic()
        last_checkpoint = started
        base_elapsed = elapsed
        bar = tqdm(total=options.steps, initial=step, desc="tinyworld", mininterval=10.0, file=sys.stderr)
        running: dict[str, float] = {}
        net.train()
        while step < options.steps and not options.export_only:
            step_started = time.monotonic()
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, options)
            batch = make_batch(rng, bank, options.batch, options.chunks, config)
            own = step >= options.self_rollout_from * options.steps and bool(
                rng.random() < options.self_rollout_probability
            )
            wta_phase = options.best_of > 1 and step >= options.best_of_from * options.steps
            wta = wta_phase and bool(rng.random() < options.best_of_probability)
            loss, stats = training_loss(
                net,
                batch,
                generator,
                options,
                own_context=own,
                best_of=options.best_of if wta else 1,
                skip_first_level=wta_phase,
            )
            stats["own"] = float(own)
            stats["wta"] = float(wta)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0))
            optimizer.step()
            with torch.no_grad():
                beta = min(options.ema, (1.0 + step) / (10.0 + step))
                for target, source in zip(ema.parameters(), net.parameters(), strict=True):
                    target.lerp_(source, 1.0 - beta)
            step += 1
            tuner.record(time.monotonic() - step_started)
            for key, value in {**stats, "grad": grad_norm}.items():
                running[key] = running.get(key, value) * 0.9 + value * 0.1
            bar.update(1)
            bar.set_postfix(loss=f"{running['loss']:.4f}", refresh=False)
            if step % options.refresh_every == 0:
                for _ in range(options.refresh_count):
                    bank.seeds[next_seed % len(bank.seeds)] = _bank_seed(next_seed)
                    bank.replace(next_seed % len(bank.seeds), _bank_seed(next_seed))
                    next_seed += 1
            now = time.monotonic()
            elapsed = base_elapsed + (now - started)
            if step % options.log_every == 0:
                record = {
                    "step": step,
                    "lr": _lr_at(step, options),
                    "minutes": round(elapsed / 60.0, 2),
                    "threads": tuner.current,
                }
                record.update({key: round(value, 5) for key, value in running.items()})
                log.write(json.dumps(record) + "\n")
                log.flush()
            out_of_time = (
                (options.max_minutes > 0 and elapsed >= options.max_minutes * 60.0)
                or (options.stop_after > 0 and step >= options.stop_after)
                or stop["signal"]
            )
            if now - last_checkpoint >= options.checkpoint_minutes * 60.0 or step == options.steps or out_of_time:
                checkpoint()
                last_checkpoint = now
            if out_of_time:
                break
        bar.close()
        meta = {"step": str(step), "train_minutes": f"{elapsed / 60.0:.1f}", "seed": str(options.seed)}
        save_weights(ema, export, meta)
        log.write(json.dumps({"event": "export", "path": str(export), **meta}) + "\n")
    return export


def _parser() -> argparse.ArgumentParser:
    defaults = TrainOptions()
    config = TinyWorldConfig()
    parser = argparse.ArgumentParser(
        prog="python -m worldserve.models.tinyworld.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=defaults.out, help="run folder (checkpoint, log, weights)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--chunks", type=int, default=defaults.chunks, help="chunks per training sequence")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-minutes", type=float, default=defaults.max_minutes, help="stop (resumably) after this")
    parser.add_argument("--checkpoint-minutes", type=float, default=defaults.checkpoint_minutes)
    parser.add_argument("--context-noise", type=float, default=defaults.context_noise)
    parser.add_argument("--no-bf16", action="store_true", help="train in float32")
    parser.add_argument("--dim", type=int, default=config.dim)
    parser.add_argument("--depth", type=int, default=config.depth)
    parser.add_argument("--window", type=int, default=config.window)
    parser.add_argument("--no-motion-path", action="store_true", help="ablation: no learned motion path")
    parser.add_argument("--stop-after", type=int, default=0, help="stop (resumably) after this many steps")
    parser.add_argument("--export-only", action="store_true", help="write the checkpoint's EMA weights and stop")
    parser.add_argument(
        "--export",
        type=Path,
        default=None,
        help=f"weights file (default: OUT/tinyworld.safetensors; shipped: {DEFAULT_WEIGHTS})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = TinyWorldConfig(dim=args.dim, depth=args.depth, window=args.window, motion_path=not args.no_motion_path)
    options = TrainOptions(
        out=args.out,
        steps=args.steps,
        batch=args.batch,
        chunks=args.chunks,
        lr=args.lr,
        warmup=args.warmup,
        seed=args.seed,
        max_minutes=args.max_minutes,
        checkpoint_minutes=args.checkpoint_minutes,
        context_noise=args.context_noise,
        bf16=not args.no_bf16,
        export=args.export,
        export_only=args.export_only,
        stop_after=args.stop_after,
        config=config,
    )
    path = train(options)
    print(f"weights: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
