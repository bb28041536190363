"""The ``matrix-game-2`` model behind the runtime's :class:`~worldserve.models.base.WorldModel` interface.

Owns: :class:`MatrixGameModel` and :class:`MatrixGameState`. A session starts from its start
image (the model is image-to-world: ``spec.requires_image``): the image's CLIP features and its
per-frame image latents (:mod:`~worldserve.models.matrixgame.image`) are computed once, the caches
start empty and the first block is generated from noise, as the reference does. A session's state
is its caches (:class:`~worldserve.models.matrixgame.forward.MatrixCaches`: no sink, the last
frames' window), its decoder state (the VAE's feature cache, or TAEHV's with ``decoder=taehv``), the
last 12 video frames' keyboard and mouse actions (the next block's windows reach back into them), its
noise counter and its image conditioning.
:meth:`MatrixGameModel.step` runs ONE batched few-step denoise over every session of the batch
(each at its own frame offset, with its own keys and mouse held for the block), one batched commit
pass and one batched streaming decode (sessions at their first block decode apart: their first
latent frame is one video frame, so that chunk's first frame is shown 4 times to keep 12 frames a
chunk); frames leave the device once per batch. A step that raises leaves every state as it was
(``atomic_step``), and a step that succeeded can be undone (``can_rollback``: the block's K/V are
staged, not yet written over the oldest frames, until the next step). Must not know: sessions'
control plane, engines, transports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from worldserve.models.base import ModelSpec, PartSink, SessionOptions
from worldserve.models.matrixgame.action import action_windows
from worldserve.models.matrixgame.controls import (
    KEYS_TRACK,
    MOUSE_TRACK,
    keyboard_action,
    mouse_action,
    variant_controls,
)
from worldserve.models.matrixgame.forward import MatrixBatchKV, MatrixCaches, MatrixConditions, MatrixGameForward
from worldserve.models.matrixgame.image import MAX_IMAGE_FRAMES, ImageEncoder, ImageLatents, encode_image_latents
from worldserve.models.matrixgame.weights import MatrixWeightOptions, load_matrix
from worldserve.models.wan.decoders import choose_decoder
from worldserve.models.wan.noise import SessionNoise
from worldserve.models.wan.options import (
    FLOAT32_PARTS,
    option_bool,
    option_int,
    option_path,
)
from worldserve.models.wan.rope import FrameRope
from worldserve.models.wan.sampler import commit_block, sample_block
from worldserve.models.wan.serving import FrameDecoding, Serving, batch_states, decode_to_host
from worldserve.models.wan.vae import DecoderCache, frame_pixels
from worldserve.protocol import ChunkMetadata, TickRequest, build_chunk_envelope

__all__ = ["MatrixGameModel", "MatrixGameState"]

_MODEL = "matrix-game-2"


class MatrixGameState:
    """One session: caches, decoder cache, image conditioning, the last video frames' actions, noise counter."""

    __slots__ = ("caches", "decoder", "draws", "features", "image", "keyboard", "mouse", "options", "session_id")

    def __init__(
        self,
        session_id: str,
        options: SessionOptions,
        caches: MatrixCaches,
        decoder: DecoderCache,
        image: ImageLatents,
        features: Tensor,
    ) -> None:
        self.session_id = session_id
        self.options = options
        self.caches = caches
        self.decoder = decoder
        self.image = image
        self.features = features
        #: The last 12 video frames' keyboard ``[1, 12, keyboard_dim]`` and mouse ``[1, 12, 2]`` actions
        #: (None before the first block).
        self.keyboard: Tensor | None = None
        self.mouse: Tensor | None = None
        #: Noise draws so far: the counter of the session's noise (seeded by ``options.seed``).
        self.draws = 0

    @property
    def started(self) -> bool:
        return self.keyboard is not None


@dataclass(frozen=True, slots=True)
class MatrixGameUndo:
    """What one step changes in a :class:`MatrixGameState`, as it was before (the caches only stage)."""

    decoder: DecoderCache
    keyboard: Tensor | None
    mouse: Tensor | None
    draws: int


