"""tinyworld's network: a conv encoder/decoder around a block-causal diffusion transformer.

Owns: :class:`TinyWorldNet` and its parts.

* Conv encoder (strides 1, 2, 4, then 2x2 patches): one frame -> ``(H/8)*(W/8)`` tokens,
  plus skip features for the decoder.
* Conditioning per frame (:class:`Conditioner`): noise level, the frame's control
  displacement (this frame's whole-pixel step and its cumulative displacement from the
  chunk's last keyframe), the prompt (:class:`~.text.TextEncoder`), the frame's index.
  It modulates every transformer block (adaptive LayerNorm, zero-initialised gates) and
  every conv block (FiLM).
* Transformer over keyframe tokens (clean context, one frame per chunk: the start frame,
  i.e. the attention sink, and the last frame of each generated chunk) and chunk tokens
  (the noisy frames being denoised). Attention is block-causal with a sliding window
  (:func:`keyframe_window`): the same rule in the full-sequence forward (a mask) and in the
  cached serving path (what the cache holds), which is what makes them equal.
* The motion path (:class:`MotionPath`, optional): a per-axis softmax kernel predicted by
  an MLP from the cumulative displacement, applied as a separable convolution to the last
  keyframe; the decoder predicts a per-pixel mask compositing that shifted keyframe with
  the generated frame (as in CDNA, Finn et al. 2016). The mapping from displacement to
  shift is learned, but the form (one global translation per frame) is an architectural
  prior; ``TinyWorldConfig.motion_path=False`` removes it for the ablation.

Pixels are floats in ``[-1, 1]``. Must not know: sessions, ticks, numpy, training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.tinyworld.config import TinyWorldConfig
from worldserve.models.tinyworld.text import TextEncoder

__all__ = ["ChunkInputs", "KeyframeInputs", "TinyWorldNet", "keyframe_window", "sequence_masks"]

#: Conditioning features per frame: (step dx, step dy, cumulative dx, cumulative dy), in px.
CONTROL_FEATURES = 4


def keyframe_window(index: int, window: int) -> list[int]:
    """Keyframes visible to keyframe ``index`` (besides itself) and to the chunk after keyframe ``index - 1``.

    Keyframe 0 is the start frame, the attention sink, always visible; then the ``window``
    keyframes before ``index``. Chunk ``n`` (1-based) sees ``keyframe_window(n, window)``.
    """
    if index <= 0:
        return []
    return [0, *range(max(1, index - window), index)]


def sequence_masks(chunks: int, window: int, tokens_per_frame: int, frames_per_chunk: int) -> tuple[Tensor, Tensor]:
    """Boolean attention masks (True = may attend) of the full-sequence layout.

    Keyframes ``0 .. chunks-1`` attend among themselves: keyframe ``j`` sees
    :func:`keyframe_window` ``(j)`` and itself -> ``[chunks * P, chunks * P]``. Chunk ``n``
    (0-based, so chunk number ``n + 1``) sees ``keyframe_window(n + 1)`` and all of its own
    tokens; its keys are ``[all keyframes, own tokens]`` -> ``[chunks, 1, chunks * P + F * P]``.
    No token attends to another chunk's noisy tokens, so this equals one masked attention
    over the whole sequence, and it is what the KV cache serves.
    """
    p = tokens_per_frame
    keyframes = torch.zeros(chunks * p, chunks * p, dtype=torch.bool)
    for j in range(chunks):
        rows = slice(j * p, (j + 1) * p)
        keyframes[rows, rows] = True
        for k in keyframe_window(j, window):
            keyframes[rows, k * p : (k + 1) * p] = True
    chunk = torch.zeros(chunks, 1, chunks * p + frames_per_chunk * p, dtype=torch.bool)
    chunk[:, :, chunks * p :] = True
    for n in range(chunks):
        for k in keyframe_window(n + 1, window):
            chunk[n, :, k * p : (k + 1) * p] = True
    return keyframes, chunk


@dataclass(slots=True)
class KeyframeInputs:
    """Clean context frames and their conditioning, ``B`` sequences of ``N`` keyframes."""

    frames: Tensor  # [B, N, 3, H, W]
    text: Tensor  # int64 [B, N, words]
    controls: Tensor  # [B, N, 4]: the keyframe's own step and cumulative displacement in its chunk


@dataclass(slots=True)
class ChunkInputs:
    """Noisy chunks and their conditioning, ``B`` sequences of ``N`` chunks of ``F`` frames."""

    noisy: Tensor  # [B, N, F, 3, H, W]
    t: Tensor  # [B, N] noise level
    text: Tensor  # int64 [B, N, words]
    controls: Tensor  # [B, N, F, 4]


def _timestep_features(t: Tensor, dim: int) -> Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = (t.float() * 1000.0)[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def _fourier(values: Tensor, scale: float, count: int) -> Tensor:
    """sin/cos features of ``values`` [..., k] at ``count`` frequencies -> [..., k * 2 * count]."""
    freqs = math.pi * torch.arange(1, count + 1, dtype=torch.float32, device=values.device) / scale
    angles = values.float()[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1).flatten(-2)


class Conditioner(nn.Module):
    """Per-frame conditioning vector from noise level, controls, prompt and frame role."""

    def __init__(self, config: TinyWorldConfig) -> None:
        super().__init__()
        dim = config.dim
        self.t_mlp = nn.Sequential(nn.Linear(64, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.max_shift = float(config.max_shift)
        self.control_mlp = nn.Sequential(
            nn.Linear(CONTROL_FEATURES * 2 * 8 + CONTROL_FEATURES, dim), nn.SiLU(), nn.Linear(dim, dim)
        )
        self.text = TextEncoder(config.text_buckets, config.text_dim, dim)
        # Frame roles: 0..F-1 frames of a chunk, F a keyframe, F+1 the start keyframe (sink).
        self.role = nn.Embedding(config.frames_per_chunk + 2, dim)

    def forward(self, t: Tensor, controls: Tensor, text_ids: Tensor, role: Tensor) -> Tensor:
        """``t`` [...], ``controls`` [..., 4], ``text_ids`` [..., words], ``role`` int [...] -> [..., dim]."""
        scaled = controls / torch.tensor(
            [4.0, 4.0, self.max_shift, self.max_shift], dtype=controls.dtype, device=controls.device
        )
        control_features = torch.cat([_fourier(scaled, 2.0, 8), scaled], dim=-1)
        out: Tensor = (
            self.t_mlp(_timestep_features(t, 64))
            + self.control_mlp(control_features)
            + self.text(text_ids)
            + self.role(role)
        )
        return out


class ConvBlock(nn.Module):
    """Residual conv block with FiLM conditioning (zero-initialised output)."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.film = nn.Linear(dim, 2 * channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)  # type: ignore[arg-type]  # (conv bias is typed Optional)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        """``x`` [N, C, H, W], ``cond`` [N, dim] (already SiLU-activated)."""
        h: Tensor = self.conv1(F.silu(self.norm(x)))
        scale, shift = self.film(cond).chunk(2, dim=-1)
        h = h * (1.0 + scale[..., None, None]) + shift[..., None, None]
        out: Tensor = x + self.conv2(F.silu(h))
        return out


class Encoder(nn.Module):
    """Frame (+ shifted keyframe and its validity mask) -> tokens and skip features."""

    IN_CHANNELS = 7

    def __init__(self, config: TinyWorldConfig) -> None:
        super().__init__()
        c1, c2, c3 = config.channels
        dim = config.dim
        self.stem = nn.Conv2d(self.IN_CHANNELS, c1, 3, padding=1)
        self.block1 = ConvBlock(c1, dim)
        self.down1 = nn.Conv2d(c1, c2, 3, stride=2, padding=1)
        self.block2 = ConvBlock(c2, dim)
        self.down2 = nn.Conv2d(c2, c3, 3, stride=2, padding=1)
        self.block3 = ConvBlock(c3, dim)
        self.patch = nn.Conv2d(c3, dim, 2, stride=2)

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, list[Tensor]]:
        """``x`` [N, 7, H, W] -> tokens [N, P, dim], skips at strides 1, 2, 4."""
        s1 = self.block1(self.stem(x), cond)
        s2 = self.block2(self.down1(s1), cond)
        s3 = self.block3(self.down2(s2), cond)
        tokens: Tensor = self.patch(s3)
        return tokens.flatten(2).transpose(1, 2), [s1, s2, s3]


class Decoder(nn.Module):
    """Tokens + encoder skips -> generated frame (3 channels) and a composite-mask logit."""

    def __init__(self, config: TinyWorldConfig) -> None:
        super().__init__()
        c1, c2, c3 = config.channels
        dim = config.dim
        self.grid = (config.height // config.patch, config.width // config.patch)
        self.unpatch = nn.ConvTranspose2d(dim, c3, 2, stride=2)
        self.block3 = ConvBlock(c3, dim)
        self.up2 = nn.Conv2d(c3, c2, 3, padding=1)
        self.block2 = ConvBlock(c2, dim)
        self.up1 = nn.Conv2d(c2, c1, 3, padding=1)
        self.block1 = ConvBlock(c1, dim)
        self.out = nn.Conv2d(c1, 4, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)  # type: ignore[arg-type]  # (conv bias is typed Optional)

    def forward(self, tokens: Tensor, skips: list[Tensor], cond: Tensor) -> Tensor:
        """``tokens`` [N, P, dim] -> [N, 4, H, W]."""
        s1, s2, s3 = skips
        h: Tensor = self.unpatch(tokens.transpose(1, 2).reshape(tokens.shape[0], -1, *self.grid))
        h = self.block3(h + s3, cond)
        h = self.up2(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = self.block2(h + s2, cond)
        h = self.up1(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = self.block1(h + s1, cond)
        out: Tensor = self.out(F.silu(h))
        return out


class MotionPath(nn.Module):
    """Learned separable shift kernels from cumulative displacement, applied to a keyframe."""

    def __init__(self, config: TinyWorldConfig, hidden: int = 64, freqs: int = 16) -> None:
        super().__init__()
        self.radius = config.max_shift
        self.freqs = freqs
        taps = 2 * self.radius + 1
        self.kernel_x = nn.Sequential(nn.Linear(2 * freqs, hidden), nn.SiLU(), nn.Linear(hidden, taps))
        self.kernel_y = nn.Sequential(nn.Linear(2 * freqs, hidden), nn.SiLU(), nn.Linear(hidden, taps))

    def _toeplitz(self, weights: Tensor, size: int) -> Tensor:
        """``weights`` [N, taps] -> [N, size, size] with ``T[i, j] = weights[j - i + radius]``."""
        taps = weights.shape[-1]
        index = torch.arange(size, device=weights.device)
        offsets = index[None, :] - index[:, None] + self.radius
        valid = (offsets >= 0) & (offsets < taps)
        return weights[:, offsets.clamp(0, taps - 1)] * valid

    def forward(self, keyframe: Tensor, displacement: Tensor) -> tuple[Tensor, Tensor]:
        """``keyframe`` [N, 3, H, W], ``displacement`` [N, 2] (cumulative dx, dy in px).

        Returns the shifted keyframe [N, 3, H, W] and its validity mask [N, 1, H, W]
        (the kernel mass that fell inside the keyframe: ~0 where content is newly revealed).
        """
        scale = 2.0 * self.radius + 1.0
        wx = torch.softmax(self.kernel_x(_fourier(displacement[:, :1], scale, self.freqs)), dim=-1)
        wy = torch.softmax(self.kernel_y(_fourier(displacement[:, 1:], scale, self.freqs)), dim=-1)
        ty = self._toeplitz(wy, keyframe.shape[-2])
        tx = self._toeplitz(wx, keyframe.shape[-1])
        shifted = ty[:, None] @ keyframe @ tx.transpose(1, 2)[:, None]
        mask = ty.sum(-1)[:, :, None] * tx.sum(-1)[:, None, :]
        return shifted, mask[:, None]


class Block(nn.Module):
    """Transformer block with adaptive LayerNorm (shift, scale, gate) from per-token conditioning."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def modulation(self, cond: Tensor) -> Tensor:
        """``cond`` [..., dim] (SiLU-activated) -> [..., 6, dim]."""
        out: Tensor = self.ada(cond).unflatten(-1, (6, -1))
        return out

    def keys_values(self, x: Tensor, mod: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys, values ``[B, T, dim]`` of tokens ``x`` [B, T, dim] under ``mod`` [B, T, 6, dim]."""
        h = self.norm1(x) * (1.0 + mod[:, :, 1]) + mod[:, :, 0]
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Multi-head attention of ``q`` [B, Tq, dim] over ``k, v`` [B, Tk, dim]; ``mask`` [B or 1, Tq or 1, Tk]."""
        b, tq, dim = q.shape
        heads = self.heads
        qh = q.view(b, tq, heads, -1).transpose(1, 2)
        kh = k.view(b, k.shape[1], heads, -1).transpose(1, 2)
        vh = v.view(b, v.shape[1], heads, -1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None])
        return attn.transpose(1, 2).reshape(b, tq, dim)

    def finish(self, x: Tensor, mod: Tensor, attn: Tensor) -> Tensor:
        """Residual attention output, then the MLP."""
        x = x + mod[:, :, 2] * self.proj(attn)
        h = self.norm2(x) * (1.0 + mod[:, :, 4]) + mod[:, :, 3]
        out: Tensor = x + mod[:, :, 5] * self.mlp(h)
        return out


