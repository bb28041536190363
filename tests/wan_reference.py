"""Independent references of the Wan2.1 authors' forwards, on weights under their ORIGINAL key names.

Written here from the authors' code (Wan-Video/Wan2.1 @9737cba ``wan/modules/model.py`` and
``wan/modules/t5.py``), in plain torch, so the loaders' key mappings are checked against what
the names mean and not against themselves: the transformer's ``norm3`` is the affine
cross-attention norm and ``norm2`` the FFN's; T5's feed-forward is ``fc2(fc1(x) * gelu(gate(x)))``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def _linear(sd: Mapping[str, Tensor], name: str, x: Tensor) -> Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def _rms(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _layer_norm(x: Tensor, sd: Mapping[str, Tensor] | None = None, name: str = "", eps: float = 1e-6) -> Tensor:
    weight = sd[f"{name}.weight"] if sd is not None else None
    bias = sd[f"{name}.bias"] if sd is not None else None
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _sinusoid(dim: int, t: Tensor) -> Tensor:
    half = dim // 2
    position = t.double()
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1).float()


def _rope_freqs(head_dim: int) -> list[Tensor]:
    def params(dim: int) -> Tensor:
        freqs = torch.outer(torch.arange(1024), 1.0 / torch.pow(10000, torch.arange(0, dim, 2).double().div(dim)))
        return torch.polar(torch.ones_like(freqs), freqs)

    d = head_dim
    table = torch.cat([params(d - 4 * (d // 6)), params(2 * (d // 6)), params(2 * (d // 6))], dim=1)
    c = d // 2
    return list(table.split([c - 2 * (c // 3), c // 3, c // 3], dim=1))


def _rope(x: Tensor, grid: tuple[int, int, int], freqs: list[Tensor]) -> Tensor:
    f, h, w = grid
    b, seq, n, _ = x.shape
    xc = torch.view_as_complex(x.double().reshape(b, seq, n, -1, 2))
    table = torch.cat(
        [
            freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(seq, 1, -1)
    return torch.view_as_real(xc * table).flatten(3).float()


def wan_transformer_forward(sd: Mapping[str, Tensor], num_heads: int, x: Tensor, t: Tensor, context: Tensor) -> Tensor:
    """WanModel.forward (t2v, full attention) on original-named weights: ``x`` [B, C, F, H, W], ``t`` [B]."""
    patch = sd["patch_embedding.weight"]
    dim = patch.shape[0]
    p_t, p_h, p_w = patch.shape[2:]
    head_dim = dim // num_heads
    freqs = _rope_freqs(head_dim)
    hidden = F.conv3d(x, patch, sd["patch_embedding.bias"], stride=(p_t, p_h, p_w))
    b, _, f, h, w = hidden.shape
    hidden = hidden.flatten(2).transpose(1, 2)
    e = _linear(sd, "time_embedding.0", _sinusoid(sd["time_embedding.0.weight"].shape[1], t))
    e = _linear(sd, "time_embedding.2", F.silu(e))
    e0 = _linear(sd, "time_projection.1", F.silu(e)).unflatten(1, (6, dim))
    ctx = _linear(sd, "text_embedding.0", context)
    ctx = _linear(sd, "text_embedding.2", F.gelu(ctx, approximate="tanh"))
    blocks = sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.")})
    for i in blocks:
        p = f"blocks.{i}"
        mod = (sd[f"{p}.modulation"] + e0).chunk(6, dim=1)
        y = _layer_norm(hidden) * (1 + mod[1]) + mod[0]
        q = _rms(_linear(sd, f"{p}.self_attn.q", y), sd[f"{p}.self_attn.norm_q.weight"]).view(
            b, -1, num_heads, head_dim
        )
        k = _rms(_linear(sd, f"{p}.self_attn.k", y), sd[f"{p}.self_attn.norm_k.weight"]).view(
            b, -1, num_heads, head_dim
        )
        v = _linear(sd, f"{p}.self_attn.v", y).view(b, -1, num_heads, head_dim)
        q, k = _rope(q, (f, h, w), freqs), _rope(k, (f, h, w), freqs)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        hidden = hidden + _linear(sd, f"{p}.self_attn.o", attn.transpose(1, 2).flatten(2)) * mod[2]
        y = _layer_norm(hidden, sd, f"{p}.norm3")  # the affine cross-attention norm
        q = _rms(_linear(sd, f"{p}.cross_attn.q", y), sd[f"{p}.cross_attn.norm_q.weight"]).view(
            b, -1, num_heads, head_dim
        )
        k = _rms(_linear(sd, f"{p}.cross_attn.k", ctx), sd[f"{p}.cross_attn.norm_k.weight"])
        v = _linear(sd, f"{p}.cross_attn.v", ctx)
        k, v = k.view(b, -1, num_heads, head_dim), v.view(b, -1, num_heads, head_dim)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        hidden = hidden + _linear(sd, f"{p}.cross_attn.o", attn.transpose(1, 2).flatten(2))
        y = _layer_norm(hidden) * (1 + mod[4]) + mod[3]
        y = _linear(sd, f"{p}.ffn.2", F.gelu(_linear(sd, f"{p}.ffn.0", y), approximate="tanh"))
        hidden = hidden + y * mod[5]
    mod = (sd["head.modulation"] + e.unsqueeze(1)).chunk(2, dim=1)
    out = _linear(sd, "head.head", _layer_norm(hidden) * (1 + mod[1]) + mod[0])
    c = out.shape[-1] // (p_t * p_h * p_w)
    out = out.view(b, f, h, w, p_t, p_h, p_w, c)
    out = torch.einsum("bfhwpqrc->bcfphqwr", out)
    return out.reshape(b, c, f * p_t, h * p_h, w * p_w)


def _bucket(rel: Tensor, buckets: int, max_dist: int = 128) -> Tensor:
    half = buckets // 2
    out = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_dist / exact) * (half - exact)).long()
    large = torch.minimum(large, torch.full_like(large, half - 1))
    return out + torch.where(rel < exact, rel, large)


def wan_t5_forward(sd: Mapping[str, Tensor], ids: Tensor, mask: Tensor) -> Tensor:
    """Wan's T5Encoder.forward (umt5: one relative-position table per layer) on original-named weights."""
    x = F.embedding(ids, sd["token_embedding.weight"])
    b, length, _ = x.shape
    blocks = sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.")})
    rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    for i in blocks:
        p = f"blocks.{i}"
        table = sd[f"{p}.pos_embedding.embedding.weight"]
        buckets, heads = table.shape
        bias = F.embedding(_bucket(rel, buckets), table).permute(2, 0, 1)[None]  # [1, N, Lq, Lk]
        bias = bias.masked_fill(mask.view(b, 1, 1, -1) == 0, torch.finfo(x.dtype).min)
        y = _rms(x, sd[f"{p}.norm1.weight"])
        q = _linear(sd, f"{p}.attn.q", y).view(b, length, heads, -1)
        k = _linear(sd, f"{p}.attn.k", y).view(b, length, heads, -1)
        v = _linear(sd, f"{p}.attn.v", y).view(b, length, heads, -1)
        scores = torch.einsum("binc,bjnc->bnij", q, k) + bias  # T5: no scaling
        attn = torch.einsum("bnij,bjnc->binc", F.softmax(scores.float(), dim=-1), v)
        x = x + _linear(sd, f"{p}.attn.o", attn.reshape(b, length, -1))
        y = _rms(x, sd[f"{p}.norm2.weight"])
        gate = F.gelu(_linear(sd, f"{p}.ffn.gate.0", y), approximate="tanh")
        x = x + _linear(sd, f"{p}.ffn.fc2", _linear(sd, f"{p}.ffn.fc1", y) * gate)
    return _rms(x, sd["norm.weight"])
