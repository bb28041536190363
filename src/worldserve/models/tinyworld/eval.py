"""Evaluate tinyworld against the procedural world: ``python -m worldserve.models.tinyworld.eval``.

Owns: the four bars of issue 4, measured on held-out world seeds (``>= HELD_OUT_SEED``,
never trained on), and the table that reports them. The model runs through its
:class:`~worldserve.models.base.WorldModel` interface (batched ``step``); the truth comes
from the ``procedural`` model fed the very same ticks. Only generated frames are scored.

1. Next-chunk fidelity: true history (teacher forcing through the cache), the next chunk's
   controls; mean PSNR over moving chunks vs repeating the last true frame.
2. Action following: 64 free-running chunks under changing keys, camera pans and stillness;
   phase correlation between consecutive generated frames must give the commanded direction
   (moving frames) or no motion (still frames).
3. Prompt following: a style switch mid-rollout; a nearest-centroid colour-histogram
   classifier fitted on true frames (training seeds) must name the new style from the second
   chunk after the switch on.
4. No drift: 300 free-running chunks; the classifier still names the style and each frame's
   histogram distance to its true style centroid stays within the true frames' range.

The same measurements on the true frames are printed as a reference (the tools' ceiling).
Must not know: training.
"""

from __future__ import annotations

import argparse
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from worldserve.models.base import SessionOptions
from worldserve.models.procedural import ProceduralModel
from worldserve.models.tinyworld.accel import ACCELS
from worldserve.models.tinyworld.adapter import TinyWorldModel
from worldserve.models.tinyworld.data import EVAL_FILLER, HELD_OUT_SEED, KEY_CHOICES, random_prompt
from worldserve.models.tinyworld.weights import DEFAULT_WEIGHTS, load_net, read_metadata
from worldserve.models.world import STYLES, Motion, World, camera_control, keys_control, velocity
from worldserve.protocol import ControlInput, TickRequest, parse_chunk_envelope

__all__ = ["EvalReport", "StyleClassifier", "evaluate", "main", "phase_shift"]

Frames = npt.NDArray[np.uint8]

#: PSNR of identical frames is infinite; both model and baseline are capped here.
PSNR_CAP = 50.0


def psnr(a: Frames, b: Frames) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return PSNR_CAP if mse == 0 else min(PSNR_CAP, 10.0 * math.log10(255.0**2 / mse))


_HANN: dict[tuple[int, int], npt.NDArray[np.float64]] = {}


def phase_shift(a: Frames, b: Frames, limit: int = 6) -> tuple[int, int]:
    """The view motion ``(dx, dy)`` from frame ``a`` to frame ``b`` by phase correlation.

    Content moves against the view: if ``b[y, x] == a[y + dy, x + dx]``, returns ``(dx, dy)``.
    Peaks are searched within ``limit`` px.
    """
    h, w = a.shape[:2]
    window = _HANN.get((h, w))
    if window is None:
        window = np.outer(np.hanning(h), np.hanning(w))
        _HANN[(h, w)] = window
    ga = a.astype(np.float64).mean(axis=-1)
    gb = b.astype(np.float64).mean(axis=-1)
    fa = np.fft.fft2((ga - ga.mean()) * window)
    fb = np.fft.fft2((gb - gb.mean()) * window)
    cross = fa * np.conj(fb)
    cross /= np.abs(cross) + 1e-9
    corr = np.real(np.fft.ifft2(cross))
    best = (0, 0)
    best_value = -np.inf
    for dy in range(-limit, limit + 1):
        for dx in range(-limit, limit + 1):
            value = corr[dy % h, dx % w]
            if value > best_value:
                best_value = value
                best = (dx, dy)
    return best


#: Soft colour histograms: 8 bins per channel, each pixel spread over bins by a Gaussian of this
#: width (levels), so a colour a few levels off does not jump to another bin (a hard bin edge
#: can sit 2 levels from a palette colour).
HISTOGRAM_BINS = 8
HISTOGRAM_SIGMA = 16.0
_CENTRES = (np.arange(HISTOGRAM_BINS) + 0.5) * (256.0 / HISTOGRAM_BINS)