class MatrixGameModel:
    """Matrix-Game 2.0 as a world model (see the module docstring).

    Options (all strings from ``--model-option`` work): ``weights`` (a folder of downloads:
    Skywork/Matrix-Game-2.0 or a FastVideo ``Matrix-Game-2.0-*-Diffusers`` folder), ``checkpoint``,
    ``vae``, ``image_encoder`` (each part's file or folder, overriding ``weights``), ``variant``
    (``universal``, ``gta-drive``, ``templerun``; by default the one the checkpoint's shapes say),
    ``config`` (``tiny``, ``1.3b``; by default the checkpoint's), ``load=dummy`` (random weights;
    the default only for ``tiny``), ``vae=random`` / ``image_encoder=random`` (run a trained
    checkpoint without its VAE / image encoder), ``device``, ``dtype`` (``auto``: bfloat16 on CUDA,
    else float32), ``window`` (committed latent frames the attention sees; the variant's by default),
    ``max_batch_size``, ``seed`` (of dummy weights), ``threads``, ``compile`` (1: ``torch.compile``
    the transformer blocks' dense parts), ``attention`` (``batched``, or ``loop``: the per-session
    reference), ``rollback`` (0: no cancel of a chunk in flight), ``decoder`` (``vae``, the default, or
    ``taehv``: TAEHV's tiny decoder, cheaper, slightly lower quality), ``taehv`` (its ``taew2_1.pth``;
    ``weights=DIR``'s is found by name; ``random``: random weights).
    """

    def __init__(
        self,
        *,
        config: str | None = None,
        variant: str | None = None,
        weights: str | Path | None = None,
        checkpoint: str | Path | None = None,
        vae: str | Path | None = None,
        image_encoder: str | Path | None = None,
        load: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        window: int | str | None = None,
        max_batch_size: int | str = 8,
        seed: int | str = 0,
        threads: int | str | None = None,
        compile: int | str | bool | None = None,
        attention: str = "batched",
        rollback: int | str | bool | None = None,
        decoder: str | None = None,
        taehv: str | Path | None = None,
    ) -> None:
        serving = self.serving = Serving.read(
            _MODEL, device=device, dtype=dtype, threads=threads, seed=seed, max_batch_size=max_batch_size
        )
        self.device, self.dtype = serving.device, serving.dtype
        options = MatrixWeightOptions(
            config=config,
            variant=variant,
            weights=option_path(weights),
            checkpoint=option_path(checkpoint),
            vae=option_path(vae),
            image_encoder=option_path(image_encoder),
            load=load,
            window=option_int(window, _MODEL, "window"),
        )
        taehv_path = option_path(taehv)
        choose_decoder(decoder, taehv_path, options.weights, trained=False, model=_MODEL)  # refused before loading
        loaded = load_matrix(options, self.device, serving.seed)
        self.decoder_choice = choose_decoder(
            decoder, taehv_path, options.weights, trained=not loaded.dummy, model=_MODEL
        )
        self.loaded = loaded
        self.config = cfg = loaded.config
        self.variant = loaded.variant
        serving.prepare(loaded.transformer, FLOAT32_PARTS)
        serving.prepare(loaded.vae)
        serving.prepare(loaded.image_encoder)
        self.forward = MatrixGameForward(
            loaded.transformer, cfg, attention=attention, compile=bool(option_bool(compile, _MODEL, "compile"))
        )
        frames = FrameDecoding.build(self.decoder_choice, loaded.vae, cfg.wan, serving)
        self.vae = frames.vae  # the start image's encoder, and the decoder unless decoder=taehv
        self.decoder = frames.decoder
        self.decoder_cache_bytes = frames.cache_bytes
        self.encoder = ImageEncoder(loaded.image_encoder, cfg.clip)
        self.rope = FrameRope(cfg.wan, self.device)
        wan = cfg.wan
        dtype_bytes = serving.dtype_bytes
        image_bytes = 4 * MAX_IMAGE_FRAMES * wan.latent_channels * wan.latent_height * wan.latent_width
        features_bytes = cfg.clip.tokens * cfg.clip.dim * dtype_bytes
        history_bytes = 4 * cfg.action.window_frames * (cfg.action.keyboard_dim + cfg.action.mouse_dim)
        state_bytes = cfg.kv_bytes(dtype_bytes) + self.decoder_cache_bytes + image_bytes + features_bytes
        state_bytes += history_bytes + 4096
        rollback_on = option_bool(rollback, _MODEL, "rollback")
        controls = variant_controls(self.variant)
        self._spec = ModelSpec(
            name=_MODEL,
            frames_per_chunk=wan.video_frames_per_block,
            fps=wan.fps,
            height=wan.height,
            width=wan.width,
            controls=controls,
            max_batch_size=serving.max_batch_size,
            state_bytes=state_bytes,
            description=self._describe(),
            atomic_step=True,
            frame_parts=True,
            version=loaded.version,
            precision=serving.precision,
            continuous_tracks=tuple(c.track for c in controls if c.track in (KEYS_TRACK, MOUSE_TRACK)),
            can_rollback=rollback_on is not False,
            requires_image=True,
            takes_prompt=False,  # no text encoder: prompts are ignored
            notes=serving.notes,
        )

    def _describe(self) -> str:
        cfg, loaded = self.config, self.loaded
        source = loaded.sources.get("transformer")
        weights = (
            "RANDOM WEIGHTS (load=dummy): frames are noise-like, for throughput work"
            if source is None
            else f"checkpoint weights ({source.name})"
        )
        parts = [
            f"{weights}. {self.variant.title} (config {cfg.name}: {cfg.wan.num_layers} Wan blocks, "
            f"action modules in {len(cfg.action.layers)}), image-to-world from a start image, KV cache of "
            f"{cfg.wan.window_frames} latent frames + the block's {cfg.wan.block_frames} (no sink), "
            f"{len(cfg.wan.denoising_steps)}-step sampler; no text encoder (prompts are ignored)",
        ]
        if "vae" not in loaded.sources:
            parts.append("VAE: random weights" + ("" if loaded.dummy else " (vae=random)"))
        if "image_encoder" not in loaded.sources:
            parts.append("image encoder: random weights" + ("" if loaded.dummy else " (image_encoder=random)"))
        taehv = self.decoder_choice.describe()
        if taehv is not None:
            parts.append(taehv)
        return "; ".join(parts) + "."

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @torch.no_grad()
    def new_state(self, session_id: str, options: SessionOptions) -> MatrixGameState:
        options.check_image(self._spec)
        assert options.image is not None
        cfg = self.config
        frame = np.frombuffer(options.image, dtype=np.uint8).reshape(cfg.wan.height, cfg.wan.width, 3)
        pixels = frame_pixels(frame.copy(), self.device)[None]  # [1, 3, H, W] in [-1, 1]
        image = encode_image_latents(self.vae, pixels, cfg)
        features = self.encoder(pixels)
        caches = MatrixCaches(cfg, self.device, self.dtype)
        return MatrixGameState(session_id, options, caches, self.decoder.new_cache(), image, features)

    @torch.no_grad()
    def step(self, batch: Sequence[tuple[Any, TickRequest]], on_part: PartSink | None = None) -> list[dict[str, Any]]:
        if not batch:
            return []
        wan, action = self.config.wan, self.config.action
        states = batch_states(batch, self.serving, MatrixGameState)
        block = wan.block_frames
        span = action.window_frames
        video = action.frames_per_latent * block
        # Each session's keys and mouse, held for every video frame of the block; the windows reach back
        # into the last block's (a first block's into copies of its own first action, the reference's padding).
        keys = torch.tensor([keyboard_action(tick.controls, self.variant) for _, tick in batch])
        mice = torch.tensor([mouse_action(tick.controls) for _, tick in batch])
        keys_block = keys[:, None].expand(-1, video, -1)
        mice_block = mice[:, None].expand(-1, video, -1)
        keys_history = torch.cat(
            [
                s.keyboard if s.keyboard is not None else keys_block[r : r + 1, :1].expand(1, span, -1)
                for r, s in enumerate(states)
            ]
        )
        mice_history = torch.cat(
            [
                s.mouse if s.mouse is not None else mice_block[r : r + 1, :1].expand(1, span, -1)
                for r, s in enumerate(states)
            ]
        )
        keyboard_windows = action_windows(keys_history, keys_block, action).to(self.device, non_blocking=True)
        mouse_windows = (
            action_windows(mice_history, mice_block, action).to(self.device, non_blocking=True)
            if action.mouse
            else None
        )
        kv = MatrixBatchKV([state.caches for state in states])  # keeps the blocks the last steps staged
        offsets = tuple(state.caches.next_frame for state in states)
        conditions = MatrixConditions(
            image_latents=torch.cat(
                [state.image.frames(offset, block) for state, offset in zip(states, offsets, strict=True)]
            ),
            keyboard=keyboard_windows,
            mouse=mouse_windows,
            offsets=offsets,
        )
        features = torch.cat([state.features for state in states])
        rope = self.rope(list(offsets), block)
        shape = (wan.latent_channels, block, wan.latent_height, wan.latent_width)
        # The whole batch in one set of device ops per draw, each row from its own session's counter.
        noise = SessionNoise([(state.options.seed, state.draws) for state in states], shape, self.device)

        # Atomic: until every pass and the decode have succeeded nothing a state keeps changes (the commit
        # pass's K/V wait in the batch view; the decode advances copies of the decoder caches).
        clean = sample_block(self.forward, kv, noise, features, conditions, rope, wan)
        commit_block(self.forward, kv, clean, features, conditions, rope, wan, keep=False)
        decoders = [list(state.decoder) for state in states]
        firsts = [not state.started for state in states]
        # A first block's first latent frame is one video frame: show it 4 times (12 frames a chunk).
        held = [video - (1 + 4 * (block - 1)) if first else 0 for first in firsts]
        host = decode_to_host(self.decoder, clean, decoders, firsts, held, on_part)
        kv.commit()  # staged: kept by the next step's batch view, dropped by a rollback
        for row, state in enumerate(states):
            state.decoder = decoders[row]
            state.draws += noise.drawn
            state.keyboard = torch.cat([keys_history[row : row + 1], keys_block[row : row + 1]], 1)[:, -span:]
            state.mouse = torch.cat([mice_history[row : row + 1], mice_block[row : row + 1]], 1)[:, -span:]
        return [build_chunk_envelope(host[row], ChunkMetadata.from_tick(tick)) for row, (_, tick) in enumerate(batch)]

    def snapshot(self, state: Any) -> MatrixGameUndo:
        """What the next step of ``state`` will change, as it is now: a few references, no tensor copies (the
        caches keep any block staged by the last step now, and the next one only stages)."""
        if not isinstance(state, MatrixGameState):
            raise TypeError(f"matrix-game-2 got a foreign state: {type(state).__name__}")
        state.caches.flush()
        return MatrixGameUndo(state.decoder, state.keyboard, state.mouse, state.draws)

    def restore(self, state: Any, snapshot: Any) -> MatrixGameState:
        """Undo the step taken since ``snapshot``: the state is as it was before it."""
        if not isinstance(state, MatrixGameState) or not isinstance(snapshot, MatrixGameUndo):
            raise TypeError("matrix-game-2 got a foreign state or snapshot.")
        state.caches.unstage()
        state.decoder = snapshot.decoder
        state.keyboard = snapshot.keyboard
        state.mouse = snapshot.mouse
        state.draws = snapshot.draws
        return state

    def release(self, state: Any) -> None:
        if isinstance(state, MatrixGameState):
            state.caches.clear()
            state.decoder.clear()
