"""The prompt encoder: hashed word embeddings, so any text works and nothing downloads.

Owns: :func:`tokenize` (lower-case words, each hashed twice into a fixed number of
buckets with a stable hash; unknown words simply land in some bucket) and
:class:`TextEncoder` (a sum of the words' bucket embeddings, normalised, through a small
MLP). Must not know: styles or the world (it learns which words matter from training).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["TextEncoder", "tokenize"]

_WORD = re.compile(r"[a-z0-9]+")


def tokenize(prompt: str | None, buckets: int, max_words: int) -> list[int]:
    """Bucket ids (two per word, 1-based; 0 pads) of a prompt's first ``max_words`` words."""
    ids: list[int] = []
    for word in _WORD.findall((prompt or "").lower())[:max_words]:
        data = word.encode()
        ids.append(1 + zlib.crc32(data) % (buckets - 1))
        ids.append(1 + zlib.crc32(data, 0x9E3779B9) % (buckets - 1))
    return ids


def tokenize_batch(prompts: Sequence[str | None], buckets: int, max_words: int) -> Tensor:
    """``int64 [len(prompts), 2 * max_words]`` bucket ids, zero-padded."""
    out = torch.zeros(len(prompts), 2 * max_words, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids = tokenize(prompt, buckets, max_words)
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


class TextEncoder(nn.Module):
    """Bag of hashed words -> one conditioning vector per prompt."""

    def __init__(self, buckets: int, text_dim: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(buckets, text_dim, padding_idx=0)
        nn.init.normal_(self.embed.weight, std=0.3)
        with torch.no_grad():
            self.embed.weight[0].zero_()
        self.empty = nn.Parameter(torch.zeros(text_dim))
        self.norm = nn.LayerNorm(text_dim)
        self.mlp = nn.Sequential(nn.Linear(text_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, ids: Tensor) -> Tensor:
        """``ids`` ``int64 [..., words]`` -> ``[..., dim]``."""
        summed = self.embed(ids).sum(dim=-2)
        count = (ids > 0).sum(dim=-1, keepdim=True)
        pooled = torch.where(count > 0, summed / count.clamp(min=1).to(summed.dtype).sqrt(), self.empty)
        out: Tensor = self.mlp(self.norm(pooled))
        return out