def colour_histogram(frame: Frames) -> npt.NDArray[np.float64]:
    """Normalised soft joint RGB histogram, ``[bins ** 3]``."""
    values = frame.reshape(-1, 3).astype(np.float64)
    weights = np.exp(-0.5 * ((values[:, :, None] - _CENTRES[None, None, :]) / HISTOGRAM_SIGMA) ** 2)
    weights /= weights.sum(axis=2, keepdims=True)
    joint = np.einsum("pi,pj,pk->ijk", weights[:, 0], weights[:, 1], weights[:, 2], optimize=True)
    hist: npt.NDArray[np.float64] = joint.reshape(-1)
    return hist / float(hist.sum())


@dataclass(slots=True)
class StyleClassifier:
    """Nearest-centroid style classifier on colour histograms, fitted on true frames."""

    centroids: npt.NDArray[np.float64]  # [styles, bins^3]
    #: Per style, the 99th percentile of true frames' L1 distance to their centroid.
    ranges: npt.NDArray[np.float64]

    @classmethod
    def fit(cls, seeds: Sequence[int], views: int = 12, size: int = 48) -> StyleClassifier:
        rng = np.random.default_rng(7)
        hists: list[list[npt.NDArray[np.float64]]] = [[] for _ in STYLES]
        for seed in seeds:
            world = World(seed)
            for _ in range(views):
                x, y = (int(v) for v in rng.integers(-4000, 4000, size=2))
                for index, style in enumerate(STYLES):
                    hists[index].append(colour_histogram(world.render(x, y, size, size, style)))
        centroids = np.stack([np.mean(h, axis=0) for h in hists])
        ranges = np.array(
            [np.percentile([np.abs(h - centroids[i]).sum() for h in hists[i]], 99) for i in range(len(STYLES))]
        )
        return cls(centroids, ranges)

    def distances(self, frame: Frames) -> npt.NDArray[np.float64]:
        out: npt.NDArray[np.float64] = np.asarray(
            np.abs(self.centroids - colour_histogram(frame)[None]).sum(axis=1), dtype=np.float64
        )
        return out

    def predict(self, frame: Frames) -> str:
        return STYLES[int(np.argmin(self.distances(frame)))]

    def in_range(self, frame: Frames, style: str) -> bool:
        index = STYLES.index(style)
        return bool(self.distances(frame)[index] <= self.ranges[index])


def eval_controls(rng: np.random.Generator, moving_only: bool = False) -> tuple[ControlInput, ...]:
    """A control snapshot: one of the 8 key directions, a camera pan, or (unless ``moving_only``) none."""
    roll = rng.random()
    if not moving_only and roll < 0.25:
        return (keys_control(),)
    if roll < 0.7:
        return (keys_control(*KEY_CHOICES[int(rng.integers(len(KEY_CHOICES)))]),)
    while True:
        dx, dy = (float(v) for v in np.round(rng.uniform(-4.0, 4.0, size=2) * 2.0) / 2.0)
        if abs(dx) >= 1.0 or abs(dy) >= 1.0:
            return (camera_control(dx, dy),)


@dataclass(slots=True)
class Script:
    """One evaluation session: options and its ticks."""

    options: SessionOptions
    ticks: list[TickRequest]
    styles: list[str] = field(default_factory=list)


def _tick(session: str, index: int, prompt: str | None, controls: tuple[ControlInput, ...]) -> TickRequest:
    return TickRequest(session, f"{session}-{index}", index, (), prompt, tuple(sorted(controls, key=lambda c: c.track)))


