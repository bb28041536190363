"""The ``tinyworld`` model behind the runtime's :class:`~worldserve.models.base.WorldModel` interface.

Owns: :class:`TinyWorldModel` and :class:`TinyWorldState`. A session's state is its KV
cache (sink + sliding window of keyframes, fixed size), its last keyframe (pixels, for the
motion path), the view's :class:`~worldserve.models.world.Motion` (to turn each tick's
controls into the exact per-frame whole-pixel displacements the network is conditioned on)
and its own noise generator (seeded by ``SessionOptions.seed``, so a session's frames do
not depend on which sessions share its batch). :meth:`TinyWorldModel.step` runs one
batched few-step denoise over every session of the batch, then one batched cache pass.

A session starts from the start image if one is given, else from the world's first frame
for its seed and prompt (an image-to-world start). A step changes a state in few places
(one cache slot, the keyframe, the motion, the generator), so :meth:`TinyWorldModel.snapshot`
keeps just those and :meth:`TinyWorldModel.restore` puts them back: a chunk in flight can
be cancelled without copying the whole cache. Must not know: sessions' control
plane, engines, transports.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from worldserve.models.base import ModelSpec, SessionOptions
from worldserve.models.precision import native_low_precision, served_precision, usable_device
from worldserve.models.tinyworld.accel import ACCELS, DEFAULT_ACCEL, FastSampler
from worldserve.models.tinyworld.cache import KVCache
from worldserve.models.tinyworld.data import chunk_controls
from worldserve.models.tinyworld.network import TinyWorldNet
from worldserve.models.tinyworld.sampler import chunk_noise, encode_keyframes, sample_chunk, to_pixels, to_uint8
from worldserve.models.tinyworld.text import tokenize_batch
from worldserve.models.tinyworld.weights import load_net, weights_version
from worldserve.models.world import (
    CONTINUOUS_TRACKS,
    CONTROL_SCHEMAS,
    DEFAULT_STYLE,
    STYLES,
    Motion,
    World,
    style_for_prompt,
    velocity,
)
from worldserve.protocol import ChunkMetadata, TickRequest, build_chunk_envelope

__all__ = ["TinyWorldModel", "TinyWorldState", "TinyWorldUndo"]


class TinyWorldState:
    """One session: KV cache, last keyframe, view motion, noise generator."""

    __slots__ = ("cache", "generator", "keyframe", "motion", "options", "session_id")

    def __init__(self, session_id: str, options: SessionOptions, cache: KVCache, keyframe: Tensor) -> None:
        self.session_id = session_id
        self.options = options
        self.cache = cache
        self.keyframe = keyframe
        self.motion = Motion()
        self.generator = torch.Generator().manual_seed(options.seed)

    def copy(self) -> TinyWorldState:
        """An independent copy (cache, motion and noise generator included)."""
        twin = TinyWorldState(self.session_id, self.options, self.cache.clone(), self.keyframe.clone())
        twin.motion = Motion(self.motion.x, self.motion.y)
        twin.generator.set_state(self.generator.get_state())
        return twin


class TinyWorldUndo:
    """What one step changes in a :class:`TinyWorldState`, as it was before the step."""

    __slots__ = ("generator", "keyframe", "keys", "motion", "valid", "values", "written")

    def __init__(self, state: TinyWorldState) -> None:
        cache = state.cache
        rows = _slot_rows(cache)
        self.written = cache.written
        self.keys = cache.keys[:, rows].clone()
        self.values = cache.values[:, rows].clone()
        self.valid = cache.valid[rows].clone()
        self.keyframe = state.keyframe  # a step rebinds it, never writes into it
        self.motion = Motion(state.motion.x, state.motion.y)
        self.generator = state.generator.get_state()

    def restore(self, state: TinyWorldState) -> None:
        cache = state.cache
        cache.written = self.written
        rows = _slot_rows(cache)
        cache.keys[:, rows] = self.keys
        cache.values[:, rows] = self.values
        cache.valid[rows] = self.valid
        state.keyframe = self.keyframe
        state.motion = Motion(self.motion.x, self.motion.y)
        state.generator.set_state(self.generator)


def _slot_rows(cache: KVCache) -> slice:
    """The cache rows the next keyframe write goes to (the only ones a step writes)."""
    slot = cache.slot_of(cache.written)
    return slice(slot * cache.tokens_per_frame, (slot + 1) * cache.tokens_per_frame)


class TinyWorldModel:
    """The trained tinyworld network as a :class:`~worldserve.models.base.WorldModel`."""

    def __init__(
        self,
        *,
        weights: str | Path | None = None,
        max_batch_size: int = 16,
        threads: int | None = None,
        device: str = "cpu",
        precision: str = "auto",
        accel: str = "auto",
        steps: str | Sequence[float] | None = None,
        net: TinyWorldNet | None = None,
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        #: Where the network and every session's cache live ("cpu", "cuda", "cuda:1", ...).
        #: Noise is drawn on the CPU from each session's own generator, so a session's frames
        #: do not depend on the device beyond float rounding.
        self.device = usable_device(device, "tinyworld")
        self.net = net if net is not None else load_net(None if weights is None else Path(weights))
        version = "custom" if net is not None else weights_version(None if weights is None else Path(weights))
        if steps is not None:  # a subset of the trained noise levels: fewer denoising steps per chunk
            self.net.config = replace(self.net.config, steps=_sampler_steps(steps, self.net.config.steps))
            version = f"{version} steps={','.join(f'{t:g}' for t in self.net.config.steps)}"
        self.net.to(self.device)
        self.net.eval()
        #: bfloat16 autocast (weights and cache stay float32): on a GPU, or a CPU with native
        #: bf16 (AVX512-BF16 / AMX), it is much faster at batch > 1; elsewhere float32 (also when
        #: bfloat16 is asked: emulated, it is several times slower; the spec's note says so).
        if precision not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"precision must be auto, bfloat16 or float32; got {precision!r}.")
        if precision == "auto":
            precision = "bfloat16" if native_low_precision(self.device, "bfloat16") else "float32"
        precision, precision_note = served_precision(precision, self.device, "tinyworld")
        self.precision = precision
        #: The float32/bfloat16 serving path (:mod:`~.accel`): "none" is the reference path.
        if accel not in ("auto", *ACCELS):
            raise ValueError(f"accel must be auto, {', '.join(ACCELS)}; got {accel!r}.")
        self.accel = DEFAULT_ACCEL if accel == "auto" else accel
        self._fast = None if self.accel == "none" else FastSampler(self.net, compile=self.accel == "compile")
        config = self.net.config
        self.config = config
        state_bytes = config.cache_bytes() + 3 * config.height * config.width * 4 + 1024
        self._spec = ModelSpec(
            name="tinyworld",
            frames_per_chunk=config.frames_per_chunk,
            fps=config.fps,
            height=config.height,
            width=config.width,
            controls=CONTROL_SCHEMAS,
            max_batch_size=max_batch_size,
            state_bytes=state_bytes,
            styles=STYLES,
            default_prompt=DEFAULT_STYLE,
            continuous_tracks=CONTINUOUS_TRACKS,
            can_rollback=True,
            description=(
                "Trained block-causal diffusion transformer with a KV cache (attention sink + sliding window), "
                f"{len(config.steps)}-step sampler; learns the procedural world."
            ),
            version=version,
            precision=precision,
            notes=() if precision_note is None else (precision_note,),
        )
        #: Seconds the constructor spent warming the serving path up (compiling), 0.0 if none.
        self.warmup_seconds = 0.0
        if self._fast is not None and self._fast.compiled:
            self.warmup_seconds = self._warm_up()

    def _warm_up(self) -> float:
        """Compile before the first session arrives: steps at batch 1 and at batch 2 (the batch
        dimension is dynamic from 2 on; 1 is its own graph), with the cache still filling (a
        mask) and full (none), so each graph serving meets is built. Returns the seconds it took."""
        started = time.perf_counter()
        options = SessionOptions(seed=0)
        for size in (1, 2):
            states = [self.new_state(f"warmup{i}", options) for i in range(size)]
            for index in range(self.config.cache_slots):
                ticks = [TickRequest(f"warmup{i}", f"warmup{index}", index, (), None, ()) for i in range(size)]
                self.step(list(zip(states, ticks, strict=True)))
            for state in states:
                self.release(state)
        return time.perf_counter() - started

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def _text(self, prompts: Sequence[str | None]) -> Tensor:
        return tokenize_batch(prompts, self.config.text_buckets, self.config.max_words).to(self.device)

    def start_frame(self, options: SessionOptions) -> npt.NDArray[np.uint8]:
        """The frame a session starts from: the start image, else the world's first frame."""
        h, w = self.config.height, self.config.width
        if options.image is not None:
            return np.frombuffer(options.image, dtype=np.uint8).reshape(h, w, 3).copy()
        return World(options.seed).render(0, 0, h, w, style_for_prompt(options.prompt))

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bfloat16")

    def _encode_keyframes(self, caches: list[KVCache], frames: Tensor, text: Tensor, controls: Tensor) -> None:
        """The cache pass, on this model's serving path."""
        with self._autocast():
            if self._fast is None:
                encode_keyframes(self.net, caches, frames, text, controls)
            else:
                self._fast.encode_keyframes(caches, frames, text, controls)

    def new_state(self, session_id: str, options: SessionOptions) -> TinyWorldState:
        options.check_image(self._spec)
        frame = to_pixels(self.start_frame(options)).to(self.device)
        cache = KVCache(self.config, self.device)
        zeros = torch.zeros(1, 4, device=self.device)
        self._encode_keyframes([cache], frame[None], self._text([options.prompt]), zeros)
        return TinyWorldState(session_id, options, cache, frame)

    def _prepare(self, batch: Sequence[tuple[Any, TickRequest]]) -> tuple[list[TinyWorldState], Tensor, Tensor]:
        states: list[TinyWorldState] = []
        features: list[npt.NDArray[np.float32]] = []
        prompts: list[str | None] = []
        for state, tick in batch:
            if not isinstance(state, TinyWorldState):
                raise TypeError(f"tinyworld got a foreign state: {type(state).__name__}")
            vx, vy = velocity(tick.controls)
            feature, _ = chunk_controls(state.motion, vx, vy, self.config.frames_per_chunk)
            states.append(state)
            features.append(feature)
            prompts.append(tick.prompt if tick.prompt is not None else state.options.prompt)
        return states, torch.from_numpy(np.stack(features)).to(self.device), self._text(prompts)

    @torch.no_grad()
    def step(self, batch: Sequence[tuple[Any, TickRequest]]) -> list[dict[str, Any]]:
        if not batch:
            return []
        if len(batch) > self._spec.max_batch_size:
            raise ValueError(f"batch of {len(batch)} exceeds max_batch_size {self._spec.max_batch_size}")
        states, controls, text = self._prepare(batch)
        config = self.config
        shape = (config.frames_per_chunk, 3, config.height, config.width)
        noise = torch.stack([chunk_noise(state.generator, len(config.steps), shape) for state in states], dim=1)
        noise = noise.to(self.device)
        keyframes = torch.stack([state.keyframe for state in states])
        caches = [state.cache for state in states]
        with self._autocast():
            if self._fast is None:
                x0 = sample_chunk(self.net, caches, noise, text, controls, keyframes)
            else:
                x0 = self._fast.sample_chunk(caches, noise, text, controls, keyframes)
        frames = to_uint8(x0)  # [B, F, H, W, 3]
        last = to_pixels(frames[:, -1]).to(self.device)
        self._encode_keyframes(caches, last, text, controls[:, -1])
        outputs = []
        for row, (state, (_, tick)) in enumerate(zip(states, batch, strict=True)):
            state.keyframe = last[row]
            outputs.append(build_chunk_envelope(frames[row], ChunkMetadata.from_tick(tick)))
        return outputs

    @torch.no_grad()
    def observe(self, state: TinyWorldState, tick: TickRequest, frames: npt.NDArray[np.uint8]) -> None:
        """Teacher forcing: append a true chunk (``uint8 [F, H, W, 3]``, made under ``tick``) to the context."""
        _, controls, text = self._prepare([(state, tick)])
        last = to_pixels(frames[-1]).to(self.device)
        self._encode_keyframes([state.cache], last[None], text, controls[:, -1])
        state.keyframe = last

    def snapshot(self, state: Any) -> TinyWorldUndo:
        """What the next step of ``state`` will change, as it is now (one cache slot, not the cache)."""
        if not isinstance(state, TinyWorldState):
            raise TypeError(f"tinyworld got a foreign state: {type(state).__name__}")
        return TinyWorldUndo(state)

    def restore(self, state: Any, snapshot: Any) -> TinyWorldState:
        """Undo the step taken since ``snapshot``: the state is as it was before it."""
        if not isinstance(state, TinyWorldState) or not isinstance(snapshot, TinyWorldUndo):
            raise TypeError("tinyworld got a foreign state or snapshot.")
        snapshot.restore(state)
        return state

    def release(self, state: Any) -> None:
        if isinstance(state, TinyWorldState):
            state.cache.clear()


def _sampler_steps(steps: str | Sequence[float], trained: tuple[float, ...]) -> tuple[float, ...]:
    """Parse and check a sampler schedule: trained noise levels, descending, starting at the first."""
    try:
        levels = tuple(float(t) for t in (steps.split(",") if isinstance(steps, str) else steps))
    except ValueError:
        levels = ()
    if (
        not levels
        or any(t not in trained for t in levels)
        or levels[0] != trained[0]
        or list(levels) != sorted(set(levels), reverse=True)
    ):
        raise ValueError(
            f"steps must be noise levels the network was trained on ({', '.join(f'{t:g}' for t in trained)}), "
            f"descending from {trained[0]:g}, e.g. '1,0.25'; got {steps!r}."
        )
    return levels
