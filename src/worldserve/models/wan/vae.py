"""The causal VAE driven chunk by chunk: a per-session streaming decode, batched across sessions.

Owns: :class:`VaeStream`. A session's decoder state is the feature cache of diffusers'
``AutoencoderKLWan`` decoder (the last frames each causal convolution saw), kept as the
session's own list and handed to the public ``decoder`` module one latent frame at a time,
exactly as the library's one-shot ``decode`` does inside a single call. A batch's caches are
stacked along the batch axis for one decoder pass and split back after it; :meth:`VaeStream.decode_parts`
hands each latent frame's pixels on as soon as they are decoded (the decode is that walk already). Also: latent
(de)normalisation with the VAE's ``latents_mean``/``latents_std`` and the start image's
encoding, :func:`decoder_cache_bytes` (a session's decoder cache, by a dry run on the meta
device), and the mapping between uint8 frames and the VAE's pixels in [-1, 1] both ways
(:func:`frame_pixels`, :func:`host_frames`). The same stream serves Wan2.1's VAE and Wan2.2's (the
same class with residual blocks, 48 latent channels and ``patch_size`` 2: the decoder's output is
unpatchified after the frames are joined, and a streamed encode patchifies its chunk first, both
with diffusers' own public ``patchify``/``unpatchify``, as its one-shot ``decode``/``encode`` do).
Must not know: the transformer, the sampler, sessions' control plane.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, patchify, unpatchify
from torch import Tensor, nn

from worldserve.models.wan.build import build_vae
from worldserve.models.wan.config import WanCausalConfig

__all__ = ["DecoderCache", "VaeStream", "decoder_cache_bytes", "frame_pixels", "host_frames"]

#: One session's decoder feature cache: one entry per causal convolution of the decoder.
DecoderCache = list[Any]


def frame_pixels(frame: np.ndarray[Any, np.dtype[np.uint8]], device: torch.device) -> Tensor:
    """A uint8 frame ``[H, W, 3]`` as the VAE's pixels: ``[3, H, W]`` float32 in [-1, 1] on ``device``."""
    return torch.from_numpy(frame).to(device).permute(2, 0, 1).float() / 127.5 - 1.0


