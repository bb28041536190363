"""What every Wan model's construction and step share: where and how it serves, and how its frames decode.

Owns: :class:`Serving` (the options every Wan model takes, read in one place: ``threads``,
``device`` (refused where it is not usable), ``dtype`` (the precision served and the note saying
why when it is not the one asked), ``seed`` of random weights and ``max_batch_size``; and
:meth:`Serving.prepare`, a loaded module cast to the serving precision, on the device and frozen),
:class:`FrameDecoding` (the VAE stream, the frame decoder ``decoder=`` chose over it, and a
session's decoder bytes), :func:`batch_states` (a step's batch checked: within
``max_batch_size``, every state the model's own) and :func:`decode_to_host` (a step's latents to
uint8 frames on the host, part by part as the decoder makes them, each part handed to the step's
:data:`~worldserve.models.base.PartSink` as it lands). Must not know: any family's conditioning,
controls or files, sessions' control plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from worldserve.models.base import PartSink
from worldserve.models.precision import usable_device
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.decoders import DecoderChoice, FrameDecoder, build_frame_decoder, frame_decoder_bytes
from worldserve.models.wan.options import cast_module, option_int, resolve_dtype
from worldserve.models.wan.vae import DecoderCache, VaeStream, host_frames

__all__ = ["FrameDecoding", "Serving", "batch_states", "decode_to_host"]

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Serving:
    """Where and in what precision a model serves (``precision``: the name its spec says)."""

    model: str
    device: torch.device
    precision: str
    dtype: torch.dtype
    #: Why the precision served is not the one asked (None: it is).
    note: str | None
    #: The seed of random weights (``seed=``).
    seed: int
    max_batch_size: int

    @classmethod
    def read(
        cls,
        model: str,
        *,
        device: str,
        dtype: str,
        threads: int | str | None,
        seed: int | str,
        max_batch_size: int | str,
    ) -> Serving:
        """The options as ``--model-option`` gives them; ``threads`` is applied at once."""
        threads_count = option_int(threads, model, "threads")
        if threads_count is not None:
            torch.set_num_threads(threads_count)
        where = usable_device(device, model)
        precision, served, note = resolve_dtype(dtype, where, model)
        weight_seed = option_int(seed, model, "seed") or 0
        limit = option_int(max_batch_size, model, "max_batch_size")
        assert limit is not None
        return cls(model, where, precision, served, note, weight_seed, limit)

    @property
    def dtype_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def notes(self) -> tuple[str, ...]:
        """The spec's notes: the precision's, if any."""
        return () if self.note is None else (self.note,)

    def prepare(self, module: nn.Module, float32_parts: tuple[str, ...] = ()) -> None:
        """``module`` in the serving precision (``float32_parts`` kept in float32), on the device, frozen."""
        cast_module(module, self.dtype, float32_parts)
        module.to(self.device).eval().requires_grad_(False)


@dataclass(frozen=True, slots=True)
class FrameDecoding:
    """The VAE stream (the start image's encoder either way), the frame decoder, a session's decoder bytes."""

    choice: DecoderChoice
    vae: VaeStream
    decoder: FrameDecoder
    cache_bytes: int

    @classmethod
    def build(
        cls, choice: DecoderChoice, autoencoder: nn.Module, config: WanCausalConfig, serving: Serving
    ) -> FrameDecoding:
        vae = VaeStream(autoencoder)
        decoder = build_frame_decoder(choice, vae, config, serving.device, serving.dtype, serving.seed)
        return cls(choice, vae, decoder, frame_decoder_bytes(choice, config, serving.dtype_bytes))


def batch_states(batch: Sequence[tuple[Any, Any]], serving: Serving, kind: type[S]) -> list[S]:
    """The states of a step's ``batch``: refused past ``max_batch_size``, or when one is not a ``kind``."""
    if len(batch) > serving.max_batch_size:
        raise ValueError(f"batch of {len(batch)} exceeds max_batch_size {serving.max_batch_size}")
    states: list[S] = []
    for state, _ in batch:
        if not isinstance(state, kind):
            raise TypeError(f"{serving.model} got a foreign state: {type(state).__name__}")
        states.append(state)
    return states


def decode_to_host(
    decoder: FrameDecoder,
    latents: Tensor,
    caches: Sequence[DecoderCache],
    firsts: Sequence[bool],
    held: Sequence[int],
    on_part: PartSink | None = None,
) -> list[npt.NDArray[np.uint8]]:
    """Each row's frames ``uint8 [T, H, W, 3]``, decoded part by part (a latent frame each, through the
    VAE) and moved to the host once per part; ``on_part(row, frames)`` hears each row's part as it lands.

    ``held[row]`` copies of a row's first frame open its chunk (a first block's first latent frame
    decodes to one frame: the models show it longer so that every chunk has the same length). The
    caches advance as :meth:`~worldserve.models.wan.vae.VaeStream.decode_parts` advances them.
    """
    frames: list[list[npt.NDArray[np.uint8]]] = [[] for _ in caches]
    for index, part in enumerate(decoder.decode_parts(latents, caches, firsts)):
        if index == 0:
            part = [
                torch.cat([video[:, :1].expand(-1, count, -1, -1), video], dim=1) if count else video
                for video, count in zip(part, held, strict=True)
            ]
        if len({video.shape for video in part}) == 1:
            host = list(host_frames(torch.stack(part)))  # [B, t, H, W, 3]: leaves the device once
        else:
            host = [host_frames(video[None])[0] for video in part]
        for row, rows_frames in enumerate(host):
            frames[row].append(rows_frames)
            if on_part is not None:
                on_part(row, rows_frames)
    return [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in frames]
