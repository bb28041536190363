"""TAEHV (madebyollin/taehv, MIT): a tiny per-frame decoder for Wan2.1's or Wan2.2's latents, streamed.

Owns: :class:`TaehvDecoder` (the published decoder: 2D convolutions per frame, three groups of
three memory blocks that also see the previous frame's input, nearest 2x upsampling and a 2x
temporal grow in the last two groups, so ``F`` latent frames make ``4F`` frames at 8x the size;
for Wan2.2's latents (``taew2_2.pth``: 48 channels, ``patch`` 2) the last convolution makes
``3 * 2 * 2`` channels that a pixel shuffle turns into 2x2 pixels, 16x the size, as the
published ``patch_size`` does; its parameters are named as the published ``TAEHV.decoder``
``nn.Sequential`` names them, so a ``taew2_1.pth`` / ``taew2_2.pth`` state dict loads key by
key), :data:`VARIANTS` and :func:`taehv_variant` (which latent space a file decodes, read from its
shapes: the first convolution's input channels and the last one's output channels),
:class:`TaehvStream` (the same interface as
:class:`~worldserve.models.wan.vae.VaeStream`'s decode: a session's decoder state is a
list with one entry per memory block, the last frame that block saw, None before the first
chunk; a batch's entries are stacked for one pass over every frame of the chunk and each row's
new entries are fresh tensors, so a step that fails leaves the old list untouched; a session's
first chunk drops the first 3 frames, as the published one-shot decode trims them, which aligns
the frames with the VAE's ``1 + 4(F - 1)``), :func:`load_taehv_weights` (strict: every decoder
key with its shape; the file's ``encoder.*`` keys are not needed and skipped; a file for the
other Wan's latents, or one that is neither (the ``_super`` decoders, another model's TAEHV),
is refused saying what it is) and
:func:`taehv_state_bytes`. Latents go in normalised (as the transformer makes them: the
published wrapper's mean is 0, std 1). Must not know: the transformer, sessions, the VAE.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from worldserve.models.wan.statedict import WeightsError, check_shapes, part_errors, read_tensors

__all__ = [
    "PUBLISHED_WIDTHS",
    "VARIANTS",
    "TaehvDecoder",
    "TaehvStream",
    "TaehvVariant",
    "load_taehv_weights",
    "taehv_state_bytes",
    "taehv_variant",
    "variant_for",
]

#: Channel widths of the published decoder's three groups and its last convolution.
PUBLISHED_WIDTHS = (256, 128, 64, 64)
#: The published decoder's temporal grow per group (the first group's is disabled for Wan2.1).
_TIME_GROW = (1, 2, 2)
_PART = "TAEHV decoder"


@dataclass(frozen=True, slots=True)
class TaehvVariant:
    """One published TAEHV for a Wan latent space: its file, latent channels and pixel patch."""

    name: str
    file: str
    latent_channels: int
    patch: int

    def says(self) -> str:
        return f"{self.file} ({self.name}'s latents: {self.latent_channels} channels, {8 * self.patch}x spatial)"


#: The published decoders for Wan latents (madebyollin/taehv ``TAEHV.__init__``: ``taew2_2`` sets
#: ``patch_size, latent_channels = 2, 48``; the default is 1 and 16, Wan2.1's).
VARIANTS = (TaehvVariant("Wan2.1", "taew2_1.pth", 16, 1), TaehvVariant("Wan2.2", "taew2_2.pth", 48, 2))


def variant_for(patch: int) -> TaehvVariant:
    """The published variant whose output patch is ``patch`` (1: Wan2.1's 8x VAE, 2: Wan2.2's 16x)."""
    for variant in VARIANTS:
        if variant.patch == patch:
            return variant
    raise ValueError(f"TAEHV decodes Wan latents at 8x or 16x spatial (patch 1 or 2); got patch {patch}.")


def _expected(module: TaehvDecoder) -> str:
    """What ``taehv=`` is expected to be for ``module``, as every load error of it says."""
    return f"madebyollin's TAEHV decoder for {variant_for(module.patch).says()} (or .safetensors)"


#: One session's decoder state: per memory block, the last frame it saw ([C, H, W]) or None.
TaehvCache = list[Any]


def _conv(n_in: int, n_out: int, *, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class _Clamp(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x / 3) * 3


class _Memory(nn.Module):
    """A residual block over the frame and the previous frame's input (published name: ``MemBlock``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            _conv(2 * width, width), nn.ReLU(), _conv(width, width), nn.ReLU(), _conv(width, width)
        )
        self.skip = nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: Tensor, past: Tensor) -> Tensor:
        out: Tensor = self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))
        return out