def _run(model: TinyWorldModel | ProceduralModel, scripts: Sequence[Script], batch: int) -> list[list[Frames]]:
    """Free-run every script through ``model`` (batched); per script, its chunks ``[F, H, W, 3]``."""
    out: list[list[Frames]] = [[] for _ in scripts]
    for start in range(0, len(scripts), batch):
        group = list(range(start, min(len(scripts), start + batch)))
        states = [model.new_state(scripts[i].ticks[0].session_id, scripts[i].options) for i in group]
        for index in range(len(scripts[group[0]].ticks)):
            envelopes = model.step([(states[k], scripts[i].ticks[index]) for k, i in enumerate(group)])
            for k, i in enumerate(group):
                frames, _ = parse_chunk_envelope(envelopes[k])
                out[i].append(frames)
        for state in states:
            model.release(state)
    return out


@dataclass(slots=True)
class EvalReport:
    psnr_model: float = 0.0
    psnr_repeat: float = 0.0
    psnr_still: float = 0.0
    fidelity_chunks: int = 0
    action_moving: float = 0.0
    action_exact: float = 0.0
    action_still: float = 0.0
    action_frames: int = 0
    reference_action_moving: float = 0.0
    reference_action_still: float = 0.0
    prompt_accuracy: float = 0.0
    prompt_frames: int = 0
    reference_prompt_accuracy: float = 0.0
    drift_style: float = 0.0
    drift_range: float = 0.0
    drift_style_last: float = 0.0
    drift_range_last: float = 0.0
    drift_frames: int = 0
    reference_drift_style: float = 0.0
    reference_drift_range: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def passes(self) -> dict[str, bool]:
        return {
            "fidelity": self.psnr_model >= self.psnr_repeat + 3.0,
            "action": self.action_moving >= 0.9 and self.action_still >= 0.9,
            "prompt": self.prompt_accuracy >= 0.9,
            "drift": self.drift_style >= 0.9 and self.drift_range >= 0.9,
        }

    def table(self) -> str:
        ok = self.passes

        def mark(key: str) -> str:
            return "PASS" if ok[key] else "FAIL"

        rows = [
            ("bar", "measured (tinyworld)", "true frames", "target", ""),
            (
                "1. next-chunk PSNR, moving",
                f"{self.psnr_model:.2f} dB vs repeat-last {self.psnr_repeat:.2f} dB "
                f"({self.psnr_model - self.psnr_repeat:+.2f} dB; n={self.fidelity_chunks}; "
                f"still chunks {self.psnr_still:.1f} dB)",
                "-",
                ">= repeat-last + 3 dB",
                mark("fidelity"),
            ),
            (
                "2. action following, 64 chunks",
                f"moving {100 * self.action_moving:.1f}% (exact step {100 * self.action_exact:.1f}%), "
                f"still {100 * self.action_still:.1f}% (n={self.action_frames} frame pairs)",
                f"{100 * self.reference_action_moving:.1f}% / {100 * self.reference_action_still:.1f}%",
                ">= 90% / still",
                mark("action"),
            ),
            (
                "3. prompt following",
                f"{100 * self.prompt_accuracy:.1f}% of frames from the 2nd chunk after a switch "
                f"(n={self.prompt_frames})",
                f"{100 * self.reference_prompt_accuracy:.1f}%",
                ">= 90%",
                mark("prompt"),
            ),
            (
                "4. no drift, 300 chunks",
                f"style {100 * self.drift_style:.1f}%, histogram in range {100 * self.drift_range:.1f}% "
                f"(last 50 chunks: {100 * self.drift_style_last:.1f}% / {100 * self.drift_range_last:.1f}%; "
                f"n={self.drift_frames})",
                f"{100 * self.reference_drift_style:.1f}% / {100 * self.reference_drift_range:.1f}%",
                ">= 90% / >= 90%",
                mark("drift"),
            ),
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = []
        for index, row in enumerate(rows):
            lines.append("| " + " | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) + " |")
            if index == 0:
                lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(lines)


def _session_options(rng: np.random.Generator, seed: int, style: str) -> SessionOptions:
    return SessionOptions(prompt=random_prompt(rng, style, EVAL_FILLER), seed=seed)


def _free_running_scripts(
    rng: np.random.Generator,
    sessions: int,
    chunks: int,
    first_seed: int,
    name: str,
    every: int,
    start_moving: bool = False,
) -> list[Script]:
    """Sessions cycling through the styles, new controls every ``every`` chunks, no prompt changes.

    The first chunk's controls are drawn (moving only if ``start_moving``) and then redrawn at
    chunk 0, as the evaluation always did, so its random stream and results stay the same.
    """
    scripts = []
    for session in range(sessions):
        style = STYLES[session % len(STYLES)]
        options = _session_options(rng, first_seed + session, style)
        ticks = []
        controls = eval_controls(rng, moving_only=start_moving)
        for index in range(chunks):
            if index % every == 0:
                controls = eval_controls(rng)
            ticks.append(_tick(f"{name}{session}", index, None, controls))
        scripts.append(Script(options, ticks, [style]))
    return scripts


def fidelity(
    model: TinyWorldModel, truth: ProceduralModel, sessions: int, chunks: int, seed: int, report: EvalReport
) -> None:
    """Bar 1: teacher-forced next-chunk PSNR (moving chunks) vs repeat-last-frame."""
    rng = np.random.default_rng(seed)
    model_scores: list[float] = []
    repeat_scores: list[float] = []
    still_scores: list[float] = []
    for session in range(sessions):
        style = STYLES[session % len(STYLES)]
        options = _session_options(rng, HELD_OUT_SEED + seed + session, style)
        name = f"fid{session}"
        true_state = truth.new_state(name, options)
        state = model.new_state(name, options)
        last = truth.start_frame(true_state)
        controls = eval_controls(rng, moving_only=True)
        for index in range(chunks):
            if rng.random() < 0.5:
                controls = eval_controls(rng)
            tick = _tick(name, index, None, controls)
            true_frames, _ = parse_chunk_envelope(truth.step([(true_state, tick)])[0])
            if index >= 1:
                trial = state.copy()
                generated, _ = parse_chunk_envelope(model.step([(trial, tick)])[0])
                score = float(np.mean([psnr(g, t) for g, t in zip(generated, true_frames, strict=True)]))
                vx, vy = velocity(tick.controls)
                if vx == 0.0 and vy == 0.0:
                    still_scores.append(score)
                else:
                    model_scores.append(score)
                    repeat_scores.append(float(np.mean([psnr(last, t) for t in true_frames])))
            model.observe(state, tick, true_frames)
            last = true_frames[-1]
    report.psnr_model = float(np.mean(model_scores))
    report.psnr_repeat = float(np.mean(repeat_scores))
    report.psnr_still = float(np.mean(still_scores)) if still_scores else float("nan")
    report.fidelity_chunks = len(model_scores)


def _action_scores(
    runs: Sequence[Sequence[Frames]], scripts: Sequence[Script], starts: Sequence[Frames]
) -> tuple[float, float, float, int]:
    moving = exact = still = n_moving = n_still = 0
    for frames_by_chunk, script, start in zip(runs, scripts, starts, strict=True):
        motion = Motion()
        previous_frame = start
        previous_pos = motion.pixel
        for frames, tick in zip(frames_by_chunk, script.ticks, strict=True):
            vx, vy = velocity(tick.controls)
            positions = motion.advance(vx, vy, len(frames))
            for frame, pos in zip(frames, positions, strict=True):
                step = (pos[0] - previous_pos[0], pos[1] - previous_pos[1])
                dx, dy = phase_shift(previous_frame, frame)
                if step == (0, 0):
                    n_still += 1
                    still += int((dx, dy) == (0, 0))
                else:
                    n_moving += 1
                    moving += int(np.sign(dx) == np.sign(step[0]) and np.sign(dy) == np.sign(step[1]))
                    exact += int((dx, dy) == step)
                previous_frame = frame
                previous_pos = pos
    return moving / max(1, n_moving), exact / max(1, n_moving), still / max(1, n_still), n_moving + n_still


def action_following(
    model: TinyWorldModel, truth: ProceduralModel, sessions: int, chunks: int, seed: int, batch: int, report: EvalReport
) -> list[list[Frames]]:
    """Bar 2: free-running; direction of motion between consecutive generated frames."""
    rng = np.random.default_rng(seed)
    scripts = _free_running_scripts(rng, sessions, chunks, HELD_OUT_SEED + 10_000 + seed, "act", every=4)
    runs = _run(model, scripts, batch)
    starts = [model.start_frame(s.options) for s in scripts]
    report.action_moving, report.action_exact, report.action_still, report.action_frames = _action_scores(
        runs, scripts, starts
    )
    true_runs = _run(truth, scripts, batch)
    report.reference_action_moving, _, report.reference_action_still, _ = _action_scores(true_runs, scripts, starts)
    return runs


def prompt_following(
    model: TinyWorldModel,
    truth: ProceduralModel,
    classifier: StyleClassifier,
    before: int,
    after: int,
    seed: int,
    batch: int,
    report: EvalReport,
) -> list[list[Frames]]:
    """Bar 3: every ordered pair of styles, a switch after ``before`` chunks."""
    rng = np.random.default_rng(seed)
    scripts: list[Script] = []
    for a in STYLES:
        for b in STYLES:
            if a == b:
                continue
            options = _session_options(rng, HELD_OUT_SEED + 20_000 + seed + len(scripts), a)
            new_prompt = random_prompt(rng, b, EVAL_FILLER)
            ticks = []
            controls = eval_controls(rng, moving_only=True)
            for index in range(before + after):
                if index % 4 == 0:
                    controls = eval_controls(rng)
                ticks.append(_tick(f"sw{len(scripts)}", index, new_prompt if index >= before else None, controls))
            scripts.append(Script(options, ticks, [b]))

    def score(runs: list[list[Frames]]) -> tuple[float, int]:
        hits = total = 0
        for frames_by_chunk, script in zip(runs, scripts, strict=True):
            for frames in frames_by_chunk[before + 1 :]:
                for frame in frames:
                    hits += int(classifier.predict(frame) == script.styles[0])
                    total += 1
        return hits / max(1, total), total

    runs = _run(model, scripts, batch)
    report.prompt_accuracy, report.prompt_frames = score(runs)
    report.reference_prompt_accuracy, _ = score(_run(truth, scripts, batch))
    return runs


def drift(
    model: TinyWorldModel,
    truth: ProceduralModel,
    classifier: StyleClassifier,
    sessions: int,
    chunks: int,
    seed: int,
    batch: int,
    report: EvalReport,
) -> list[list[Frames]]:
    """Bar 4: long free-running rollouts keep their style and a plausible colour histogram."""
    rng = np.random.default_rng(seed)
    scripts = _free_running_scripts(
        rng, sessions, chunks, HELD_OUT_SEED + 30_000 + seed, "dr", every=6, start_moving=True
    )

    def score(runs: list[list[Frames]], last: int | None = None) -> tuple[float, float, int]:
        style_hits = range_hits = total = 0
        for frames_by_chunk, script in zip(runs, scripts, strict=True):
            chosen = frames_by_chunk if last is None else frames_by_chunk[-last:]
            for frames in chosen:
                for frame in frames:
                    style_hits += int(classifier.predict(frame) == script.styles[0])
                    range_hits += int(classifier.in_range(frame, script.styles[0]))
                    total += 1
        return style_hits / max(1, total), range_hits / max(1, total), total

    runs = _run(model, scripts, batch)
    report.drift_style, report.drift_range, report.drift_frames = score(runs)
    report.drift_style_last, report.drift_range_last, _ = score(runs, last=50)
    true_runs = _run(truth, scripts, batch)
    report.reference_drift_style, report.reference_drift_range, _ = score(true_runs)
    return runs


def write_png(path: Path, image: Frames) -> None:
    """A minimal RGB PNG writer (no imaging dependency)."""
    h, w = image.shape[:2]
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
    )


def strip(chunks: Sequence[Frames], every: int = 1, limit: int = 16, scale: int = 2) -> Frames:
    """The last frame of every ``every``-th chunk side by side (at most ``limit``), upscaled."""
    frames = [c[-1] for c in chunks[::every]][:limit]
    row = np.concatenate([np.pad(f, ((1, 1), (1, 1), (0, 0)), constant_values=255) for f in frames], axis=1)
    return np.repeat(np.repeat(row, scale, axis=0), scale, axis=1)


def evaluate(
    model: TinyWorldModel,
    *,
    quick: bool = False,
    seed: int = 0,
    batch: int = 8,
    strips: Path | None = None,
    log: Callable[[str], None] = print,
) -> EvalReport:
    started = time.monotonic()
    report = EvalReport()
    h, w = model.spec.height, model.spec.width
    truth = ProceduralModel(height=h, width=w, frames_per_chunk=model.spec.frames_per_chunk)
    classifier = StyleClassifier.fit(range(1000, 1000 + (8 if quick else 24)), size=h)
    log("fidelity ...")
    fidelity(model, truth, 8 if quick else 32, 5 if quick else 7, seed, report)
    log(f"  {report.psnr_model:.2f} dB vs {report.psnr_repeat:.2f} dB")
    log("action following ...")
    action_runs = action_following(model, truth, 4 if quick else 16, 16 if quick else 64, seed, batch, report)
    log(f"  moving {report.action_moving:.3f} still {report.action_still:.3f}")
    log("prompt following ...")
    prompt_runs = prompt_following(model, truth, classifier, 3, 3 if quick else 8, seed, batch, report)
    log(f"  {report.prompt_accuracy:.3f}")
    log("drift ...")
    drift_runs = drift(model, truth, classifier, 4 if quick else 8, 40 if quick else 300, seed, batch, report)
    log(f"  {report.drift_style:.3f} {report.drift_range:.3f}")
    report.seconds = time.monotonic() - started
    if strips is not None:
        for i, run in enumerate(action_runs[:4]):
            write_png(strips / f"action{i}.png", strip(run))
        for i, run in enumerate(prompt_runs[:12:3]):
            write_png(strips / f"prompt{i}.png", strip(run))
        for i, run in enumerate(drift_runs[:4]):
            write_png(strips / f"drift{i}.png", strip(run, every=max(1, len(run) // 16)))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worldserve.models.tinyworld.eval", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--weights", type=Path, default=None, help=f"weights file (default: {DEFAULT_WEIGHTS})")
    parser.add_argument("--quick", action="store_true", help="a small, fast version (not the bars)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--strips", type=Path, default=None, help="write PNG strips of rollouts here")
    parser.add_argument(
        "--precision", choices=["auto", "bfloat16", "float32"], default="auto", help="as served (default: auto)"
    )
    parser.add_argument(
        "--accel", choices=["auto", *ACCELS], default="auto", help="serving path, as served (default: auto)"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    path = args.weights or DEFAULT_WEIGHTS
    model = TinyWorldModel(
        net=load_net(path), max_batch_size=max(16, args.batch), precision=args.precision, accel=args.accel
    )
    meta = read_metadata(path)
    report = evaluate(model, quick=args.quick, seed=args.seed, batch=args.batch, strips=args.strips)
    print()
    print(
        f"tinyworld eval: {path.name} (step {meta.get('step', '?')}, {meta.get('train_minutes', '?')} train min), "
        f"held-out seeds >= {HELD_OUT_SEED}, {model.precision}, accel={model.accel}, "
        f"{'quick' if args.quick else 'full'}, "
        f"{report.seconds:.0f} s"
    )
    print(report.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
