"""Which decoder turns a session's latents into frames: Wan2.1's causal VAE or TAEHV.

Owns: :class:`DecoderChoice` and :func:`choose_decoder` (the options ``decoder=vae|taehv`` and
``taehv=PATH|random``, with ``weights=DIR``'s ``taew2_1.pth`` (``taew2_2.pth`` for a model on
Wan2.2's latents) found by name but used only with
``decoder=taehv``; TAEHV without a file is an error for a trained checkpoint unless
``taehv=random`` is given, and random weights by default with ``load=dummy``, as ``vae=random``
is), :func:`build_frame_decoder` (the chosen decoder, loaded, on the device and in the serving
precision, for the configuration's latent space: Wan2.2's 16x VAE (``vae_patch`` 2) takes
TAEHV's Wan2.2 variant; the VAE stays the start image's encoder either way) and :func:`frame_decoder_bytes`
(a session's decoder state, for ``state_bytes``). Shared by ``wan-causal`` and ``matrix-game-2``.
Must not know: sessions, the sampler, the transformer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from worldserve.models.wan.build import seeded_init
from worldserve.models.wan.config import WanCausalConfig
from worldserve.models.wan.files import TAEHV_FILE, find_taehv
from worldserve.models.wan.statedict import WeightsError
from worldserve.models.wan.taehv import TaehvDecoder, TaehvStream, load_taehv_weights, taehv_state_bytes
from worldserve.models.wan.vae import VaeStream, decoder_cache_bytes

__all__ = ["DECODERS", "DecoderChoice", "FrameDecoder", "build_frame_decoder", "choose_decoder", "frame_decoder_bytes"]

DECODERS = ("vae", "taehv")
#: What the adapters decode with: both keep a session's state as a list swapped in at commit.
FrameDecoder = VaeStream | TaehvStream


@dataclass(frozen=True, slots=True)
class DecoderChoice:
    """``kind``: ``vae`` or ``taehv``; ``taehv``: TAEHV's file (None with ``taehv``: random weights)."""

    kind: str = "vae"
    taehv: Path | None = None

    def describe(self) -> str | None:
        """The description's words for a TAEHV decoder (None: the VAE, said elsewhere)."""
        if self.kind != "taehv":
            return None
        source = f"weights {self.taehv.name}" if self.taehv is not None else "random weights"
        return f"decoder: TAEHV ({source}; a tiny per-frame decoder, cheaper than the VAE, slightly lower quality)"


def choose_decoder(
    decoder: str | None,
    taehv: str | None,
    weights: str | None,
    *,
    trained: bool,
    model: str,
    taehv_file: str = TAEHV_FILE,
) -> DecoderChoice:
    """The decoder the options ask for (see the module); ``trained``: the transformer is a checkpoint's;
    ``taehv_file``: the published TAEHV file the model's latents take (looked for under ``weights``)."""
    kind = decoder if decoder is not None else "vae"
    if kind not in DECODERS:
        raise ValueError(f"{model} option decoder must be one of {', '.join(DECODERS)}; got {decoder!r}.")
    if kind != "taehv":
        if taehv is not None:
            raise ValueError(f"{model} option taehv= is TAEHV's weights: it needs decoder=taehv.")
        return DecoderChoice()
    if taehv == "random":
        return DecoderChoice("taehv")
    if taehv is not None:
        return DecoderChoice("taehv", Path(taehv))
    found = find_taehv(weights, taehv_file) if weights is not None else None
    if found is not None:
        return DecoderChoice("taehv", found)
    if trained:
        where = f"weights={weights} holds no {taehv_file}; " if weights is not None else ""
        raise WeightsError(
            f"{model} decoder=taehv: {where}pass taehv=PATH (TAEHV's {taehv_file}, madebyollin/taehv), "
            "or taehv=random to decode with random weights."
        )
    return DecoderChoice("taehv")  # random weights throughout (load=dummy): the stand-in, said in the description


def build_frame_decoder(
    choice: DecoderChoice, vae: VaeStream, config: WanCausalConfig, device: torch.device, dtype: torch.dtype, seed: int
) -> FrameDecoder:
    """The decoder ``choice`` names, ready to decode (``vae`` is returned as it is for ``decoder=vae``)."""
    if choice.kind != "taehv":
        return vae
    with seeded_init(device, seed):
        module = TaehvDecoder(config.latent_channels, patch=config.vae_patch)
    if choice.taehv is not None:
        load_taehv_weights(choice.taehv, module)
    module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return TaehvStream(module)


def frame_decoder_bytes(choice: DecoderChoice, config: WanCausalConfig, dtype_bytes: int) -> int:
    """Bytes of one session's decoder state under ``choice``."""
    if choice.kind == "taehv":
        return taehv_state_bytes(config.latent_height, config.latent_width, dtype_bytes)
    return decoder_cache_bytes(config, dtype_bytes)