class _Grow(nn.Module):
    """Each frame -> ``stride`` frames by a 1x1 convolution (published name: ``TGrow``)."""

    def __init__(self, width: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(width, width * stride, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        _, channels, height, width = x.shape
        out: Tensor = self.conv(x).reshape(-1, channels, height, width)
        return out


class TaehvDecoder(nn.Module):
    """The published decoder's layers, under ``decoder.N`` as the published ``TAEHV`` names them."""

    def __init__(
        self, latent_channels: int = 16, widths: tuple[int, int, int, int] = PUBLISHED_WIDTHS, *, patch: int = 1
    ) -> None:
        super().__init__()
        variant_for(patch)  # 1 or 2
        layers: list[nn.Module] = [_Clamp(), _conv(latent_channels, widths[0]), nn.ReLU()]
        for group in range(3):
            width = widths[group]
            layers += [_Memory(width), _Memory(width), _Memory(width)]
            layers += [
                nn.Upsample(scale_factor=2),
                _Grow(width, _TIME_GROW[group]),
                _conv(width, widths[group + 1], bias=False),
            ]
        layers += [nn.ReLU(), _conv(widths[3], 3 * patch * patch)]
        self.decoder = nn.Sequential(*layers)
        self.latent_channels = latent_channels
        #: Pixels per output value along height and width (2: Wan2.2's, RGB in 2x2 pixel-shuffled patches).
        self.patch = patch
        self.memories = sum(isinstance(layer, _Memory) for layer in layers)
        #: Frames the first chunk's decode drops (the published ``frames_to_trim``).
        self.trim = 4 - 1

    def run(self, latents: Tensor, memory: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``latents`` ``[N, T, C, h, w]`` and each memory block's previous frame ``[N, C, H, W]`` ->
        frames ``[N, 4T, 3, 8ph, 8pw]`` (``p``: :attr:`patch`) in [0, 1] and each block's new last frame
        (one pass over all frames)."""
        rows, frames = latents.shape[:2]
        x = latents.reshape(rows * frames, *latents.shape[2:])
        last: list[Tensor] = []
        for layer in self.decoder:
            if isinstance(layer, _Memory):
                seen = x.reshape(rows, frames, *x.shape[1:])
                past = torch.cat([memory[len(last)][:, None], seen[:, :-1]], 1).reshape(x.shape)
                last.append(seen[:, -1])
                x = layer(x, past)
            else:
                x = layer(x)
                if isinstance(layer, _Grow):
                    frames *= layer.stride
        if self.patch > 1:
            x = nn.functional.pixel_shuffle(x, self.patch)
        return x.reshape(rows, frames, *x.shape[1:]).clamp(0.0, 1.0), last


class TaehvStream:
    """Streaming, batched decode of chunks of latent frames with a :class:`TaehvDecoder` (see the module)."""

    def __init__(self, module: TaehvDecoder) -> None:
        self.module = module

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def new_cache(self) -> TaehvCache:
        return [None] * self.module.memories

    def _memory(self, caches: Sequence[TaehvCache], latents: Tensor) -> list[Tensor]:
        """Each memory block's previous frames stacked over the batch (zeros where a session has none yet)."""
        shapes = _memory_shapes(self.module, latents.shape[-3:])
        stacked = []
        for block, shape in enumerate(shapes):
            rows = [
                cache[block] if cache[block] is not None else latents.new_zeros(shape, dtype=self.dtype)
                for cache in caches
            ]
            stacked.append(torch.stack(rows))
        return stacked

    def decode_rows(self, latents: Tensor, caches: Sequence[TaehvCache], firsts: Sequence[bool]) -> list[Tensor]:
        """One pass over the batch, rows at their first chunk or past it alike; each row's video
        ``[3, T, H, W]`` in [-1, 1] (``4F`` frames, ``4F - 3`` at the first chunk), the caches advanced."""
        x = latents.to(self.dtype).transpose(1, 2)  # [B, F, C, h, w]
        frames, last = self.module.run(x, self._memory(caches, latents))
        videos = []
        for row, (cache, first) in enumerate(zip(caches, firsts, strict=True)):
            for block, seen in enumerate(last):
                cache[block] = seen[row].clone()  # a fresh tensor: the list given is rebound, never written into
            video = frames[row, self.module.trim :] if first else frames[row]
            videos.append(video.transpose(0, 1) * 2.0 - 1.0)
        return videos

    def decode_parts(
        self, latents: Tensor, caches: Sequence[TaehvCache], firsts: Sequence[bool]
    ) -> Iterator[list[Tensor]]:
        """:meth:`decode_rows` as one part: TAEHV decodes a block's latent frames in one pass."""
        yield self.decode_rows(latents, caches, firsts)

    def decode(self, latents: Tensor, caches: Sequence[TaehvCache], *, first: bool = False) -> Tensor:
        """:meth:`decode_rows` of a batch all at their first chunk or all past it: ``[B, 3, T, H, W]`` in [-1, 1]."""
        return torch.stack(self.decode_rows(latents, caches, [first] * len(caches)))

    @staticmethod
    def nbytes(cache: TaehvCache) -> int:
        return sum(entry.numel() * entry.element_size() for entry in cache if isinstance(entry, Tensor))


def _memory_shapes(module: TaehvDecoder, latent: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[C, H, W]`` of each memory block's input for latent frames ``[C, h, w]``."""
    height, width = int(latent[1]), int(latent[2])
    channels = int(latent[0])
    shapes = []
    for layer in module.decoder:
        if isinstance(layer, nn.Conv2d):
            channels = layer.out_channels
        elif isinstance(layer, _Memory):
            shapes.append((channels, height, width))
        elif isinstance(layer, nn.Upsample):
            height, width = 2 * height, 2 * width
    return shapes


def taehv_state_bytes(latent_height: int, latent_width: int, dtype_bytes: int) -> int:
    """Bytes of one session's TAEHV state at the published widths (every memory block's last frame)."""
    per_group = (PUBLISHED_WIDTHS[g] * (latent_height << g) * (latent_width << g) for g in range(3))
    return 3 * sum(per_group) * dtype_bytes


def expected_shapes(module: TaehvDecoder) -> dict[str, tuple[int, ...]]:
    return {f"decoder.{key}": tuple(value.shape) for key, value in module.decoder.state_dict().items()}


def taehv_variant(tensors: Mapping[str, Tensor]) -> TaehvVariant | None:
    """The published variant a TAEHV state dict's shapes are (None: neither): its latent channels
    (the first convolution's input, ``decoder.1.weight``) at any count, its output patch from the
    last convolution's ``3 * patch * patch`` output channels."""
    first = tensors.get("decoder.1.weight")
    outs = [key for key in tensors if key.startswith("decoder.") and key.endswith(".bias")]
    if first is None or first.ndim != 4 or not outs:
        return None
    last = max(outs, key=lambda key: int(key.split(".")[1]) if key.split(".")[1].isdigit() else -1)
    for variant in VARIANTS:
        if tensors[last].shape == (3 * variant.patch * variant.patch,):
            return variant
    return None


def _check_variant(found: Mapping[str, Tensor], module: TaehvDecoder, path: Path) -> None:
    """The file's latent space is the model's: a Wan2.1 file for Wan2.2's latents (or back) is named as such."""
    want = variant_for(module.patch)
    variant = taehv_variant(found)
    if variant is None:
        raise WeightsError(
            "not a TAEHV decoder for Wan latents: no decoder.1.weight with a last convolution making 3 (Wan2.1) or "
            "12 (Wan2.2, 2x2 patches) channels (the _super decoders and other models' TAEHVs are not served)",
            path=path,
        )
    channels = int(found["decoder.1.weight"].shape[1])
    if variant != want or channels != module.latent_channels:
        raise WeightsError(
            f"the file decodes {variant.name}'s latent space ({channels} channels, {8 * variant.patch}x spatial); "
            f"the model's latents are {want.name}'s ({module.latent_channels} channels, {8 * want.patch}x spatial)",
            path=path,
        )


def load_taehv_weights(path: str | Path, module: TaehvDecoder) -> None:
    """Load a published ``taew2_1.pth`` / ``taew2_2.pth`` (or ``.safetensors``) into ``module``: the file's
    variant must be the module's (:func:`taehv_variant`), then every decoder key with its shape, nothing
    extra but the encoder's keys; a temporal grow stored for stride 2 where the model's is stride 1 keeps
    its last frame's channels, as the published loader does. Errors name the part and the file."""
    path = Path(path)
    with part_errors(_PART, path, _expected(module)):
        tensors = read_tensors(path)
        found = {key: value for key, value in tensors.items() if not key.startswith("encoder.")}
        _check_variant(found, module, path)
        expected = expected_shapes(module)
        for index, layer in enumerate(module.decoder):
            key = f"decoder.{index}.conv.weight"
            if isinstance(layer, _Grow) and key in found:
                rows = expected[key][0]
                if found[key].shape[0] > rows and found[key].shape[1:] == expected[key][1:]:
                    found[key] = found[key][-rows:]
        check_shapes(found, expected, where=str(path), part="the file")
        state = {key.removeprefix("decoder."): value for key, value in found.items()}
        try:
            module.decoder.load_state_dict(state, strict=True)
        except RuntimeError as error:  # pragma: no cover - check_shapes has named every mismatch already
            raise WeightsError(str(error), path=path) from None
