"""Prompt text -> the transformer's text embeddings, cached per prompt.

Owns: :class:`PromptEmbedder`. With an encoder (transformers' ``UMT5EncoderModel``, loaded
by :mod:`~worldserve.models.wan.t5` from either published layout) and its tokenizer, it
cleans the prompt as Wan does (``clean='whitespace'``), pads to ``text_len`` and zeroes the
padding positions, as Wan does. Without one, a
documented deterministic embedding stands in so the path runs with nothing downloaded:
each lower-case word (``[a-z0-9]+``, at most ``text_len``) becomes a standard-normal vector
from a generator seeded by the word's CRC-32, scaled by 1/sqrt(text_dim); padding positions
are zero. Embeddings live on the model's device, at most ``capacity`` prompts, least
recently used dropped first. Must not know: the transformer, sessions.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from worldserve.models.wan.t5 import clean_prompt

__all__ = ["PromptEmbedder", "hashed_embedding"]

_WORD = re.compile(r"[a-z0-9]+")


def hashed_embedding(prompt: str, text_len: int, text_dim: int) -> Tensor:
    """The deterministic stand-in embedding ``[text_len, text_dim]`` (float32, CPU)."""
    out = torch.zeros(text_len, text_dim)
    for index, word in enumerate(_WORD.findall(prompt.lower())[:text_len]):
        generator = torch.Generator().manual_seed(zlib.crc32(word.encode()))
        out[index] = torch.randn(text_dim, generator=generator) / math.sqrt(text_dim)
    return out


class PromptEmbedder:
    """Embeddings for prompts, computed once per prompt and kept on ``device``."""

    def __init__(
        self,
        text_len: int,
        text_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        encoder: Any = None,
        tokenizer: Any = None,
        capacity: int = 64,
    ) -> None:
        self.text_len = text_len
        self.text_dim = text_dim
        self.device = device
        self.dtype = dtype
        self.capacity = capacity
        self._cache: OrderedDict[str, Tensor] = OrderedDict()
        if (encoder is None) != (tokenizer is None):
            raise ValueError("a text encoder needs its tokenizer, and a tokenizer its encoder.")
        self._tokenizer: Any = tokenizer
        self._encoder: Any = encoder
        if encoder is not None:
            self._encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
            hidden = int(self._encoder.config.d_model)
            if hidden != text_dim:
                raise ValueError(f"the text encoder gives {hidden}-dim states; the transformer takes {text_dim}.")

    @property
    def kind(self) -> str:
        return "umt5" if self._encoder is not None else "hashed"

    def __call__(self, prompts: Sequence[str]) -> Tensor:
        """``[B, text_len, text_dim]`` for ``prompts``."""
        return torch.stack([self.one(prompt) for prompt in prompts])

    def one(self, prompt: str) -> Tensor:
        cached = self._cache.get(prompt)
        if cached is not None:
            self._cache.move_to_end(prompt)
            return cached
        embedding = self._encode(prompt)
        self._cache[prompt] = embedding
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return embedding

    @torch.no_grad()
    def _encode(self, prompt: str) -> Tensor:
        if self._encoder is None:
            return hashed_embedding(prompt, self.text_len, self.text_dim).to(self.device, self.dtype)
        tokens = self._tokenizer(
            [clean_prompt(prompt)], padding="max_length", max_length=self.text_len, truncation=True, return_tensors="pt"
        )
        ids = tokens.input_ids.to(self.device)
        mask = tokens.attention_mask.to(self.device)
        states: Tensor = self._encoder(ids, mask).last_hidden_state[0]
        embedding: Tensor = (states * mask[0, :, None]).to(self.dtype)
        return embedding
