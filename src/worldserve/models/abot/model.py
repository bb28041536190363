"""The ``abot-world`` model behind the runtime's :class:`~worldserve.models.base.WorldModel` interface.

Owns: :class:`ABotWorldModel` and :class:`ABotState`. A session's state is its KV cache (the
reference slots and the window: no sink), its relative RoPE's base, its decoder state, its noise
counter, the start image's latent frame, its prompt embedding and the keys its last block applied.

Its first step is the reference's first streamed block (``generate_next_block``): three latent
frames, the first the start image's latent (the start image, else the procedural world's first
frame for its seed and prompt, encoded by Wan2.2's VAE), held clean at timestep 0 through every pass,
the reference slots' tokens as queries too: the session's reference images (``references``, one per
slot, in ``REFERENCE_NAMES``' order, each encoded alone by Wan2.2's VAE at ``ref_resolution`` square and
patch-embedded, as the reference's ``set_ref_latent_mask_from_exists_paths`` and ``_prepare_ref_tokens``
do), or without them empty slots, zero and masked, what the reference falls back to when one is missing.
Its three latent frames decode to 9 frames
(the first latent frame to one); the chunk opens with the start frame held for the 3 more, so every
chunk has the same 12 frames. Every later step: three latent frames, 12 frames.

:meth:`ABotWorldModel.step` runs the first blocks of a batch together and the others together (a
first block's pass is longer), one batched streaming decode over all, frames leaving the device
once. Keys: of the ``keys`` track (:mod:`~worldserve.models.abot.controls`), the block's bits go to
the control adapter. A step that raises leaves every state unchanged (``atomic_step``), and a step
that succeeded can be undone (``can_rollback``: the block's K/V are staged, not yet written over the
oldest frames, until the next step; the slots' rotation follows the base kept in the state). Must not
know: sessions' control plane, engines, transports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from worldserve.models.abot.config import ABotConfig
from worldserve.models.abot.controls import KEYS_SCHEMA, NO_KEYS, BlockKeys, block_keys, held_keys
from worldserve.models.abot.forward import ABotForward
from worldserve.models.abot.weights import ABotWeightOptions, load_abot_weights
from worldserve.models.base import ModelSpec, PartSink, SessionOptions
from worldserve.models.wan.cache import BatchKV, KVCache
from worldserve.models.wan.decoders import choose_decoder
from worldserve.models.wan.files import TAEHV22_FILE
from worldserve.models.wan.fp8 import check_fp8, quantize_blocks
from worldserve.models.wan.noise import SessionNoise
from worldserve.models.wan.options import FLOAT32_PARTS, option_bool, option_path
from worldserve.models.wan.rope import FrameRope, RelativeWindow, slot_times
from worldserve.models.wan.sampler import commit_block, sample_block
from worldserve.models.wan.serving import FrameDecoding, Serving, batch_states, decode_to_host
from worldserve.models.wan.text import PromptEmbedder
from worldserve.models.wan.vae import DecoderCache, frame_pixels
from worldserve.models.world import World, style_for_prompt
from worldserve.protocol import ChunkMetadata, TickRequest, build_chunk_envelope

__all__ = ["REFERENCE_NAMES", "ABotState", "ABotUndo", "ABotWorldModel"]

_MODEL = "abot-world"

#: The reference slots' images, in the order the model takes them (``pipeline/causal_inference.py``'s
#: ``ref_names``: views of the scene from the start position); a config with fewer slots takes the first.
REFERENCE_NAMES = ("head", "left", "right", "front", "back")


class ABotState:
    """One session: KV cache, relative-RoPE base, decoder state, noise counter, start latent, prompt, keys."""

    __slots__ = (
        "base", "cache", "decoder", "draws", "image", "keys", "options", "prompt", "refs", "session_id", "text",
    )  # fmt: skip

    def __init__(
        self,
        session_id: str,
        options: SessionOptions,
        cache: KVCache,
        decoder: DecoderCache,
        image: Tensor,
        refs: Tensor,
    ) -> None:
        self.session_id = session_id
        self.options = options
        self.cache = cache
        self.decoder = decoder
        #: The start image's latent frame ``[1, C, 1, h, w]``: the first block's first frame.
        self.image = image
        #: The reference slots' tokens ``[1, slots * tokens per slot, dim]`` (zero without reference images):
        #: queries and keys of the first block, kept for a reset or an undone first block.
        self.refs = refs
        #: The frame the relative RoPE's window counts from (:class:`~worldserve.models.wan.rope.RelativeWindow`).
        self.base = 0
        self.draws = 0
        self.keys: BlockKeys = NO_KEYS
        self.prompt: str | None = None
        self.text: Tensor | None = None

    @property
    def started(self) -> bool:
        """Whether the first block is done (the reference slots are in the cache)."""
        return self.cache.next_frame > 0


@dataclass(frozen=True, slots=True)
class ABotUndo:
    """What one step changes in an :class:`ABotState`, as it was before (the cache only stages)."""

    decoder: DecoderCache
    draws: int
    keys: BlockKeys
    base: int


@dataclass(frozen=True, slots=True)
class _Conditions:
    """What a pass is conditioned on besides latents, timesteps and text: keys, and a first block's slots."""

    keys: list[tuple[int, ...]]
    refs: Tensor | None = None
    ref_rope: tuple[Tensor, Tensor] | None = None


