"""tinyworld's hyper-parameters: one frozen dataclass, stored in the weights file's metadata.

Owns: :class:`TinyWorldConfig` (frame size, chunk length, token stride, widths, the KV-cache
window, the few-step noise schedule, whether the learned motion path is on) and its JSON
round trip. Must not know: torch, training, sessions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["TinyWorldConfig"]


@dataclass(frozen=True, slots=True)
class TinyWorldConfig:
    """Sizes of the network, its cache and its sampler."""

    height: int = 48
    width: int = 48
    frames_per_chunk: int = 4
    fps: float = 16.0
    #: Token stride of the conv encoder: one transformer token per ``patch x patch`` pixels.
    patch: int = 8
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 3.0
    #: Conv channels at strides 1, 2 and 4 (the encoder's skips into the decoder).
    channels: tuple[int, int, int] = (16, 32, 64)
    text_buckets: int = 4096
    text_dim: int = 64
    max_words: int = 16
    #: Keyframes in the sliding window; the start frame (the attention sink) is kept besides.
    window: int = 3
    #: Largest displacement (px, per axis) the motion path can express within a chunk.
    max_shift: int = 16
    #: The learned motion path (a displacement-conditioned, separable shift kernel applied to the
    #: last keyframe, composited with the generated frame). ``False`` is the ablation.
    motion_path: bool = True
    #: Noise levels of the few-step sampler (rectified flow, x0 prediction), first to last.
    steps: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)

    def __post_init__(self) -> None:
        if self.height % self.patch or self.width % self.patch:
            raise ValueError("frame size must be a multiple of the patch size")
        if self.patch != 8:
            raise ValueError("the conv encoder has three stride-2 stages: patch must be 8")
        if self.dim % self.heads:
            raise ValueError("dim must be a multiple of heads")
        if not 1 <= len(self.steps) <= 4 or any(not 0.0 < t <= 1.0 for t in self.steps):
            raise ValueError("steps must be 1 to 4 noise levels in (0, 1]")
        if self.window < 1:
            raise ValueError("window must hold at least one keyframe")

    @property
    def tokens_per_frame(self) -> int:
        return (self.height // self.patch) * (self.width // self.patch)

    @property
    def cache_slots(self) -> int:
        """Keyframes a session's KV cache holds: the sink plus the window."""
        return 1 + self.window

    def cache_bytes(self) -> int:
        """Bytes of one session's float32 KV cache (keys and values of every layer)."""
        return 2 * self.depth * self.cache_slots * self.tokens_per_frame * self.dim * 4

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TinyWorldConfig:
        raw: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in raw.items() if key in known}
        for key in ("channels", "steps"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)
