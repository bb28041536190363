"""The ``wan-causal`` model behind the runtime's :class:`~worldserve.models.base.WorldModel` interface.

Owns: :class:`WanCausalModel` and :class:`WanCausalState`. A session's state is its KV
cache (sink + sliding window) and the clean latents of the blocks in it, its decoder state (the
VAE's feature cache, or TAEHV's last frames with ``decoder=taehv``: :mod:`~worldserve.models.wan.decoders`),
its noise counter (the session's noise is a pure function of ``SessionOptions.seed`` and the
counter, drawn for the whole batch at once) and its prompt. A session is *primed* at
creation: its start frame (the start image, else the procedural world's first frame for
its seed and prompt) held still for one block's worth of video is encoded by the VAE,
committed to the cache as the attention sink and run through the frame decoder, so every chunk
it then emits has the same ``4 * block_frames`` frames. :meth:`WanCausalModel.step` runs
ONE batched few-step denoise over every session of the batch (each at its own frame
offset), one batched commit pass and one batched streaming decode; frames leave the
device once per batch. A step that raises leaves every state unchanged (``atomic_step``).
Must not know: sessions' control plane, engines, transports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worldserve.models.base import ModelSpec, PartSink, SessionOptions
from worldserve.models.wan.cache import BatchKV, BlockLog, KVCache
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.decoders import choose_decoder
from worldserve.models.wan.noise import SessionNoise
from worldserve.models.wan.options import (
    FLOAT32_PARTS,
    option_bool,
    option_int,
    option_path,
)
from worldserve.models.wan.rope import FrameRope
from worldserve.models.wan.sampler import commit_block, recache_context, sample_block
from worldserve.models.wan.serving import FrameDecoding, Serving, batch_states, decode_to_host
from worldserve.models.wan.text import PromptEmbedder
from worldserve.models.wan.vae import DecoderCache, frame_pixels
from worldserve.models.wancausal.actions import ACTION_DIM, action_features
from worldserve.models.wancausal.families import family_config
from worldserve.models.wancausal.forward import CachedForward
from worldserve.models.wancausal.prompts import MAX_TRANSITION, PromptPlan, PromptTrack, transition_schema
from worldserve.models.wancausal.weights import WeightOptions, load_weights
from worldserve.models.world import CONTROL_SCHEMAS, DEFAULT_STYLE, STYLES, World, style_for_prompt
from worldserve.protocol import ChunkMetadata, TickRequest, build_chunk_envelope

__all__ = ["WanCausalModel", "WanCausalState"]

_MODEL = "wan-causal"


class WanCausalState:
    """One session: KV cache and the blocks it holds, decoder state, noise counter, prompt, options."""

    __slots__ = ("cache", "decoder", "draws", "log", "options", "prompt", "session_id")

    def __init__(
        self,
        session_id: str,
        options: SessionOptions,
        cache: KVCache,
        decoder: DecoderCache,
        prompt: PromptTrack,
        log: BlockLog,
    ) -> None:
        self.session_id = session_id
        self.options = options
        self.cache = cache
        self.decoder = decoder
        #: Noise draws so far: the counter of the session's noise (seeded by ``options.seed``).
        self.draws = 0
        self.prompt = prompt
        self.log = log


class WanCausalModel:
    """A block-causal Wan2.1-class video diffusion transformer as a world model.

    Options (all strings from ``--model-option`` work): ``weights`` (a folder of downloads: the
    parts are found by their published names), ``checkpoint``, ``vae``, ``text_encoder``,
    ``tokenizer``, ``lora`` (each part's file or folder, overriding ``weights``), ``config``
    (``tiny``, ``1.3b``, ``14b``; by default the one the checkpoint's shapes name), ``load=dummy``
    (random weights; the default only for ``tiny``), ``text=hashed`` / ``vae=random`` (run a
    trained checkpoint without its text encoder / VAE), ``ema`` (1: a training checkpoint's EMA
    weights), ``lora_alpha``, ``device``, ``dtype`` (``auto``: bfloat16 on CUDA, else float32),
    ``window`` (latent frames of the sliding window), ``max_batch_size``, ``seed`` (of dummy
    weights), ``threads``; ``family`` (``self-forcing``, ``causvid``, ``longlive``, ``krea``,
    ``wan``: the authors' schedule, context and prompt-switch rule; by default the one the
    checkpoint's published name implies), ``sink`` (latent frames kept from the start),
    ``steps`` (a uniform schedule of that many steps instead of the family's), ``prompt_switch``
    (``keep``, or ``recache``: recompute the cached context under a changed prompt),
    ``prompt_transition`` (blocks a prompt change blends over unless its event says otherwise),
    ``recache_sink`` (1: a re-cache recomputes the sink too), ``compile`` (1: ``torch.compile``
    the transformer blocks), ``attention`` (``batched``, or ``loop``: the per-session reference),
    ``decoder`` (``vae``, the default, or ``taehv``: TAEHV's tiny decoder, cheaper, slightly lower
    quality), ``taehv`` (its ``taew2_1.pth``; ``weights=DIR``'s is found by name; ``random``: random weights).
    """

    def __init__(
        self,
        *,
        config: str | WanCausalConfig | None = None,
        weights: str | Path | None = None,
        checkpoint: str | Path | None = None,
        load: str | None = None,
        vae: str | Path | None = None,
        text_encoder: str | Path | None = None,
        tokenizer: str | Path | None = None,
        text: str | None = None,
        lora: str | Path | None = None,
        lora_alpha: float | str | None = None,
        ema: int | str | bool | None = None,
        family: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        window: int | str | None = None,
        sink: int | str | None = None,
        steps: int | str | None = None,
        prompt_switch: str | None = None,
        prompt_transition: int | str | None = None,
        recache_sink: int | str | bool | None = None,
        compile: int | str | bool | None = None,
        attention: str = "batched",
        max_batch_size: int | str = 8,
        seed: int | str = 0,
        threads: int | str | None = None,
        decoder: str | None = None,
        taehv: str | Path | None = None,
    ) -> None:
        serving = self.serving = Serving.read(
            _MODEL, device=device, dtype=dtype, threads=threads, seed=seed, max_batch_size=max_batch_size
        )
        self.device, self.dtype = serving.device, serving.dtype
        options = WeightOptions(
            config=config,
            weights=option_path(weights),
            checkpoint=option_path(checkpoint),
            vae=option_path(vae),
            text_encoder=option_path(text_encoder),
            tokenizer=option_path(tokenizer),
            lora=option_path(lora),
            lora_alpha=float(lora_alpha) if lora_alpha is not None else None,
            load=load,
            text=text,
            ema=option_bool(ema, _MODEL, "ema"),
            family=family,
        )
        taehv_path = option_path(taehv)
        choose_decoder(decoder, taehv_path, options.weights, trained=False, model=_MODEL)  # refused before loading
        loaded = load_weights(options, self.device, serving.seed, self.dtype)
        self.decoder_choice = choose_decoder(
            decoder, taehv_path, options.weights, trained=not loaded.dummy, model=_MODEL
        )
        self.family = loaded.family
        cfg = family_config(loaded.config, loaded.family, option_int(steps, _MODEL, "steps"))
        window_frames = option_int(window, _MODEL, "window")
        if window_frames is not None:
            cfg = cfg.with_window(window_frames)
        sink_frames = option_int(sink, _MODEL, "sink")
        if sink_frames is not None:
            cfg = replace(cfg, sink_frames=sink_frames)
        self.prompt_switch = prompt_switch if prompt_switch is not None else self.family.prompt_switch
        if self.prompt_switch not in ("keep", "recache"):
            raise ValueError(f"wan-causal option prompt_switch must be keep or recache; got {prompt_switch!r}.")
        transition = option_int(prompt_transition, _MODEL, "prompt_transition")
        self.prompt_transition = transition if transition is not None else self.family.prompt_transition
        if not 0 <= self.prompt_transition <= MAX_TRANSITION:
            raise ValueError(f"wan-causal option prompt_transition must be in [0, {MAX_TRANSITION}].")
        keep_sink = option_bool(recache_sink, _MODEL, "recache_sink")
        self.recache_sink = keep_sink if keep_sink is not None else self.family.recache_sink
        if self.prompt_switch == "recache" and not self.recache_sink and cfg.sink_frames % cfg.block_frames:
            raise ValueError("recache_sink=0 keeps the sink's blocks as they are: the sink must be whole blocks.")
        if cfg.action_dim != ACTION_DIM:
            raise ValueError(f"config action_dim {cfg.action_dim} != {ACTION_DIM} action features.")
        self.config = cfg
        self.weights = loaded
        self.dummy = loaded.dummy
        self.action_from_checkpoint = loaded.action_from_checkpoint
        self.vae_from_file = loaded.vae_from_file
        transformer, actions, autoencoder = loaded.transformer, loaded.actions, loaded.vae
        serving.prepare(transformer, FLOAT32_PARTS)
        serving.prepare(actions)
        serving.prepare(autoencoder)
        self.forward = CachedForward(
            transformer, actions, cfg, attention=attention, compile=bool(option_bool(compile, _MODEL, "compile"))
        )
        frames = FrameDecoding.build(self.decoder_choice, autoencoder, cfg, serving)
        self.vae = frames.vae  # the start frame's encoder, and the decoder unless decoder=taehv
        self.decoder = frames.decoder
        self.decoder_cache_bytes = frames.cache_bytes
        self.rope = FrameRope(cfg, self.device)
        self.text = PromptEmbedder(
            cfg.text_len, cfg.text_dim, self.device, self.dtype, loaded.text_encoder, loaded.tokenizer
        )
        latents_per_block = cfg.latent_channels * cfg.block_frames * cfg.latent_height * cfg.latent_width
        log_bytes = BlockLog.max_blocks(cfg) * 4 * (latents_per_block + cfg.block_frames * cfg.action_dim)
        state_bytes = cfg.kv_bytes(serving.dtype_bytes) + self.decoder_cache_bytes + log_bytes + 4096
        self._spec = ModelSpec(
            name="wan-causal",
            frames_per_chunk=cfg.video_frames_per_block,
            fps=cfg.fps,
            height=cfg.height,
            width=cfg.width,
            controls=(*CONTROL_SCHEMAS, transition_schema(self.prompt_transition)),
            max_batch_size=serving.max_batch_size,
            state_bytes=state_bytes,
            styles=STYLES,
            default_prompt=DEFAULT_STYLE,
            description=self._describe(),
            atomic_step=True,
            frame_parts=True,
            version=loaded.version,
            precision=serving.precision,
            notes=serving.notes,
        )

    def _describe(self) -> str:
        cfg = self.config
        transformer = self.weights.parts.transformer
        weights = (
            "RANDOM WEIGHTS (load=dummy): frames are noise-like, for throughput work"
            if transformer is None
            else f"checkpoint weights ({transformer.name})"
        )
        parts = [
            f"{weights}. Block-causal Wan2.1-class video diffusion transformer (config {cfg.name}: "
            f"{cfg.num_layers} layers, {cfg.num_heads}x{cfg.head_dim}), KV cache (sink {cfg.sink_frames} + window "
            f"{cfg.window_frames} latent frames), family {self.family.name} ({self.family.title}): "
            f"{len(cfg.denoising_steps)}-step sampler, "
            f"{cfg.block_frames} latent frames per chunk",
            f"text: {'UMT5' if self.text.kind == 'umt5' else 'hashed-word stand-in (no text encoder, text=hashed)'}",
            "keys/camera: "
            + ("from checkpoint" if self.action_from_checkpoint else "random-initialised action embedding"),
        ]
        if not self.vae_from_file:
            parts.append("VAE: random weights (vae=random)")
        taehv = self.decoder_choice.describe()
        if taehv is not None:
            parts.append(taehv)
        return "; ".join(parts) + "."

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def start_frame(self, options: SessionOptions) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The frame a session starts from: the start image, else the world's first frame."""
        h, w = self.config.height, self.config.width
        if options.image is not None:
            return np.frombuffer(options.image, dtype=np.uint8).reshape(h, w, 3).copy()
        return World(options.seed).render(0, 0, h, w, style_for_prompt(options.prompt))

    def _prompt(self, prompt: str | None) -> str:
        return prompt if prompt is not None else ""

    @torch.no_grad()
    def new_state(self, session_id: str, options: SessionOptions) -> WanCausalState:
        options.check_image(self._spec)
        cfg = self.config
        pixels = frame_pixels(self.start_frame(options), self.device)  # [3, H, W] in [-1, 1]
        clip_frames = 1 + 4 * (cfg.block_frames - 1)
        clip = pixels[None, :, None].expand(1, 3, clip_frames, cfg.height, cfg.width)
        latents = self.vae.encode(clip)  # [1, C, block_frames, h, w]
        cache = KVCache(cfg, self.device, self.dtype)
        prompt = self._prompt(options.prompt)
        embedding = self.text.one(prompt)
        still = torch.zeros(1, cfg.block_frames, cfg.action_dim, device=self.device)
        commit_block(self.forward, [cache], latents, embedding[None], still, self.rope([0], cfg.block_frames), cfg)
        log = BlockLog(cfg.block_frames)
        log.add(0, latents, still)
        decoder = self.decoder.new_cache()
        self.decoder.decode(latents, [decoder], first=True)
        return WanCausalState(session_id, options, cache, decoder, PromptTrack(prompt, embedding), log)

    @torch.no_grad()
    def step(self, batch: Sequence[tuple[Any, TickRequest]], on_part: PartSink | None = None) -> list[dict[str, Any]]:
        if not batch:
            return []
        cfg = self.config
        states = batch_states(batch, self.serving, WanCausalState)
        plans: list[PromptPlan] = []
        features: list[list[list[float]]] = []
        recache = self.prompt_switch == "recache"
        for state, (_, tick) in zip(states, batch, strict=True):
            prompt = self._prompt(tick.prompt if tick.prompt is not None else state.options.prompt)
            plans.append(state.prompt.plan(prompt, tick.controls, self.text.one, self.prompt_transition, recache))
            features.append(action_features(tick.controls, cfg.block_frames))
        # A block whose prompt embedding differs from the one its context was computed under recomputes
        # that context first (into a copy: the session's own cache changes only once the step succeeded).
        caches = [
            recache_context(
                self.forward,
                state.cache,
                state.log,
                plan.embedding[None],
                self.rope,
                cfg,
                keep_sink=not self.recache_sink,
            )
            if plan.recache
            else state.cache
            for state, plan in zip(states, plans, strict=True)
        ]
        kv = BatchKV(caches)
        text = torch.stack([plan.embedding for plan in plans])
        actions = torch.tensor(features, dtype=torch.float32).to(self.device, non_blocking=True)
        rope = self.rope([cache.next_frame for cache in caches], cfg.block_frames)
        shape = (cfg.latent_channels, cfg.block_frames, cfg.latent_height, cfg.latent_width)
        # The whole batch in one set of device ops per draw, each row from its own session's counter.
        noise = SessionNoise([(state.options.seed, state.draws) for state in states], shape, self.device)

        # Atomic: until every pass and the decode have succeeded, nothing a state keeps changes (the
        # block's K/V wait in the BatchKV, a re-cache in a copy; the decoder caches are swapped in only at
        # the end of a decode; the noise counters advance below).
        clean = sample_block(self.forward, kv, noise, text, actions, rope, cfg)
        commit_block(self.forward, kv, clean, text, actions, rope, cfg, keep=False)
        decoders = [list(state.decoder) for state in states]  # the decode advances copies of the lists
        host = decode_to_host(self.decoder, clean, decoders, [False] * len(states), [0] * len(states), on_part)
        firsts = [cache.next_frame for cache in caches]
        kv.commit()
        for row, (state, cache, plan, first) in enumerate(zip(states, caches, plans, firsts, strict=True)):
            state.cache = cache
            state.decoder = decoders[row]
            state.draws += noise.drawn
            state.prompt.apply(plan)
            state.log.add(first, clean[row : row + 1].clone(), actions[row : row + 1].clone())
            state.log.trim(cache)
        return [build_chunk_envelope(host[row], ChunkMetadata.from_tick(tick)) for row, (_, tick) in enumerate(batch)]

    def release(self, state: Any) -> None:
        if isinstance(state, WanCausalState):
            state.cache.clear()
            state.decoder.clear()