def host_frames(video: Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Decoded video ``[B, 3, T, H, W]`` in [-1, 1] as uint8 frames ``[B, T, H, W, 3]``, moved to the host once."""
    frames = ((video.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    host: np.ndarray[Any, np.dtype[np.uint8]] = frames.permute(0, 2, 3, 4, 1).cpu().numpy()
    return host


class VaeStream:
    """Streaming decode and start-image encode on one ``AutoencoderKLWan``."""

    def __init__(self, vae: nn.Module) -> None:
        self.vae: Any = cast(Any, vae)
        config: Any = self.vae.config
        weight: Tensor = self.vae.post_quant_conv.weight
        self.convs = sum(isinstance(m, WanCausalConv3d) for m in self.vae.decoder.modules())
        self.encoder_convs = sum(isinstance(m, WanCausalConv3d) for m in self.vae.encoder.modules())
        #: Wan2.2's pixel patches (its ``patch_size``: 2); 1 for Wan2.1's VAE.
        self.patch = int(config.patch_size or 1)
        shape = (1, config.z_dim, 1, 1, 1)
        self.mean = torch.tensor(config.latents_mean, dtype=torch.float32, device=weight.device).view(shape)
        self.std = torch.tensor(config.latents_std, dtype=torch.float32, device=weight.device).view(shape)

    @property
    def dtype(self) -> torch.dtype:
        weight: Tensor = self.vae.post_quant_conv.weight
        return weight.dtype

    def new_cache(self) -> DecoderCache:
        return [None] * self.convs

    def denormalize(self, latents: Tensor) -> Tensor:
        return (latents.float() * self.std + self.mean).to(self.dtype)

    def encode(self, video: Tensor) -> Tensor:
        """Normalised latents (the posterior's mode) of ``video`` ``[B, 3, 1 + 4k, H, W]`` in [-1, 1]."""
        posterior = self.vae.encode(video.to(self.dtype)).latent_dist
        mode: Tensor = posterior.mode()
        return (mode.float() - self.mean) / self.std

    def new_encoder_cache(self) -> DecoderCache:
        """An empty feature cache for :meth:`encode_chunk` (one entry per causal convolution of the encoder)."""
        return [None] * self.encoder_convs

    def encode_chunk(self, video: Tensor, cache: DecoderCache) -> Tensor:
        """Normalised latents (the posterior's mode) of the next chunk of a video encoded as a stream.

        ``video`` ``[B, 3, T, H, W]`` in [-1, 1] is the stream's next chunk: its first frame alone,
        then 4 frames at a time, which is how the library's one-shot ``encode`` walks a video, so
        the chunks' latents are the one-shot encode's, one latent frame per chunk.
        """
        pixels = video.to(self.dtype)
        if self.patch != 1:
            pixels = patchify(pixels, patch_size=self.patch)  # type: ignore[no-untyped-call]
        out = self.vae.encoder(pixels, feat_cache=cache, feat_idx=[0])
        mode: Tensor = self.vae.quant_conv(out)[:, : self.mean.shape[1]]
        return (mode.float() - self.mean) / self.std

    def decode_rows(self, latents: Tensor, caches: Sequence[DecoderCache], firsts: Sequence[bool]) -> list[Tensor]:
        """:meth:`decode` of a batch whose rows may be at their stream's first chunk or past it.

        The rows at their first chunk (``firsts``) decode together, the others together (their
        caches differ in structure); returns each row's video ``[3, T, H, W]`` in the batch's order.
        """
        parts = list(self.decode_parts(latents, caches, firsts))
        return [torch.cat([part[row] for part in parts], dim=1) for row in range(len(caches))]

    def decode_parts(
        self, latents: Tensor, caches: Sequence[DecoderCache], firsts: Sequence[bool]
    ) -> Iterator[list[Tensor]]:
        """:meth:`decode_rows`, one latent frame at a time: yields each row's video ``[3, t, H, W]`` of
        that latent frame (4 frames; 1 for a row's very first), in the batch's order.

        The caches are advanced once the last latent frame is decoded (a walk left early leaves
        them as they were). The parts joined are :meth:`decode_rows`' videos, bit for bit.
        """
        groups = [
            (first, rows)
            for first in (True, False)
            if (rows := [row for row, flag in enumerate(firsts) if flag == first])
        ]
        inputs = [self.vae.post_quant_conv(self.denormalize(latents[rows])) for _, rows in groups]
        shared = [_stack([caches[row] for row in rows]) for _, rows in groups]
        for frame in range(latents.shape[2]):
            out: list[Tensor | None] = [None] * len(caches)
            for (first, rows), x, cache in zip(groups, inputs, shared, strict=True):
                video = self.vae.decoder(
                    x[:, :, frame : frame + 1], feat_cache=cache, feat_idx=[0], first_chunk=first and frame == 0
                )
                if self.patch != 1:
                    video = unpatchify(video, patch_size=self.patch)  # type: ignore[no-untyped-call]
                video = torch.clamp(video, -1.0, 1.0)
                for index, row in enumerate(rows):
                    out[row] = video[index]
            yield [video for video in out if video is not None]
        for (_, rows), cache in zip(groups, shared, strict=True):
            _unstack(cache, [caches[row] for row in rows])

    def decode(self, latents: Tensor, caches: Sequence[DecoderCache], *, first: bool = False) -> Tensor:
        """Decode ``latents`` ``[B, C, F, h, w]`` (normalised) of B sessions, continuing each cache.

        Returns video ``[B, 3, T, H, W]`` in [-1, 1]: ``T = 4F`` frames, or ``1 + 4(F - 1)``
        when ``first`` (the session's very first latent frame decodes to one frame).
        """
        return torch.stack(self.decode_rows(latents, caches, [first] * len(caches)))

    @staticmethod
    def nbytes(cache: DecoderCache) -> int:
        return sum(entry.numel() * entry.element_size() for entry in cache if isinstance(entry, Tensor))


def _stack(caches: Sequence[DecoderCache]) -> DecoderCache:
    if len(caches) == 1:
        return list(caches[0])
    shared: DecoderCache = []
    for entries in zip(*caches, strict=True):
        first = entries[0]
        if isinstance(first, Tensor):
            shared.append(torch.cat(entries, dim=0))
        elif all(entry is None for entry in entries) or all(isinstance(e, str) and e == first for e in entries):
            shared.append(first)
        else:
            raise ValueError("sessions at different decoder stages cannot share a decode")
    return shared


def _unstack(shared: DecoderCache, caches: Sequence[DecoderCache]) -> None:
    for index, entry in enumerate(shared):
        parts: Sequence[Any] = torch.split(entry, 1) if isinstance(entry, Tensor) else [entry] * len(caches)
        for cache, part in zip(caches, parts, strict=True):
            cache[index] = part


def decoder_cache_bytes(config: WanCausalConfig, dtype_bytes: int) -> int:
    """Bytes of one session's VAE decoder cache, from a dry run on the meta device (no memory, no compute)."""
    with torch.device("meta"):
        stream = VaeStream(build_vae(config))
        cache = stream.new_cache()
        latents = torch.zeros(1, config.latent_channels, config.block_frames, config.latent_height, config.latent_width)
        stream.decode(latents, [cache], first=True)
        stream.decode(latents, [cache])
    return sum(entry.numel() for entry in cache if isinstance(entry, Tensor)) * dtype_bytes
