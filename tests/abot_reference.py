"""An independent reference of ABot-World's streaming forward, on weights under its ORIGINAL key names.

Re-typed here from ``amap-cvlab/ABot-World`` ``wan/modules/causal_model.py`` (``rope_params``,
``causal_rope_apply``, ``freqs_at``, ``_build_ref_freqs``, ``rope_apply_with_refimg``; the KV-cache
branch of ``CausalWanSelfAttention.forward`` with ``use_relative_rope`` and ``REL_ROPE_CACHE`` on and
no sink; ``CausalWanAttentionBlock.forward``, ``CausalHead``, ``_prepare_ref_tokens``,
``_zero_ref_modulation``, ``_apply_control_adapters`` and ``_forward_inference``; ``unpatchify``),
in plain torch with the cache as lists of frames instead of a rolled buffer, so worldserve's
layout, loader and cache are checked against what the reference computes and not against
themselves. ``wan/modules/model.py``'s pieces (``sinusoidal_embedding_1d``, ``WanRMSNorm``,
``WanLayerNorm``, the T2V cross-attention) are re-typed too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

# -- RoPE ------------------------------------------------------------------------------------


def rope_params(max_seq_len: int, dim: int, theta: float = 10000) -> Tensor:
    freqs = torch.outer(
        torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim))
    )
    return torch.polar(torch.ones_like(freqs), freqs)


def freqs_table(head_dim: int) -> Tensor:
    d = head_dim
    return torch.cat(
        [rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)), rope_params(1024, 2 * (d // 6))],
        dim=1,
    )


def causal_rope_apply(x: Tensor, grid: tuple[int, int, int], freqs: Tensor, start_frame: int) -> Tensor:
    """``x`` ``[1, L, heads, head_dim]`` rotated at frames ``start_frame ..`` of a (f, h, w) grid."""
    n, c = x.size(2), x.size(3) // 2
    parts = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    seq_len = f * h * w
    x_i = torch.view_as_complex(x[0, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
    freqs_i = torch.cat(
        [
            parts[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            parts[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            parts[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(seq_len, 1, -1)
    return torch.view_as_real(x_i * freqs_i).flatten(2)[None].type_as(x)


def freqs_at(indices: list[int], dim: int, theta: float = 10000) -> Tensor:
    t = torch.tensor(indices, dtype=torch.float64)
    freqs = torch.outer(t, 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64).div(dim)))
    return torch.polar(torch.ones_like(freqs), freqs)


def ref_freqs(freqs: Tensor, num_slots: int, tokens_per_slot: int, ref_grid: tuple[int, int, int]) -> Tensor:
    patch_t, patch_h, patch_w = ref_grid
    freq_dim = int(freqs.shape[1])
    f_band, h_band, w_band = freq_dim - 2 * (freq_dim // 3), freq_dim // 3, freq_dim // 3
    step = max(int(tokens_per_slot), 256)
    t_freqs = freqs_at([-(num_slots - i) * step for i in range(num_slots)], 2 * f_band)
    split = freqs.split([f_band, h_band, w_band], dim=1)
    shape = (num_slots, patch_t, patch_h, patch_w)
    return torch.cat(
        [
            t_freqs[:, None, None, None, :].expand(*shape, f_band),
            split[1][:patch_h][None, None, :, None, :].expand(*shape, h_band),
            split[2][:patch_w][None, None, None, :, :].expand(*shape, w_band),
        ],
        dim=-1,
    ).reshape(num_slots * tokens_per_slot, 1, -1)


def rope_with_refimg(x: Tensor, table: Tensor) -> Tensor:
    x_out = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:3], -1, 2))
    return torch.view_as_real(x_out * table).flatten(3).type_as(x)


def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """[1, L, heads, head_dim] each -> [1, Lq, heads, head_dim]."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class RelativeAttention:
    """One layer's fast relative path over a stream: raw and rotated keys per frame, a base, the window.

    ``block`` is one pass: passes of the same block (the denoising steps, then the commit) write
    the same frames again, as the reference's cache indices do; the last pass's stay.
    """

    def __init__(
        self,
        *,
        head_dim: int,
        grid: tuple[int, int],
        slots: int,
        ref_grid: tuple[int, int, int],
        local: int,
        limit: int,
    ) -> None:
        self.grid, self.local, self.limit = grid, local, limit
        self.tpf = grid[0] * grid[1]
        self.tps = ref_grid[0] * ref_grid[1] * ref_grid[2]
        self.freqs = freqs_table(head_dim)
        self.ref_table = ref_freqs(self.freqs, slots, self.tps, ref_grid)
        self.raw: list[Tensor] = []  # per absolute frame: [1, tpf, heads, head_dim]
        self.values: list[Tensor] = []
        self.roped: dict[int, Tensor] = {}  # absolute frame -> its key rotated at (frame - base)
        self.ref_k: Tensor | None = None
        self.ref_v: Tensor | None = None
        self.base = 0

    def block(self, start: int, q: Tensor, k: Tensor, v: Tensor, refs: tuple[Tensor, Tensor, Tensor] | None) -> Tensor:
        """One pass of the block at absolute frame ``start`` (``refs``: the slots' (q, k, v) in a first block)."""
        tpf = self.tpf
        nvf = q.shape[1] // tpf
        for i in range(nvf):
            frame_k, frame_v = k[:, i * tpf : (i + 1) * tpf], v[:, i * tpf : (i + 1) * tpf]
            if start + i < len(self.raw):
                self.raw[start + i], self.values[start + i] = frame_k, frame_v
            else:
                self.raw.append(frame_k)
                self.values.append(frame_v)
        if refs is not None:
            self.ref_k, self.ref_v = refs[1], refs[2]
        assert self.ref_k is not None
        assert self.ref_v is not None
        end = start + nvf
        visible = min(self.local, end)
        new_start = start - self.base
        limit = min(self.limit, 1024 - self.local - nvf)
        if visible > 0 and (new_start + nvf > limit or new_start < 0):  # rebase: the window re-rotated from 0
            self.base = end - visible
            first = end - visible
            window = torch.cat(self.raw[first:end], dim=1)
            rotated = causal_rope_apply(window, (visible, *self.grid), self.freqs, 0)
            new_start = start - self.base
        else:
            first = start
            rotated = causal_rope_apply(k, (nvf, *self.grid), self.freqs, new_start)
        for i in range(rotated.shape[1] // tpf):
            self.roped[first + i] = rotated[:, i * tpf : (i + 1) * tpf]
        query = causal_rope_apply(q, (nvf, *self.grid), self.freqs, new_start)
        keys = [rope_with_refimg(self.ref_k, self.ref_table)]
        keys += [self.roped[i] for i in range(end - visible, end)]
        values = [self.ref_v, *self.values[end - visible : end]]
        if refs is not None:
            query = torch.cat([rope_with_refimg(refs[0], self.ref_table), query], dim=1)
        return attend(query, torch.cat(keys, dim=1), torch.cat(values, dim=1))


# -- the model ---------------------------------------------------------------------------------


def _linear(sd: Mapping[str, Tensor], name: str, x: Tensor) -> Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def _rms(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _layer_norm(x: Tensor, sd: Mapping[str, Tensor] | None = None, name: str = "", eps: float = 1e-6) -> Tensor:
    """``WanLayerNorm``: in float32, whatever the input's type."""
    weight = sd[f"{name}.weight"].float() if sd is not None else None
    bias = sd[f"{name}.bias"].float() if sd is not None else None
    return F.layer_norm(x.float(), x.shape[-1:], weight, bias, eps).type_as(x)


def sinusoid(dim: int, position: Tensor) -> Tensor:
    half = dim // 2
    position = position.to(torch.float64)
    table = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(table), torch.sin(table)], dim=1)


