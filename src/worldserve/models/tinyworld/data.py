"""Training and evaluation data: rollouts of the procedural world under random controls and prompts.

Owns: :class:`CanvasBank` (big pre-rendered canvases per world seed and style: a view is
a crop, far cheaper than rendering each frame), random control tracks and prompts
(:func:`random_controls`, :func:`random_prompt`), :func:`chunk_controls` (the per-frame
whole-pixel displacement features the network is conditioned on, computed with the world's
own :class:`~worldserve.models.world.Motion`, exactly as the adapter does at serving time)
and :func:`make_batch` (sequences of keyframes and chunks in the network's layout).

Training seeds are ``< HELD_OUT_SEED``; evaluation uses seeds from ``HELD_OUT_SEED`` on.
Must not know: the network, sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from worldserve.models.tinyworld.config import TinyWorldConfig
from worldserve.models.tinyworld.text import tokenize_batch
from worldserve.models.world import (
    DEFAULT_STYLE,
    STYLE_WORDS,
    STYLES,
    Motion,
    World,
    camera_control,
    keys_control,
    style_for_prompt,
    velocity,
)
from worldserve.protocol import ControlInput

__all__ = [
    "EVAL_FILLER",
    "HELD_OUT_SEED",
    "TRAIN_FILLER",
    "Batch",
    "CanvasBank",
    "Rollout",
    "chunk_controls",
    "make_batch",
    "random_controls",
    "random_prompt",
    "sample_rollout",
]

#: World seeds from here on are never used for training.
HELD_OUT_SEED = 1_000_000

_STYLE_WORD_SET = {word for words in STYLE_WORDS.values() for word in words}

TRAIN_FILLER: tuple[str, ...] = tuple(
    word
    for word in [
        "a",
        "the",
        "of",
        "in",
        "at",
        "on",
        "with",
        "over",
        "under",
        "near",
        "far",
        "deep",
        "high",
        "low",
        "wide",
        "open",
        "quiet",
        "bright",
        "dark",
        "morning",
        "evening",
        "noon",
        "night",
        "sunny",
        "cloudy",
        "misty",
        "calm",
        "windy",
        "cold",
        "warm",
        "hot",
        "gentle",
        "rolling",
        "rocky",
        "hills",
        "valley",
        "river",
        "lake",
        "path",
        "road",
        "trail",
        "view",
        "camera",
        "fly",
        "walk",
        "explore",
        "scene",
        "world",
        "landscape",
        "top",
        "down",
        "aerial",
        "map",
        "small",
        "big",
        "vast",
        "tiny",
        "old",
        "new",
        "red",
        "blue",
        "golden",
        "silver",
        "soft",
        "land",
        "terrain",
        "place",
        "region",
        "area",
        "flight",
        "glide",
        "drone",
        "pixel",
        "art",
        "game",
        "level",
        "journey",
        "region",
        "wild",
        "lonely",
        "empty",
        "endless",
        "northern",
        "southern",
        "eastern",
        "western",
        "summer",
        "spring",
        "autumn",
        "day",
    ]
    if word not in _STYLE_WORD_SET
)

#: Words never seen in training prompts: the evaluation uses them to check that unknown words do no harm.
EVAL_FILLER: tuple[str, ...] = (
    "distant",
    "shimmering",
    "ancient",
    "peaceful",
    "hidden",
    "sprawling",
    "serene",
    "overhead",
    "panorama",
    "realm",
    "zxqv",
    "kingdom",
)

KEY_CHOICES: tuple[tuple[str, ...], ...] = (
    ("W",),
    ("S",),
    ("A",),
    ("D",),
    ("W", "A"),
    ("W", "D"),
    ("S", "A"),
    ("S", "D"),
)


def random_prompt(rng: np.random.Generator, style: str, filler: Sequence[str] = TRAIN_FILLER) -> str:
    """A prompt whose :func:`style_for_prompt` is ``style``: filler words and maybe gibberish around a style word."""
    words: list[str] = []
    for _ in range(int(rng.integers(0, 6))):
        if rng.random() < 0.2:
            length = int(rng.integers(3, 9))
            words.append("".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, size=length)))
        else:
            words.append(str(filler[int(rng.integers(len(filler)))]))
    words = [word for word in words if word not in _STYLE_WORD_SET]
    if style != DEFAULT_STYLE or rng.random() < 0.7:
        synonyms = STYLE_WORDS[style]
        word = synonyms[0] if rng.random() < 0.5 else synonyms[int(rng.integers(len(synonyms)))]
        words.insert(int(rng.integers(len(words) + 1)), word)
    prompt = " ".join(words)
    if style_for_prompt(prompt) != style:  # gibberish can never name a style; this is a guard
        prompt = STYLE_WORDS[style][0]
    return prompt


def random_controls(rng: np.random.Generator) -> tuple[ControlInput, ...]:
    """A random snapshot of the two control tracks (still, keys, camera pan, or both)."""
    roll = rng.random()
    controls: list[ControlInput] = []
    if roll < 0.2:
        if rng.random() < 0.5:
            controls.append(keys_control())
        return tuple(controls)
    if roll < 0.65 or roll >= 0.9:
        held = KEY_CHOICES[int(rng.integers(len(KEY_CHOICES)))]
        controls.append(keys_control(*held))
    if roll >= 0.65:
        dx, dy = (float(v) for v in np.round(rng.uniform(-4.0, 4.0, size=2) * 2.0) / 2.0)
        if rng.random() < 0.3:
            if rng.random() < 0.5:
                dx = 0.0
            else:
                dy = 0.0
        controls.append(camera_control(dx, dy))
    return tuple(sorted(controls, key=lambda control: control.track))


def chunk_controls(
    motion: Motion, vx: float, vy: float, frames: int
) -> tuple[npt.NDArray[np.float32], list[tuple[int, int]]]:
    """Advance ``motion`` one chunk; return its features ``[frames, 4]`` and the whole-pixel positions.

    Features per frame: the step from the previous frame (the chunk's first frame steps from
    the keyframe) and the cumulative displacement from the keyframe, in px.
    """
    start = motion.pixel
    positions = motion.advance(vx, vy, frames)
    features = np.zeros((frames, 4), dtype=np.float32)
    previous = start
    for index, (x, y) in enumerate(positions):
        features[index] = (x - previous[0], y - previous[1], x - start[0], y - start[1])
        previous = (x, y)
    return features, positions


class CanvasBank:
    """Pre-rendered square canvases, ``[seeds, styles, size, size, 3]``, centred on world (0, 0)."""

    def __init__(self, seeds: Sequence[int], size: int) -> None:
        self.size = size
        self.seeds = list(seeds)
        self.canvases = np.empty((len(self.seeds), len(STYLES), size, size, 3), dtype=np.uint8)
        for index, seed in enumerate(self.seeds):
            self.replace(index, seed)

    def replace(self, index: int, seed: int) -> None:
        world = World(seed)
        half = self.size // 2
        for style_index, style in enumerate(STYLES):
            self.canvases[index, style_index] = world.render(-half, -half, self.size, self.size, style)

    def crop(self, index: int, style: int, x: int, y: int, height: int, width: int) -> npt.NDArray[np.uint8]:
        half = self.size // 2
        out: npt.NDArray[np.uint8] = self.canvases[
            index, style, y + half : y + half + height, x + half : x + half + width
        ]
        return out


@dataclass(slots=True)
class Rollout:
    """One true rollout: keyframes ``0..N-1`` and chunks ``1..N`` with their conditioning."""

    keyframes: npt.NDArray[np.uint8]  # [N, H, W, 3]
    keyframe_controls: npt.NDArray[np.float32]  # [N, 4]
    keyframe_prompts: list[str]
    chunks: npt.NDArray[np.uint8]  # [N, F, H, W, 3]
    chunk_controls: npt.NDArray[np.float32]  # [N, F, 4]
    chunk_prompts: list[str]
    chunk_styles: list[str]
    chunk_velocities: list[tuple[float, float]]


def sample_rollout(
    rng: np.random.Generator,
    bank: CanvasBank,
    chunks: int,
    config: TinyWorldConfig,
    switch_probability: float = 0.15,
    keep_probability: float = 0.6,
) -> Rollout:
    """A random rollout of ``chunks`` chunks in a random world of the bank."""
    f, h, w = config.frames_per_chunk, config.height, config.width
    world_index = int(rng.integers(len(bank.seeds)))
    style = STYLES[int(rng.integers(len(STYLES)))]
    start_prompt = random_prompt(rng, style)
    motion = Motion(float(rng.uniform(-0.5, 0.5)), float(rng.uniform(-0.5, 0.5)))
    features: list[npt.NDArray[np.float32]] = []
    positions: list[list[tuple[int, int]]] = []
    prompts: list[str] = []
    styles: list[str] = []
    velocities: list[tuple[float, float]] = []
    controls = random_controls(rng)
    prompt = start_prompt
    for _ in range(chunks):
        if rng.random() >= keep_probability:
            controls = random_controls(rng)
        if rng.random() < switch_probability:
            style = STYLES[(STYLES.index(style) + int(rng.integers(1, len(STYLES)))) % len(STYLES)]
            prompt = random_prompt(rng, style)
        elif rng.random() < 0.2:
            prompt = random_prompt(rng, style)
        vx, vy = velocity(controls)
        feature, chunk_positions = chunk_controls(motion, vx, vy, f)
        features.append(feature)
        positions.append(chunk_positions)
        prompts.append(prompt)
        styles.append(style)
        velocities.append((vx, vy))
    start = (0, 0)
    every = [start, *(p for chunk in positions for p in chunk)]
    xs = [p[0] for p in every]
    ys = [p[1] for p in every]
    half = bank.size // 2
    ox = int(rng.integers(-half - min(xs), half - w - max(xs) + 1))
    oy = int(rng.integers(-half - min(ys), half - h - max(ys) + 1))
    start_style = STYLES.index(style_for_prompt(start_prompt))
    keyframes = np.empty((chunks, h, w, 3), dtype=np.uint8)
    keyframes[0] = bank.crop(world_index, start_style, ox, oy, h, w)
    frames = np.empty((chunks, f, h, w, 3), dtype=np.uint8)
    for n in range(chunks):
        style_index = STYLES.index(styles[n])
        for i, (x, y) in enumerate(positions[n]):
            frames[n, i] = bank.crop(world_index, style_index, ox + x, oy + y, h, w)
        if n + 1 < chunks:
            keyframes[n + 1] = frames[n, -1]
    keyframe_controls = np.zeros((chunks, 4), dtype=np.float32)
    for n in range(1, chunks):
        keyframe_controls[n] = features[n - 1][-1]
    return Rollout(
        keyframes=keyframes,
        keyframe_controls=keyframe_controls,
        keyframe_prompts=[start_prompt, *prompts[:-1]],
        chunks=frames,
        chunk_controls=np.stack(features),
        chunk_prompts=prompts,
        chunk_styles=styles,
        chunk_velocities=velocities,
    )


@dataclass(slots=True)
class Batch:
    """A batch in the network's full-sequence layout (pixels in ``[-1, 1]``)."""

    keyframes: Tensor  # [B, N, 3, H, W]
    keyframe_text: Tensor  # [B, N, words]
    keyframe_controls: Tensor  # [B, N, 4]
    chunks: Tensor  # [B, N, F, 3, H, W]
    chunk_text: Tensor  # [B, N, words]
    chunk_controls: Tensor  # [B, N, F, 4]


def _pixels(frames: npt.NDArray[np.uint8]) -> Tensor:
    return torch.from_numpy(frames).float().movedim(-1, -3) / 127.5 - 1.0


def make_batch(
    rng: np.random.Generator, bank: CanvasBank, batch: int, chunks: int, config: TinyWorldConfig, **options: Any
) -> Batch:
    """``batch`` random rollouts stacked into a :class:`Batch`."""
    rollouts = [sample_rollout(rng, bank, chunks, config, **options) for _ in range(batch)]
    words = config.max_words

    def text(prompts: list[str]) -> Tensor:
        return tokenize_batch(prompts, config.text_buckets, words)

    return Batch(
        keyframes=_pixels(np.stack([r.keyframes for r in rollouts])),
        keyframe_text=torch.stack([text(r.keyframe_prompts) for r in rollouts]),
        keyframe_controls=torch.from_numpy(np.stack([r.keyframe_controls for r in rollouts])),
        chunks=_pixels(np.stack([r.chunks for r in rollouts])),
        chunk_text=torch.stack([text(r.chunk_prompts) for r in rollouts]),
        chunk_controls=torch.from_numpy(np.stack([r.chunk_controls for r in rollouts])),
    )