def _per_token(per_frame: Tensor, tokens_per_frame: int) -> Tensor:
    """[B, frames, ...] -> [B, frames * tokens_per_frame, ...]."""
    return per_frame.repeat_interleave(tokens_per_frame, dim=1)


class TinyWorldNet(nn.Module):
    """The whole network; see the module docstring."""

    def __init__(self, config: TinyWorldConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.conditioner = Conditioner(config)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.motion = MotionPath(config) if config.motion_path else None
        self.pos = nn.Parameter(torch.randn(config.tokens_per_frame, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, config.heads, config.mlp_ratio) for _ in range(config.depth)])
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(dim, 2 * dim)
        nn.init.zeros_(self.ada_out.weight)
        nn.init.zeros_(self.ada_out.bias)
        self.head = nn.Linear(dim, dim)

    # -- shared pieces -------------------------------------------------------------------

    @property
    def block_list(self) -> list[Block]:
        return [cast(Block, block) for block in self.blocks]

    def _keyframe_tokens(self, frames: Tensor, cond: Tensor) -> Tensor:
        """Clean frames [M, 3, H, W], cond [M, dim] -> tokens [M, P, dim]."""
        zeros = frames.new_zeros(frames.shape[0], 4, frames.shape[2], frames.shape[3])
        tokens, _ = self.encoder(torch.cat([frames, zeros], dim=1), F.silu(cond))
        return tokens + self.pos  # type: ignore[no-any-return]

    def _chunk_tokens(
        self, noisy: Tensor, keyframe: Tensor, controls: Tensor, cond: Tensor
    ) -> tuple[Tensor, list[Tensor], Tensor | None, Tensor | None]:
        """Noisy frames and their last keyframe (both [M, 3, H, W]) -> tokens, skips, shifted keyframe, validity."""
        shifted: Tensor | None = None
        valid: Tensor | None = None
        if self.motion is not None:
            shifted, valid = self.motion(keyframe, controls[:, 2:])
            extra = torch.cat([shifted, valid], dim=1)
        else:
            extra = noisy.new_zeros(noisy.shape[0], 4, noisy.shape[2], noisy.shape[3])
        tokens, skips = self.encoder(torch.cat([noisy, extra], dim=1), F.silu(cond))
        return tokens + self.pos, skips, shifted, valid

    def _decode(self, tokens: Tensor, skips: list[Tensor], cond: Tensor, shifted: Tensor | None) -> Tensor:
        """Final-layer tokens [M, P, dim] -> x0 estimate [M, 3, H, W]."""
        shift, scale = self.ada_out(F.silu(cond))[:, None].chunk(2, dim=-1)
        h = self.head(self.norm_out(tokens) * (1.0 + scale) + shift)
        out = self.decoder(h, skips, F.silu(cond))
        generated = out[:, :3]
        if shifted is None:
            return generated  # type: ignore[no-any-return]
        keep = torch.sigmoid(out[:, 3:4])
        return keep * shifted + (1.0 - keep) * generated  # type: ignore[no-any-return]

    def _roles(self, shape: tuple[int, ...], role: int, device: torch.device) -> Tensor:
        return torch.full(shape, role, dtype=torch.int64, device=device)

    # -- full sequence, no cache (training and the correctness oracle) --------------------

    def forward(self, keyframes: KeyframeInputs, chunks: ChunkInputs) -> Tensor:
        """x0 estimates ``[B, N, F, 3, H, W]`` of every chunk in one pass with the block-causal mask.

        Chunk ``n`` (0-based here) follows keyframe ``n``; keyframe 0 is the start frame.
        """
        x0, _ = self.forward_with_motion(keyframes, chunks)
        return x0

    def forward_with_motion(self, keyframes: KeyframeInputs, chunks: ChunkInputs) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward`, plus the motion path's shifted keyframes ``[B, N, F, 4, H, W]`` (RGB + validity)."""
        config = self.config
        b, n = keyframes.frames.shape[:2]
        f = config.frames_per_chunk
        p = config.tokens_per_frame
        device = keyframes.frames.device
        kf_roles = self._roles((b, n), f, device)
        kf_roles[:, 0] = f + 1
        kf_cond = self.conditioner(
            torch.zeros(b, n, device=device), keyframes.controls, keyframes.text, kf_roles
        )  # [B, N, dim]
        ch_roles = torch.arange(f, device=device).expand(b, n, f)
        ch_cond = self.conditioner(
            chunks.t[:, :, None].expand(b, n, f),
            chunks.controls,
            chunks.text[:, :, None].expand(b, n, f, chunks.text.shape[-1]),
            ch_roles,
        )  # [B, N, F, dim]
        kf_x = self._keyframe_tokens(keyframes.frames.flatten(0, 1), kf_cond.flatten(0, 1)).reshape(b, n * p, -1)
        last_keyframe = keyframes.frames[:, :, None].expand(-1, -1, f, -1, -1, -1)
        ch_tokens, skips, shifted, valid = self._chunk_tokens(
            chunks.noisy.flatten(0, 2),
            last_keyframe.flatten(0, 2),
            chunks.controls.flatten(0, 2),
            ch_cond.flatten(0, 2),
        )
        ch_x = ch_tokens.reshape(b * n, f * p, -1)
        kf_active = F.silu(kf_cond)  # [B, N, dim]
        ch_active = F.silu(ch_cond.flatten(0, 1))  # [B * N, F, dim]
        kf_mask, ch_mask = sequence_masks(n, config.window, p, f)
        kf_mask = kf_mask.to(device)[None]
        ch_mask = ch_mask.to(device).repeat(b, 1, 1)
        for block in self.block_list:
            kf_mod = _per_token(block.modulation(kf_active), p)
            ch_mod = _per_token(block.modulation(ch_active), p)
            kf_q, kf_k, kf_v = block.keys_values(kf_x, kf_mod)
            ch_q, ch_k, ch_v = block.keys_values(ch_x, ch_mod)
            every_k = kf_k[:, None].expand(b, n, n * p, -1).reshape(b * n, n * p, -1)
            every_v = kf_v[:, None].expand(b, n, n * p, -1).reshape(b * n, n * p, -1)
            ch_attn = block.attend(ch_q, torch.cat([every_k, ch_k], dim=1), torch.cat([every_v, ch_v], dim=1), ch_mask)
            kf_x = block.finish(kf_x, kf_mod, block.attend(kf_q, kf_k, kf_v, kf_mask))
            ch_x = block.finish(ch_x, ch_mod, ch_attn)
        x0 = self._decode(
            ch_x.reshape(b * n * f, p, -1),
            skips,
            ch_cond.flatten(0, 2),
            shifted,
        )
        motion = None
        if shifted is not None and valid is not None:
            motion = torch.cat([shifted, valid], dim=1).view(b, n, f, 4, *shifted.shape[2:])
        return x0.view(b, n, f, *x0.shape[1:]), motion

    # -- cached serving path ----------------------------------------------------------------

    def encode_keyframe(
        self,
        frame: Tensor,
        text: Tensor,
        controls: Tensor,
        sink: Tensor,
        context: list[tuple[Tensor, Tensor]],
        context_valid: Tensor,
    ) -> list[tuple[Tensor, Tensor]]:
        """Keys and values (per layer, ``[B, P, dim]`` each) of new keyframes, attending to the cache.

        ``frame`` [B, 3, H, W]; ``text`` [B, words]; ``controls`` [B, 4]; ``sink`` bool [B]
        (True: this is the start frame); ``context`` per layer ``(keys, values)`` [B, S, dim]
        and ``context_valid`` bool [B, S] from :class:`~.cache.KVCache`.
        """
        config = self.config
        b = frame.shape[0]
        p = config.tokens_per_frame
        roles = torch.where(sink, config.frames_per_chunk + 1, config.frames_per_chunk).to(torch.int64)
        cond = self.conditioner(torch.zeros(b, device=frame.device), controls, text, roles)
        x = self._keyframe_tokens(frame, cond)
        active = F.silu(cond)[:, None]  # [B, 1, dim]: one frame
        mask = torch.cat([context_valid, context_valid.new_ones(b, p)], dim=1)[:, None].expand(b, p, -1)
        out: list[tuple[Tensor, Tensor]] = []
        for block, (ctx_k, ctx_v) in zip(self.block_list, context, strict=True):
            mod = _per_token(block.modulation(active), p)
            q, k, v = block.keys_values(x, mod)
            out.append((k, v))
            x = block.finish(x, mod, block.attend(q, torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1), mask))
        return out

    def chunk_conditioning(self, t: Tensor, text: Tensor, controls: Tensor) -> Tensor:
        """Per-frame conditioning ``[B, F, dim]`` of a chunk: ``t`` [B], ``text`` [B, words], ``controls`` [B, F, 4]."""
        b, f = controls.shape[:2]
        roles = torch.arange(f, device=controls.device).expand(b, f)
        out: Tensor = self.conditioner(
            t[:, None].expand(b, f), controls, text[:, None].expand(b, f, text.shape[-1]), roles
        )
        return out

    def denoise_chunk(
        self,
        noisy: Tensor,
        t: Tensor,
        text: Tensor,
        controls: Tensor,
        keyframe: Tensor,
        context: list[tuple[Tensor, Tensor]],
        context_valid: Tensor,
    ) -> Tensor:
        """x0 estimate ``[B, F, 3, H, W]`` of one chunk per session, attending to the cache.

        ``noisy`` [B, F, 3, H, W] at noise level ``t`` [B]; ``keyframe`` [B, 3, H, W] is the
        session's last keyframe (what the motion path shifts).
        """
        config = self.config
        b, f = noisy.shape[:2]
        p = config.tokens_per_frame
        cond = self.chunk_conditioning(t, text, controls)  # [B, F, dim]
        tokens, skips, shifted, _ = self._chunk_tokens(
            noisy.flatten(0, 1),
            keyframe[:, None].expand(-1, f, -1, -1, -1).flatten(0, 1),
            controls.flatten(0, 1),
            cond.flatten(0, 1),
        )
        x = tokens.reshape(b, f * p, -1)
        active = F.silu(cond)
        mask = torch.cat([context_valid, context_valid.new_ones(b, f * p)], dim=1)[:, None].expand(b, f * p, -1)
        for block, (ctx_k, ctx_v) in zip(self.block_list, context, strict=True):
            mod = _per_token(block.modulation(active), p)
            q, k, v = block.keys_values(x, mod)
            x = block.finish(x, mod, block.attend(q, torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1), mask))
        x0 = self._decode(x.reshape(b * f, p, -1), skips, cond.flatten(0, 1), shifted)
        return x0.view(b, f, *x0.shape[1:])