class ABotReference:
    """``CausalWanModel._forward_inference`` over a stream, one call per pass; ``sd`` in original names."""

    def __init__(
        self,
        sd: Mapping[str, Tensor],
        *,
        heads: int,
        patch: tuple[int, int, int],
        grid: tuple[int, int],
        slots: int,
        ref_grid: tuple[int, int, int],
        local: int,
        limit: int,
        text_len: int,
        adapter: Callable[[Tensor], Tensor],
    ) -> None:
        self.sd, self.heads, self.patch, self.text_len, self.adapter = sd, heads, patch, text_len, adapter
        self.dim = sd["patch_embedding.weight"].shape[0]
        self.layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
        self.freq_dim = sd["time_embedding.0.weight"].shape[1]
        head_dim = self.dim // heads
        self.attention = [
            RelativeAttention(head_dim=head_dim, grid=grid, slots=slots, ref_grid=ref_grid, local=local, limit=limit)
            for _ in range(self.layers)
        ]

    def _time(self, t: Tensor) -> tuple[Tensor, Tensor]:
        sd = self.sd
        features = sinusoid(self.freq_dim, t.flatten()).to(sd["time_embedding.0.weight"].dtype)
        e = _linear(sd, "time_embedding.2", F.silu(_linear(sd, "time_embedding.0", features)))
        e0 = _linear(sd, "time_projection.1", F.silu(e)).unflatten(1, (6, self.dim)).unflatten(0, t.shape)
        return e, e0

    def __call__(
        self,
        x: Tensor,
        t: Tensor,
        context: Tensor,
        act_context: Tensor,
        start_frame: int,
        ref_latents: Tensor | None = None,
        ref_mask: Tensor | None = None,
    ) -> Tensor:
        """One pass: ``x`` ``[1, C, F, H, W]`` at ``t`` ``[1, F]``; ``context`` ``[1, L, text_dim]``;
        ``act_context`` the adapter's input map; ``ref_latents`` ``[1, K, C, 1, h, w]`` (the first block)."""
        sd = self.sd
        u = F.conv3d(x, sd["patch_embedding.weight"], sd["patch_embedding.bias"], stride=self.patch)
        action = self.adapter(act_context)
        t_f, c_f = u.shape[2], action.shape[2]
        u = torch.cat([u[:, :, : t_f - c_f], u[:, :, t_f - c_f :] + action], dim=2) if t_f > c_f else u + action
        grid = tuple(u.shape[2:])
        hw = grid[1] * grid[2]
        tokens = u.flatten(2).transpose(1, 2)
        e, e0 = self._time(t)
        padded = torch.cat([context, context.new_zeros(1, self.text_len - context.shape[1], context.shape[2])], dim=1)
        ctx = _linear(sd, "text_embedding.2", F.gelu(_linear(sd, "text_embedding.0", padded), approximate="tanh"))
        n_ref = 0
        if ref_latents is not None:
            assert ref_mask is not None
            _, k_slots, c, rt, rh, rw = ref_latents.shape
            ref = F.conv3d(
                ref_latents.reshape(k_slots, c, rt, rh, rw),
                sd["patch_embedding.weight"],
                sd["patch_embedding.bias"],
                stride=self.patch,
            )
            per_slot = ref.shape[2] * ref.shape[3] * ref.shape[4]
            ref_tokens = ref.flatten(2).transpose(1, 2).reshape(1, k_slots, per_slot, self.dim)
            ref_tokens = (ref_tokens * ref_mask[:, :, None, None]).reshape(1, k_slots * per_slot, self.dim)
            n_ref = k_slots * per_slot
            _, ref_e0 = self._time(torch.zeros(1, 1, dtype=torch.long))
            tokens = torch.cat([ref_tokens, tokens], dim=1)
            e0 = torch.cat([ref_e0.expand(-1, n_ref, -1, -1), e0.repeat_interleave(hw, dim=1)], dim=1)
        for layer in range(self.layers):
            tokens = self._block(layer, tokens, e0, ctx, start_frame, n_ref)
        tokens = tokens[:, n_ref:]
        frames = t.shape[1]
        head = (sd["head.modulation"].unsqueeze(1) + e.unflatten(0, t.shape).unsqueeze(2)).chunk(2, dim=2)
        normed = _layer_norm(tokens).unflatten(1, (frames, hw)) * (1 + head[1]) + head[0]
        out = _linear(sd, "head.head", normed).flatten(1, 2)[0]
        c_out = out.shape[-1] // math.prod(self.patch)
        out = out.view(*grid, *self.patch, c_out)
        out = torch.einsum("fhwpqrc->cfphqwr", out)
        return out.reshape(c_out, *[i * j for i, j in zip(grid, self.patch, strict=True)])[None]

    def _block(self, layer: int, x: Tensor, e0: Tensor, ctx: Tensor, start: int, n_ref: int) -> Tensor:
        sd, p = self.sd, f"blocks.{layer}."
        token_level = e0.shape[1] == x.shape[1]
        frames = e0.shape[1]
        per_frame = 1 if token_level else x.shape[1] // frames
        e = (sd[p + "modulation"].unsqueeze(0) + e0).chunk(6, dim=2)

        def modulate(value: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
            if token_level:
                return value * (1 + scale.squeeze(2)) + shift.squeeze(2)
            return (value.unflatten(1, (frames, per_frame)) * (1 + scale) + shift).flatten(1, 2)

        def gate(value: Tensor, g: Tensor) -> Tensor:
            if token_level:
                return value * g.squeeze(2)
            return (value.unflatten(1, (frames, per_frame)) * g).flatten(1, 2)

        heads, s = self.heads, x.shape[1]
        normed = modulate(_layer_norm(x), e[0], e[1])
        q = _rms(_linear(sd, p + "self_attn.q", normed), sd[p + "self_attn.norm_q.weight"]).view(1, s, heads, -1)
        k = _rms(_linear(sd, p + "self_attn.k", normed), sd[p + "self_attn.norm_k.weight"]).view(1, s, heads, -1)
        v = _linear(sd, p + "self_attn.v", normed).view(1, s, heads, -1)
        refs = (q[:, :n_ref], k[:, :n_ref], v[:, :n_ref]) if n_ref else None
        y = self.attention[layer].block(start, q[:, n_ref:], k[:, n_ref:], v[:, n_ref:], refs)
        y = _linear(sd, p + "self_attn.o", y.flatten(2))
        x = x + gate(y, e[2])
        # The T2V cross-attention over the text, after the affine norm3.
        cq = _layer_norm(x, sd, p + "norm3")
        cq = _rms(_linear(sd, p + "cross_attn.q", cq), sd[p + "cross_attn.norm_q.weight"]).view(1, s, heads, -1)
        width = cq.shape[-1]
        ck = _rms(_linear(sd, p + "cross_attn.k", ctx), sd[p + "cross_attn.norm_k.weight"]).view(1, -1, heads, width)
        cv = _linear(sd, p + "cross_attn.v", ctx).view(1, -1, heads, width)
        x = x + _linear(sd, p + "cross_attn.o", attend(cq, ck, cv).flatten(2))
        hidden = modulate(_layer_norm(x), e[3], e[4])
        y = _linear(sd, p + "ffn.2", F.gelu(_linear(sd, p + "ffn.0", hidden), approximate="tanh"))
        return x + gate(y, e[5])
