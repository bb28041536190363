"""tinyworld's fast serving path: the same network, computed with less work per chunk.

Owns: :class:`FastSampler` (a drop-in for :func:`~.sampler.sample_chunk` over a
:class:`~.network.TinyWorldNet`) and :data:`ACCELS`, the serving paths to choose from:

* ``"none"``: the reference path, :meth:`TinyWorldNet.denoise_chunk` step after step.
* ``"eager"``: :class:`FastSampler` in eager PyTorch. Per chunk, not per denoising step: the
  step-invariant conditioning (controls, prompt, frame role), the motion path's shifted
  keyframe and its share of the encoder's first convolution, the cache's keys and values
  (copied once into buffers the chunk's own keys are written behind) and the attention
  mask (none at all once the cache is full). Per step, every modulation of the step (each
  transformer block's adaptive LayerNorm, the output head's, every conv block's FiLM) is
  one matrix product; modulations broadcast over a frame's tokens instead of being copied
  to each; the conv path runs channels-last with in-place activations and residuals.
* ``"compile"``: ``"eager"`` with each denoising step compiled by ``torch.compile``
  (inductor, the system C++ compiler), batch size dynamic. If compiling fails, it falls back
  to ``"eager"`` for good and says why (:attr:`FastSampler.fallback`).

The cache pass (:meth:`FastSampler.encode_keyframes`, for :func:`~.sampler.encode_keyframes`)
is hoisted the same way, and it skips what the reference computes and drops: the last
transformer block's attention output and MLP (only that block's keys and values are kept).
Must not know: sessions, ticks, numpy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.tinyworld.cache import KVCache, gather
from worldserve.models.tinyworld.network import ConvBlock, TinyWorldNet, _fourier, _timestep_features

__all__ = ["ACCELS", "DEFAULT_ACCEL", "FastSampler"]

#: Serving paths, reference first.
ACCELS = ("none", "eager", "compile")
#: What ``accel="auto"`` serves with (chosen by ``bench/tinyworld.py``; see docs/tinyworld.md).
DEFAULT_ACCEL = "eager"

_log = logging.getLogger(__name__)

Step = Callable[[Tensor, Tensor, Tensor, Tensor, list[Tensor], list[Tensor], Tensor | None], Tensor]


class FastSampler:
    """:func:`~.sampler.sample_chunk`, computed with the per-chunk work hoisted out of the steps.

    Holds the step's modulation weights concatenated into one matrix (built from ``net``'s
    parameters at construction: rebuild the sampler if the weights change) and puts ``net``'s
    conv weights in channels-last layout (the reference path computes the same with them).
    """

    def __init__(self, net: TinyWorldNet, *, compile: bool = False) -> None:
        self.net = net
        config = net.config
        self.config = config
        with torch.no_grad():
            for module in net.modules():
                if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
                    module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)
        encoder, decoder = net.encoder, net.decoder
        self.conv_blocks: list[ConvBlock] = [
            encoder.block1,
            encoder.block2,
            encoder.block3,
            decoder.block3,
            decoder.block2,
            decoder.block1,
        ]
        linears = [block.film for block in self.conv_blocks] + [block.ada for block in net.block_list] + [net.ada_out]
        with torch.no_grad():
            self.mod_weight = torch.cat([linear.weight for linear in linears]).detach().clone()
            self.mod_bias = torch.cat([linear.bias for linear in linears]).detach().clone()
            # The stem sees [noisy (3), shifted keyframe (3), validity (1)]: a linear map, so
            # the keyframe's share is computed once per chunk.
            self.stem_noisy = encoder.stem.weight[:, :3].detach().contiguous(memory_format=torch.channels_last)
            self.stem_extra = encoder.stem.weight[:, 3:].detach().contiguous(memory_format=torch.channels_last)
        self.mod_sizes = [linear.out_features for linear in linears]
        # The cache pass modulates the encoder's conv blocks and the transformer blocks only.
        keyframe_linears = [block.film for block in self.conv_blocks[:3]] + [block.ada for block in net.block_list]
        with torch.no_grad():
            self.kf_weight = torch.cat([linear.weight for linear in keyframe_linears]).detach().clone()
            self.kf_bias = torch.cat([linear.bias for linear in keyframe_linears]).detach().clone()
            # A keyframe is clean: its noise-level term of the conditioning is a constant.
            zero_t = _timestep_features(torch.zeros(1, device=self.kf_weight.device), 64)
            self.kf_t_term = net.conditioner.t_mlp(zero_t)[0].detach().clone()
        self.kf_sizes = [linear.out_features for linear in keyframe_linears]
        #: Why compiling failed (then it serves eagerly), else None.
        self.fallback: str | None = None
        #: Whether denoising steps run through ``torch.compile`` (False after a fallback).
        self.compiled = compile
        self._compiled_step: Step | None = torch.compile(self._denoise_step, dynamic=True) if compile else None

    # -- per chunk ---------------------------------------------------------------------------

    def _static_conditioning(self, text: Tensor, controls: Tensor) -> Tensor:
        """Everything of the chunk's conditioning but the noise level: ``[B, F, dim]``."""
        conditioner = self.net.conditioner
        f = controls.shape[1]
        scaled = controls / torch.tensor(
            [4.0, 4.0, conditioner.max_shift, conditioner.max_shift], dtype=controls.dtype, device=controls.device
        )
        features = torch.cat([_fourier(scaled, 2.0, 8), scaled], dim=-1)
        roles = torch.arange(f, device=controls.device)
        out: Tensor = conditioner.control_mlp(features) + conditioner.text(text)[:, None] + conditioner.role(roles)
        return out

    def _keyframe_share(self, keyframe: Tensor, controls: Tensor) -> tuple[Tensor | None, Tensor]:
        """The motion path's shifted keyframe ``[B*F, 3, H, W]`` (or None) and its stem term ``[B*F, C, H, W]``."""
        net = self.net
        b, f = controls.shape[:2]
        stem = net.encoder.stem
        if net.motion is None:
            share = stem.bias[None, :, None, None].expand(b * f, -1, keyframe.shape[-2], keyframe.shape[-1])  # type: ignore[index]
            return None, share.contiguous(memory_format=torch.channels_last)
        repeated = keyframe[:, None].expand(-1, f, -1, -1, -1).flatten(0, 1)
        shifted, valid = net.motion(repeated, controls.flatten(0, 1)[:, 2:])
        extra = torch.cat([shifted, valid], dim=1).contiguous(memory_format=torch.channels_last)
        return shifted, F.conv2d(extra, self.stem_extra, stem.bias, padding=1)

    @torch.no_grad()
    def sample_chunk(
        self,
        caches: Sequence[KVCache],
        noise: Tensor,
        text: Tensor,
        controls: Tensor,
        keyframe: Tensor,
    ) -> Tensor:
        """As :func:`~.sampler.sample_chunk`: x0 ``[B, F, 3, H, W]`` in ``[-1, 1]``."""
        config = self.config
        steps = config.steps
        if steps[0] < 1.0:
            raise ValueError("the sampler starts from pure noise: steps[0] must be 1.0")
        b, f = controls.shape[:2]
        tokens = f * config.tokens_per_frame
        context, valid = gather(caches)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        for ctx_k, ctx_v in context:
            keys.append(torch.cat([ctx_k, ctx_k.new_empty(b, tokens, ctx_k.shape[-1])], dim=1))
            values.append(torch.cat([ctx_v, ctx_v.new_empty(b, tokens, ctx_v.shape[-1])], dim=1))
        mask: Tensor | None = None
        if not bool(valid.all()):
            mask = torch.cat([valid, valid.new_ones(b, tokens)], dim=1)[:, None, None]
        static = self._static_conditioning(text, controls)
        shifted, share = self._keyframe_share(keyframe, controls)
        shifted_t = shifted if shifted is not None else share.new_zeros(0)
        t_mlp = self.net.conditioner.t_mlp
        x = noise[0]
        x0 = x
        for index, level in enumerate(steps):
            t_features = _timestep_features(torch.full((1,), level, device=noise.device), 64)
            cond = static + t_mlp(t_features)  # [B, F, dim]
            x0 = self._run_step(x, cond, share, shifted_t, keys, values, mask)
            if index + 1 < len(steps):
                following = steps[index + 1]
                x = (1.0 - following) * x0 + following * noise[index + 1]
        return x0.clamp(-1.0, 1.0)

    def _run_step(
        self,
        x: Tensor,
        cond: Tensor,
        share: Tensor,
        shifted: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        mask: Tensor | None,
    ) -> Tensor:
        if self._compiled_step is not None:
            try:
                return self._compiled_step(x, cond, share, shifted, keys, values, mask)
            except Exception as error:  # any compiler failure means: serve eagerly
                self.fallback = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                _log.warning("tinyworld: torch.compile failed, serving eagerly: %s", self.fallback)
                self._compiled_step = None
                self.compiled = False
        return self._denoise_step(x, cond, share, shifted, keys, values, mask)

    @torch.no_grad()
    def encode_keyframes(self, caches: Sequence[KVCache], frames: Tensor, text: Tensor, controls: Tensor) -> None:
        """As :func:`~.sampler.encode_keyframes`: each session's new keyframe ``frames`` [B, 3, H, W]
        attends to its cache, and its keys and values join it."""
        net = self.net
        config = self.config
        b = frames.shape[0]
        p = config.tokens_per_frame
        dim = config.dim
        conditioner = net.conditioner
        sink = torch.tensor([cache.written == 0 for cache in caches], device=frames.device)
        roles = torch.where(sink, config.frames_per_chunk + 1, config.frames_per_chunk).to(torch.int64)
        scaled = controls / torch.tensor(
            [4.0, 4.0, conditioner.max_shift, conditioner.max_shift], dtype=controls.dtype, device=controls.device
        )
        features = torch.cat([_fourier(scaled, 2.0, 8), scaled], dim=-1)
        cond = self.kf_t_term + conditioner.control_mlp(features) + conditioner.text(text) + conditioner.role(roles)
        mods = torch.split(F.linear(F.silu(cond), self.kf_weight, self.kf_bias), self.kf_sizes, dim=-1)
        # Encoder: the stem's 4 motion channels are zeros for a keyframe.
        encoder = net.encoder
        pixels = frames.contiguous(memory_format=torch.channels_last)
        h = F.conv2d(pixels, self.stem_noisy, encoder.stem.bias, padding=1)
        h = _conv_block(encoder.block1, h, mods[0])
        h = _conv_block(encoder.block2, encoder.down1(h), mods[1])
        h = _conv_block(encoder.block3, encoder.down2(h), mods[2])
        x = encoder.patch(h).flatten(2).transpose(1, 2).add(net.pos)  # [B, P, dim]
        context, valid = gather(caches)
        mask: Tensor | None = None
        if not bool(valid.all()):
            mask = torch.cat([valid, valid.new_ones(b, p)], dim=1)[:, None, None]
        blocks = net.block_list
        layers: list[tuple[Tensor, Tensor]] = []
        for index, (block, mod, (ctx_k, ctx_v)) in enumerate(zip(blocks, mods[3:], context, strict=True)):
            m = mod.view(b, 1, 6, dim)
            h_tok = F.layer_norm(x, (dim,), eps=1e-6) * (1.0 + m[:, :, 1]) + m[:, :, 0]
            q, k, v = block.qkv(h_tok).chunk(3, dim=-1)
            layers.append((k, v))
            if index + 1 == len(blocks):
                break  # the last block's output is not kept: only its keys and values are
            heads = block.heads
            qh = q.reshape(b, p, heads, -1).transpose(1, 2)
            kh = torch.cat([ctx_k, k], dim=1).view(b, -1, heads, dim // heads).transpose(1, 2)
            vh = torch.cat([ctx_v, v], dim=1).view(b, -1, heads, dim // heads).transpose(1, 2)
            attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2).reshape(b, p, dim)
            x = x + m[:, :, 2] * block.proj(attn)
            h_tok = F.layer_norm(x, (dim,), eps=1e-6) * (1.0 + m[:, :, 4]) + m[:, :, 3]
            x = x + m[:, :, 5] * _mlp(block.mlp, h_tok)
        for row, cache in enumerate(caches):
            cache.write([(k[row], v[row]) for k, v in layers])

    # -- per step ----------------------------------------------------------------------------

    def _denoise_step(
        self,
        noisy: Tensor,
        cond: Tensor,
        share: Tensor,
        shifted: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        mask: Tensor | None,
    ) -> Tensor:
        """One denoising step: ``noisy`` [B, F, 3, H, W], ``cond`` [B, F, dim] -> x0 [B, F, 3, H, W].

        ``keys``/``values`` per layer ``[B, S + F*P, dim]`` hold the cache in front; this
        step's chunk keys and values are written behind it.
        """
        net = self.net
        config = self.config
        b, f = noisy.shape[:2]
        p = config.tokens_per_frame
        dim = config.dim
        active = F.silu(cond.flatten(0, 1))  # [B*F, dim]
        mods = torch.split(F.linear(active, self.mod_weight, self.mod_bias), self.mod_sizes, dim=-1)
        films = mods[: len(self.conv_blocks)]
        blocks = mods[len(self.conv_blocks) : -1]
        head = mods[-1]
        # Encoder.
        frames = noisy.flatten(0, 1).contiguous(memory_format=torch.channels_last)
        h = F.conv2d(frames, self.stem_noisy, None, padding=1).add_(share)
        encoder = net.encoder
        s1 = _conv_block(encoder.block1, h, films[0])
        s2 = _conv_block(encoder.block2, encoder.down1(s1), films[1])
        s3 = _conv_block(encoder.block3, encoder.down2(s2), films[2])
        patches: Tensor = encoder.patch(s3)  # [B*F, dim, h, w]
        x = patches.flatten(2).transpose(1, 2).add(net.pos).view(b, f, p, dim)
        # Transformer: modulations per frame, broadcast over the frame's tokens.
        context = keys[0].shape[1] - f * p
        for block, mod, k_all, v_all in zip(net.block_list, blocks, keys, values, strict=True):
            m = mod.view(b, f, 1, 6, dim)
            h_tok = F.layer_norm(x, (dim,), eps=1e-6) * (1.0 + m[..., 1, :]) + m[..., 0, :]
            q, k, v = block.qkv(h_tok).view(b, f * p, 3 * dim).chunk(3, dim=-1)
            k_all[:, context:] = k
            v_all[:, context:] = v
            heads = block.heads
            qh = q.reshape(b, f * p, heads, -1).transpose(1, 2)
            kh = k_all.view(b, -1, heads, dim // heads).transpose(1, 2)
            vh = v_all.view(b, -1, heads, dim // heads).transpose(1, 2)
            attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
            attn = attn.transpose(1, 2).reshape(b, f, p, dim)
            x = x + m[..., 2, :] * block.proj(attn)
            h_tok = F.layer_norm(x, (dim,), eps=1e-6) * (1.0 + m[..., 4, :]) + m[..., 3, :]
            x = x + m[..., 5, :] * _mlp(block.mlp, h_tok)
        shift, scale = head.view(b, f, 1, 2 * dim).chunk(2, dim=-1)
        out_tokens = net.head(F.layer_norm(x, (dim,), eps=1e-6) * (1.0 + scale) + shift)  # [B, F, P, dim]
        # Decoder.
        decoder = net.decoder
        grid = out_tokens.view(b * f, p, dim).transpose(1, 2).reshape(b * f, dim, *decoder.grid)
        h = decoder.unpatch(grid.contiguous(memory_format=torch.channels_last)).add_(s3)
        h = _conv_block(decoder.block3, h, films[3])
        h = decoder.up2(F.interpolate(h, scale_factor=2.0, mode="nearest")).add_(s2)
        h = _conv_block(decoder.block2, h, films[4])
        h = decoder.up1(F.interpolate(h, scale_factor=2.0, mode="nearest")).add_(s1)
        h = _conv_block(decoder.block1, h, films[5])
        out: Tensor = decoder.out(F.silu(h, inplace=True))
        generated = out[:, :3]
        if shifted.numel() == 0:
            x0 = generated
        else:
            keep = torch.sigmoid(out[:, 3:4])
            x0 = keep * shifted + (1.0 - keep) * generated
        return x0.contiguous().view(b, f, *x0.shape[1:])


def _conv_block(block: ConvBlock, x: Tensor, film: Tensor) -> Tensor:
    """:meth:`ConvBlock.forward` with its FiLM precomputed (``film`` [N, 2C]), activations in place."""
    norm = block.norm
    h = F.silu(F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps), inplace=True)
    h = block.conv1(h)
    scale, shift = film.chunk(2, dim=-1)
    h = h.mul_(1.0 + scale[..., None, None]).add_(shift[..., None, None])
    out: Tensor = block.conv2(F.silu(h, inplace=True)).add_(x)
    return out


#: sqrt(2 / pi), of the tanh approximation of GELU.
_GELU_C = math.sqrt(2.0 / math.pi)


def _mlp(mlp: nn.Sequential, x: Tensor) -> Tensor:
    """A block's ``Linear -> GELU(tanh) -> Linear``; in float32 the GELU in place and through the
    identity ``0.5 * (1 + tanh(z)) = sigmoid(2z)`` (cheaper than the tanh kernel here, equal to
    float rounding). In bfloat16 each of those five steps would round: there it is ``F.gelu``."""
    first, second = cast(nn.Linear, mlp[0]), cast(nn.Linear, mlp[2])
    h = F.linear(x, first.weight, first.bias)
    if h.dtype != torch.float32:
        return F.linear(F.gelu(h, approximate="tanh"), second.weight, second.bias)
    z = h * h
    z = z.mul_(0.044715 * 2.0 * _GELU_C).add_(2.0 * _GELU_C).mul_(h).sigmoid_().mul_(h)
    return F.linear(z, second.weight, second.bias)