class ABotWorldModel:
    """ABot-World-0-5B-LF (amap-cvlab): Wan2.2-TI2V-5B made block-causal, steered by eight keys.

    Options (all strings from ``--model-option`` work): ``weights`` (ABot-World-0-5B-LF's folder: the
    parts are found by their published names), ``checkpoint``, ``vae``, ``text_encoder``, ``tokenizer``
    (each part's file or folder, overriding ``weights``), ``config`` (``tiny``, ``5b``; by default
    ``5b`` with weights, ``tiny`` without), ``load=dummy`` (random weights; the default only for
    ``tiny``), ``text=hashed`` (run a checkpoint without its text encoder), ``decoder`` (``vae``, the
    default, or ``taehv``: ``taew2_2.pth``, ABot-World's own default, cheaper), ``taehv`` (its file;
    ``weights=DIR``'s is found by name; ``random``), ``compile`` (1: ``torch.compile`` the blocks),
    ``device``, ``dtype`` (``auto``: bfloat16 on CUDA, else float32), ``quant`` (``fp8``: the blocks'
    GEMMs in FP8, per token, as the reference's ``use_fp8_gemm`` runs it: :mod:`~worldserve.models.wan.fp8`;
    CUDA of compute capability 8.9+, or the CPU for checks), ``max_batch_size``, ``seed`` (of random
    weights), ``threads``.
    """

    def __init__(
        self,
        *,
        config: str | ABotConfig | None = None,
        weights: str | Path | None = None,
        checkpoint: str | Path | None = None,
        vae: str | Path | None = None,
        text_encoder: str | Path | None = None,
        tokenizer: str | Path | None = None,
        load: str | None = None,
        text: str | None = None,
        decoder: str | None = None,
        taehv: str | Path | None = None,
        compile: int | str | bool | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        quant: str | None = None,
        max_batch_size: int | str = 4,
        seed: int | str = 0,
        threads: int | str | None = None,
    ) -> None:
        serving = self.serving = Serving.read(
            _MODEL, device=device, dtype=dtype, threads=threads, seed=seed, max_batch_size=max_batch_size
        )
        self.device, self.dtype = serving.device, serving.dtype
        if quant not in (None, "none", "fp8"):
            raise ValueError(f"{_MODEL} option quant must be 'fp8' or 'none'; got {quant!r}.")
        self.fp8 = quant == "fp8"
        if self.fp8:
            check_fp8(self.device, _MODEL)  # refused before anything loads
        options = ABotWeightOptions(
            config=config,
            weights=option_path(weights),
            checkpoint=option_path(checkpoint),
            vae=option_path(vae),
            text_encoder=option_path(text_encoder),
            tokenizer=option_path(tokenizer),
            load=load,
            text=text,
        )
        taehv_path = option_path(taehv)
        pick = {"model": _MODEL, "taehv_file": TAEHV22_FILE}
        choose_decoder(decoder, taehv_path, options.weights, trained=False, **pick)  # refused before loading
        loaded = load_abot_weights(options, self.device, serving.seed, self.dtype)
        self.decoder_choice = choose_decoder(decoder, taehv_path, options.weights, trained=not loaded.dummy, **pick)
        cfg: ABotConfig = loaded.config
        self.config = cfg
        self.weights = loaded
        serving.prepare(loaded.transformer, FLOAT32_PARTS)
        if self.fp8:
            quantize_blocks(loaded.transformer)
        serving.prepare(loaded.adapter)
        serving.prepare(loaded.vae)
        self.forward = ABotForward(
            loaded.transformer, loaded.adapter, cfg, compile=bool(option_bool(compile, _MODEL, "compile"))
        )
        frames = FrameDecoding.build(self.decoder_choice, loaded.vae, cfg.wan, serving)
        self.vae = frames.vae
        self.decoder = frames.decoder
        self.rope = FrameRope(cfg.wan, self.device)
        self.window = RelativeWindow(cfg.local_frames, limit=cfg.rope_limit, table=cfg.rope_table)
        self.text = PromptEmbedder(
            cfg.wan.text_len, cfg.wan.text_dim, self.device, self.dtype, loaded.text_encoder, loaded.tokenizer
        )
        wan = cfg.wan
        ref_bytes = 3 * wan.num_layers * cfg.ref_tokens * wan.dim * serving.dtype_bytes  # K, V, unrotated K
        ref_bytes += cfg.ref_tokens * wan.dim * serving.dtype_bytes  # the slots' tokens, kept for a first block
        image_bytes = 4 * wan.latent_channels * wan.latent_height * wan.latent_width
        state_bytes = wan.kv_bytes(serving.dtype_bytes) + ref_bytes + frames.cache_bytes + image_bytes + 4096
        self._spec = ModelSpec(
            name=_MODEL,
            frames_per_chunk=wan.video_frames_per_block,
            fps=wan.fps,
            height=wan.height,
            width=wan.width,
            controls=(KEYS_SCHEMA,),
            max_batch_size=serving.max_batch_size,
            state_bytes=state_bytes,
            description=self._describe(),
            atomic_step=True,
            frame_parts=True,
            can_rollback=True,
            continuous_tracks=(KEYS_SCHEMA.track,),
            version=loaded.version,
            precision=f"{serving.precision}, fp8 GEMMs" if self.fp8 else serving.precision,
            notes=serving.notes,
            reference_slots=REFERENCE_NAMES[: cfg.ref_slots],
            reference_size=cfg.ref_resolution,
        )

    def _describe(self) -> str:
        cfg, wan = self.config, self.config.wan
        transformer = self.weights.parts.transformer
        weights = (
            "RANDOM WEIGHTS (load=dummy): frames are noise-like, for throughput work"
            if transformer is None
            else f"checkpoint weights ({transformer.name})"
        )
        parts = [
            f"{weights}. ABot-World: Wan2.2-TI2V-5B made block-causal (config {cfg.wan.name}: {wan.num_layers} "
            f"layers, {wan.num_heads}x{wan.head_dim}), keys W A S D move and I J K L look, {wan.block_frames} "
            f"latent frames per chunk, a {cfg.local_frames}-frame attention window with relative RoPE, "
            f"{len(wan.denoising_steps)}-step sampler; {cfg.ref_slots} reference slots "
            f"({', '.join(REFERENCE_NAMES[: cfg.ref_slots])} at {cfg.ref_resolution}x{cfg.ref_resolution}: "
            "a session's `references`, else empty)",
            f"text: {'UMT5' if self.text.kind == 'umt5' else 'hashed-word stand-in (no text encoder)'}",
        ]
        if self.fp8:
            parts.append("the blocks' GEMMs in FP8 (quant=fp8: weights per channel, inputs per token)")
        taehv = self.decoder_choice.describe()
        if taehv is not None:
            parts.append(taehv)
        return "; ".join(parts) + "."

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def start_frame(self, options: SessionOptions) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The frame a session starts from: the start image, else the world's first frame."""
        h, w = self.config.wan.height, self.config.wan.width
        if options.image is not None:
            return np.frombuffer(options.image, dtype=np.uint8).reshape(h, w, 3).copy()
        return World(options.seed).render(0, 0, h, w, style_for_prompt(options.prompt))

    @torch.no_grad()
    def new_state(self, session_id: str, options: SessionOptions) -> ABotState:
        options.check_image(self._spec)
        pixels = frame_pixels(self.start_frame(options), self.device)  # [3, H, W] in [-1, 1]
        image = self.vae.encode(pixels[None, :, None])  # [1, C, 1, h, w]: one frame, one latent frame
        cache = KVCache(self.config.wan, self.device, self.dtype, ref_tokens=self.config.ref_tokens)
        return ABotState(session_id, options, cache, self.decoder.new_cache(), image, self.reference_tokens(options))

    def reference_tokens(self, options: SessionOptions) -> Tensor:
        """The reference slots' tokens ``[1, slots * tokens per slot, dim]`` of a session: each of its
        reference images encoded alone by the VAE (one frame, one latent frame) and patch-embedded, mask 1;
        without reference images, every slot masked (zero)."""
        cfg, wan = self.config, self.config.wan
        side = cfg.ref_resolution // wan.vae_spatial
        latents = torch.zeros(1, cfg.ref_slots, wan.latent_channels, 1, side, side, device=self.device)
        mask = torch.zeros(1, cfg.ref_slots, device=self.device)
        if options.references:
            size = cfg.ref_resolution
            frames = [np.frombuffer(blob, dtype=np.uint8).reshape(size, size, 3).copy() for blob in options.references]
            pixels = torch.stack([frame_pixels(frame, self.device) for frame in frames])  # [slots, 3, size, size]
            latents[0] = self.vae.encode(pixels[:, :, None])  # each image alone: a batch of one-frame videos
            mask.fill_(1.0)
        tokens: Tensor = self.forward.ref_tokens(latents, mask).to(self.dtype)
        return tokens

    def _embedding(self, state: ABotState, tick: TickRequest) -> Tensor:
        prompt = tick.prompt if tick.prompt is not None else state.options.prompt
        return self.text.one(prompt if prompt is not None else "")

    def _run(
        self,
        latents: Tensor,
        timesteps: Tensor,
        text: Tensor,
        actions: _Conditions,
        caches: Any,
        rope: tuple[Tensor, Tensor],
        *,
        head: bool = True,
    ) -> Tensor | None:
        """The sampler's forward: :class:`ABotForward` with a pass's conditions unpacked."""
        return self.forward(
            latents,
            timesteps,
            text,
            actions.keys,
            caches,
            rope,
            refs=actions.refs,
            ref_rope=actions.ref_rope,
            head=head,
        )

    @torch.no_grad()
    def step(self, batch: Sequence[tuple[Any, TickRequest]], on_part: PartSink | None = None) -> list[dict[str, Any]]:
        if not batch:
            return []
        cfg, wan = self.config, self.config.wan
        states = batch_states(batch, self.serving, ABotState)
        keys = [
            block_keys(held_keys(tick.controls), state.keys) for state, (_, tick) in zip(states, batch, strict=True)
        ]
        texts = [self._embedding(state, tick) for state, (_, tick) in zip(states, batch, strict=True)]
        shape = (wan.latent_channels, wan.block_frames, wan.latent_height, wan.latent_width)
        clean: list[Tensor | None] = [None] * len(states)
        bases = [state.base for state in states]
        kvs: list[BatchKV] = []
        draws = [0] * len(states)
        # Atomic: until every pass and the decode have succeeded, nothing a state keeps changes (the
        # block's K/V and the slots wait in the BatchKVs; rotations of the slots are redone from their
        # unrotated keys; the decoder caches are swapped in only at the end; counters advance below).
        for first in (True, False):
            rows = [row for row, state in enumerate(states) if state.started != first]
            if not rows:
                continue
            caches = [states[row].cache for row in rows]
            starts = [cache.next_frame for cache in caches]
            cond = _Conditions([keys[row].bits for row in rows])
            held = None
            if first:
                slots = torch.cat([states[row].refs for row in rows])
                cos, sin = self.rope.slots(slot_times(0, cfg.ref_slots, cfg.ref_tokens_per_slot), cfg.ref_grid)
                ref_rope = (cos.expand(len(rows), -1, -1, -1), sin.expand(len(rows), -1, -1, -1))
                cond = _Conditions(cond.keys, slots, ref_rope)
                held = torch.cat([states[row].image for row in rows])
            else:
                for row, start in zip(rows, starts, strict=True):
                    base = self.window.base_for(states[row].base, start, wan.block_frames)
                    if base != bases[row]:
                        bases[row] = base
                        times = slot_times(base, cfg.ref_slots, cfg.ref_tokens_per_slot)
                        states[row].cache.rotate_refs(*self.rope.slots(times, cfg.ref_grid))
            kv = BatchKV(caches)
            text = torch.stack([texts[row] for row in rows])
            rope = self.rope(starts, wan.block_frames)
            noise = SessionNoise([(states[row].options.seed, states[row].draws) for row in rows], shape, self.device)
            x0 = sample_block(self._run, kv, noise, text, cond, rope, wan, held=held)
            commit_block(self._run, kv, x0, text, cond, rope, wan, keep=False, held_frames=0 if held is None else 1)
            kvs.append(kv)
            for index, row in enumerate(rows):
                clean[row] = x0[index : index + 1]
                draws[row] = noise.drawn
        latents = torch.cat([c for c in clean if c is not None])
        decoders = [list(state.decoder) for state in states]  # the decode advances copies of the lists
        firsts = [not state.started for state in states]
        # A first block decodes to 9 frames: the start frame held for 3 more opens the chunk.
        opening = [wan.video_frames_per_block - (1 + 4 * (wan.block_frames - 1)) if first else 0 for first in firsts]
        host = decode_to_host(self.decoder, latents, decoders, firsts, opening, on_part)
        for kv in kvs:
            kv.stage()  # kept by the next step's batch view, dropped by a rollback
        for row, state in enumerate(states):
            state.decoder = decoders[row]
            state.draws += draws[row]
            state.keys = keys[row]
            state.base = bases[row]
        return [build_chunk_envelope(host[row], ChunkMetadata.from_tick(tick)) for row, (_, tick) in enumerate(batch)]

    def snapshot(self, state: Any) -> ABotUndo:
        """What the next step of ``state`` changes, as it is now: a few references, no tensor copies (the cache
        keeps a block staged by the last step now; the next one only stages)."""
        if not isinstance(state, ABotState):
            raise TypeError(f"{_MODEL} got a foreign state: {type(state).__name__}")
        state.cache.flush()
        return ABotUndo(state.decoder, state.draws, state.keys, state.base)

    def restore(self, state: Any, snapshot: Any) -> ABotState:
        """Undo the step taken since ``snapshot``: the state is as it was before it (slots rotated for a base
        the undone step moved to are rotated back by the next step, from their unrotated keys)."""
        if not isinstance(state, ABotState) or not isinstance(snapshot, ABotUndo):
            raise TypeError(f"{_MODEL} got a foreign state or snapshot.")
        state.cache.unstage()
        state.decoder = snapshot.decoder
        state.draws = snapshot.draws
        state.keys = snapshot.keys
        state.base = snapshot.base
        return state

    def release(self, state: Any) -> None:
        if isinstance(state, ABotState):
            state.cache.clear()
            state.decoder.clear()
