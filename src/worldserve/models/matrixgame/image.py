"""Matrix-Game 2.0's image conditioning: the start image's CLIP features and VAE latents.

Owns: :func:`build_image_encoder` (transformers' ``CLIPVisionModel`` of a :class:`ClipConfig`),
:class:`ImageEncoder` (the start image -> the features the cross-attention reads: resized to the
encoder's square input (bicubic), mapped from [-1, 1] to [0, 1] and normalised with CLIP's mean
and std, the hidden states after all blocks but the last: Wan's ``encode_video`` with
``use_31_block``) and :class:`ImageLatents` (what the patch embedding reads beside the noisy
latents at every latent frame: a 4-channel mask, 1 at the first latent frame and 0 after, and the
VAE latents of the start image followed by blank (zero) frames, as the reference encodes
``[image, 0, 0, ...]`` in one causal pass). The causal encoder is driven as a stream (the
library's own chunks: the image alone, then 4 blank frames at a time) until its feature cache no
longer changes; from then on every latent frame's latents are the same, exactly, so a session's
image latents are that prefix and its last frame repeated, for a session of any length (the
reference encodes a fixed length up front). Must not know: the transformer, sessions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.matrixgame.config import ClipConfig, MatrixGameConfig
from worldserve.models.wan.vae import VaeStream

__all__ = ["CLIP_MEAN", "CLIP_STD", "ImageEncoder", "ImageLatents", "build_image_encoder", "encode_image_latents"]

#: CLIP's input normalisation (Wan's ``clip.py``: OpenAI CLIP's mean and std).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: Latent frames encoded at most while looking for the encoder's fixed point (Wan's VAE reaches it in ~30).
MAX_IMAGE_FRAMES = 96


def build_image_encoder(config: ClipConfig) -> nn.Module:
    """A randomly initialised ``CLIPVisionModel`` (ViT, GELU, LayerNorm eps 1e-5) of ``config``'s size."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    vision = CLIPVisionConfig(
        hidden_size=config.dim,
        intermediate_size=config.mlp_dim,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        image_size=config.image_size,
        patch_size=config.patch,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        num_channels=3,
    )
    model: nn.Module = CLIPVisionModel(vision)
    return model


class ImageEncoder:
    """The start image -> ``[1, tokens, dim]``: the CLIP features Matrix-Game's cross-attention reads."""

    def __init__(self, model: nn.Module, config: ClipConfig) -> None:
        self.model: Any = model
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        weight: Tensor = next(self.model.parameters())
        return weight.dtype

    def __call__(self, pixels: Tensor) -> Tensor:
        """``pixels`` ``[1, 3, H, W]`` in [-1, 1]."""
        size = (self.config.image_size, self.config.image_size)
        resized = F.interpolate(pixels.float(), size=size, mode="bicubic", align_corners=False)
        mean = torch.tensor(CLIP_MEAN, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, device=pixels.device).view(1, 3, 1, 1)
        normalised = (resized * 0.5 + 0.5 - mean) / std
        out = self.model(pixel_values=normalised.to(self.dtype), output_hidden_states=True)
        features: Tensor = out.hidden_states[-2]  # after every block but the last
        return features


class ImageLatents:
    """One session's image conditioning per latent frame: the frames up to the encoder's fixed point."""

    __slots__ = ("latents", "mask_channels")

    def __init__(self, latents: Tensor, mask_channels: int) -> None:
        #: ``[1, C, F, h, w]``: frame 0 the image's, then the blank frames' until they repeat (the last).
        self.latents = latents
        self.mask_channels = mask_channels

    def frames(self, first: int, count: int) -> Tensor:
        """``[1, mask + C, count, h, w]`` for latent frames ``first .. first + count - 1``."""
        last = self.latents.shape[2] - 1
        index = torch.tensor([min(f, last) for f in range(first, first + count)], device=self.latents.device)
        image = self.latents.index_select(2, index)
        mask = torch.zeros(1, self.mask_channels, count, *image.shape[3:], device=image.device, dtype=image.dtype)
        if first == 0:
            mask[:, :, 0] = 1.0
        return torch.cat([mask, image], dim=1)

    @property
    def nbytes(self) -> int:
        return self.latents.numel() * self.latents.element_size()


def encode_image_latents(
    vae: VaeStream, pixels: Tensor, config: MatrixGameConfig, limit: int = MAX_IMAGE_FRAMES
) -> ImageLatents:
    """The start image ``pixels`` ``[1, 3, H, W]`` in [-1, 1], then blank frames, through the causal encoder
    as a stream, until its feature cache stops changing (see the module docstring)."""
    cache = vae.new_encoder_cache()
    frames = [vae.encode_chunk(pixels[:, :, None], cache)]
    blank = torch.zeros(1, 3, 4, pixels.shape[2], pixels.shape[3], device=pixels.device, dtype=pixels.dtype)
    while len(frames) < limit:
        before = [entry.clone() if isinstance(entry, Tensor) else entry for entry in cache]
        frames.append(vae.encode_chunk(blank, cache))
        if _same(before, cache):
            break  # the state repeats: every later chunk's latents are this one's
    return ImageLatents(torch.cat(frames, dim=2), config.mask_channels)


def _same(before: list[Any], after: list[Any]) -> bool:
    for old, new in zip(before, after, strict=True):
        if isinstance(old, Tensor) != isinstance(new, Tensor):
            return False
        if isinstance(old, Tensor) and (old.shape != new.shape or not torch.equal(old, new)):
            return False
        if not isinstance(old, Tensor) and old != new:
            return False
    return True
