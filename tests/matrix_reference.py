"""An independent reference of Matrix-Game 2.0's streaming forward, on weights under its ORIGINAL names.

Re-typed here in plain torch from the authors' definitions (SkyworkAI/Matrix-Game @3ceb311,
``Matrix-Game-2/wan/modules/causal_model.py`` ``CausalWanModel._forward_inference`` with its
``CausalWanSelfAttention`` KV cache, ``wan/modules/action_module.py`` ``ActionModule.forward``
in its cached causal branch, ``wan/modules/posemb_layers.py`` for the action RoPE, and the loop of
``pipeline/causal_inference.py``), one session at a time (the reference's keyboard cache takes a
batch of one), with its own rolling caches: ``global_end_index`` / ``local_end_index``, eviction by
rolling, attention over the last ``local_attn_size`` frames the block's own included. Nothing
here is imported from worldserve, so the model is checked against what the reference computes and
not against itself. Also :func:`original_name` (the Diffusers-layout name of a parameter -> the
reference's), written here from the two layouts' module trees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_BLOCK_RENAMES = (
    ("attn1.to_out.0.", "self_attn.o."),
    ("attn1.to_q.", "self_attn.q."),
    ("attn1.to_k.", "self_attn.k."),
    ("attn1.to_v.", "self_attn.v."),
    ("attn1.norm_q.", "self_attn.norm_q."),
    ("attn1.norm_k.", "self_attn.norm_k."),
    ("attn2.to_out.0.", "cross_attn.o."),
    ("attn2.to_q.", "cross_attn.q."),
    ("attn2.to_k.", "cross_attn.k."),
    ("attn2.to_v.", "cross_attn.v."),
    ("attn2.norm_q.", "cross_attn.norm_q."),
    ("attn2.norm_k.", "cross_attn.norm_k."),
    ("norm2.", "norm3."),
    ("ffn.net.0.proj.", "ffn.0."),
    ("ffn.net.2.", "ffn.2."),
)
_TOP_RENAMES = (
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),
    ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
    ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
    ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
    ("proj_out.", "head.head."),
)


def original_name(name: str) -> str:
    """A Diffusers-layout parameter name as Matrix-Game's ``CausalWanModel`` names it."""
    if name == "scale_shift_table":
        return "head.modulation"
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        if rest == "scale_shift_table":
            return f"blocks.{index}.modulation"
        if rest.startswith("action_model."):
            return name
        for old, new in _BLOCK_RENAMES:
            if rest.startswith(old):
                return f"blocks.{index}.{new}{rest[len(old) :]}"
        raise KeyError(name)
    for old, new in _TOP_RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith("patch_embedding."):
        return name
    raise KeyError(name)


def _linear(sd: Mapping[str, Tensor], name: str, x: Tensor) -> Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def _layer_norm(x: Tensor, sd: Mapping[str, Tensor] | None, name: str, eps: float) -> Tensor:
    weight = sd[f"{name}.weight"] if sd is not None else None
    bias = sd[f"{name}.bias"] if sd is not None else None
    return F.layer_norm(x.float(), x.shape[-1:], weight, bias, eps).type_as(x)


def _wan_rms(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``wan.modules.model.WanRMSNorm``: normalised in float, times its weight."""
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)).type_as(x) * weight


def _action_rms(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``action_module.WanRMSNorm``: its forward does not apply its weight."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _sinusoid(dim: int, t: Tensor) -> Tensor:
    half = dim // 2
    position = t.double()
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1).float()


def _rope_params(max_seq_len: int, dim: int, theta: float = 10000.0) -> Tensor:
    freqs = torch.outer(torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).double().div(dim)))
    return torch.polar(torch.ones_like(freqs), freqs)


def _causal_rope(x: Tensor, grid: tuple[int, int, int], freqs: list[Tensor], start_frame: int) -> Tensor:
    f, h, w = grid
    b, seq, n, _ = x.shape
    xc = torch.view_as_complex(x.double().reshape(b, seq, n, -1, 2))
    table = torch.cat(
        [
            freqs[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(seq, 1, -1)
    return torch.view_as_real(xc * table).flatten(3).type_as(x)


def _action_freqs(dims: tuple[int, int, int], theta: float, frames: int = 7500) -> tuple[Tensor, Tensor]:
    """``get_nd_rotary_pos_embed(rope_dim_list, [frames, 1, 1], theta, use_real=True)``: [frames, head].

    The grid's time axis is ``linspace(0, frames, frames + 1)[:frames]``; the height and width axes
    have one position, 0.
    """
    grids = [
        torch.linspace(0, frames, frames + 1, dtype=torch.float32)[:frames],
        torch.zeros(frames),
        torch.zeros(frames),
    ]
    cos_parts, sin_parts = [], []
    for dim, pos in zip(dims, grids, strict=True):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        angles = torch.outer(pos, freqs)
        cos_parts.append(angles.cos().repeat_interleave(2, dim=1))
        sin_parts.append(angles.sin().repeat_interleave(2, dim=1))
    return torch.cat(cos_parts, dim=1), torch.cat(sin_parts, dim=1)


def _rotate_half(x: Tensor) -> Tensor:
    real, imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([-imag, real], dim=-1).flatten(3)


def _apply_action_rope(x: Tensor, cos: Tensor, sin: Tensor, start: int) -> Tensor:
    """``posemb_layers.apply_rotary_emb`` (head_first=False) for one of q/k: ``x`` [B, T, H, D]."""
    c = cos.view(1, cos.shape[0], 1, cos.shape[1])[:, start : start + x.shape[1]]
    s = sin.view(1, sin.shape[0], 1, sin.shape[1])[:, start : start + x.shape[1]]
    return (x.float() * c + _rotate_half(x.float()) * s).type_as(x)


@dataclass
class _Cache:
    """One of the reference's KV cache dicts: ``k``, ``v``, ``global_end_index``, ``local_end_index``."""

    k: Tensor
    v: Tensor
    global_end: int = 0
    local_end: int = 0


def _cache(size: int, shape: tuple[int, ...]) -> _Cache:
    return _Cache(torch.zeros(shape[0], size, *shape[1:]), torch.zeros(shape[0], size, *shape[1:]))


def _write(cache: _Cache, k: Tensor, v: Tensor, current_start: int) -> int:
    """The reference's cache update (sink 0): roll out the oldest entries if full, write; the new local end."""
    size, new = cache.k.shape[1], k.shape[1]
    current_end = current_start + new
    if current_end > cache.global_end and new + cache.local_end > size:
        evicted = new + cache.local_end - size
        rolled = cache.local_end - evicted
        cache.k[:, :rolled] = cache.k[:, evicted : evicted + rolled].clone()
        cache.v[:, :rolled] = cache.v[:, evicted : evicted + rolled].clone()
        local_end = cache.local_end + current_end - cache.global_end - evicted
    else:
        local_end = cache.local_end + current_end - cache.global_end
    cache.k[:, local_end - new : local_end] = k
    cache.v[:, local_end - new : local_end] = v
    cache.global_end, cache.local_end = current_end, local_end
    return local_end


def _attend(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Full (non-causal) attention, ``[B, L, H, D]`` layout as flash-attention takes it."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
    return out.transpose(1, 2)


def _cached_attend(cache: _Cache, q: Tensor, k: Tensor, v: Tensor, current_start: int, window: int) -> Tensor:
    """Write the new K/V, then attend over the cache's last ``window`` entries."""
    end = _write(cache, k, v, current_start)
    return _attend(q, cache.k[:, max(0, end - window) : end], cache.v[:, max(0, end - window) : end])


def reference_windows(condition: Tensor, block: int, window: int = 3, ratio: int = 4) -> Tensor:
    """The cached branch's grouping of a per-video-frame condition ``[B, 1 + 4 (start + F - 1), C]``
    (every frame up to the block's last): padded in front with ``window * ratio`` copies of the first
    frame's, cut to the block, and the ``window * ratio`` frames before each of its latent frames
    stacked: ``[B, F, window * ratio, C]``. (The keyboard is embedded per frame first; embedding commutes
    with the cut, so it is done before here.)"""
    pad_t = ratio * window
    n_feats = (condition.shape[1] - 1) // ratio + 1
    cond = torch.cat([condition[:, 0:1, :].expand(-1, pad_t, -1), condition], dim=1)
    cond = cond[:, ratio * (n_feats - block - window) + pad_t :, :]
    return torch.stack([cond[:, ratio * (j - window) + pad_t : j * ratio + pad_t, :] for j in range(block)], dim=1)


@dataclass
class Geometry:
    num_heads: int
    local_attn_size: int
    action_blocks: tuple[int, ...]
    action_heads: int
    mouse: bool
    rope_dims: tuple[int, int, int]
    rope_theta: float = 256.0
    window: int = 3
    ratio: int = 4
    eps: float = 1e-6


class ReferenceMatrixGame:
    """``CausalWanModel._forward_inference`` + ``ActionModule`` (cached, causal) for ONE session."""

    def __init__(self, sd: Mapping[str, Tensor], geometry: Geometry, frame_tokens: int) -> None:
        self.sd = sd
        self.g = geometry
        self.dim = sd["patch_embedding.weight"].shape[0]
        self.layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
        head = self.dim // geometry.num_heads
        c = head // 2
        table = torch.cat(
            [
                _rope_params(1024, head - 4 * (head // 6)),
                _rope_params(1024, 2 * (head // 6)),
                _rope_params(1024, 2 * (head // 6)),
            ],
            dim=1,
        )
        self.freqs = list(table.split([c - 2 * (c // 3), c // 3, c // 3], dim=1))
        action_head = sum(geometry.rope_dims)
        self.action_cos, self.action_sin = _action_freqs(geometry.rope_dims, geometry.rope_theta)
        self.frame_tokens = frame_tokens
        size = geometry.local_attn_size
        self.kv = [_cache(size * frame_tokens, (1, geometry.num_heads, head)) for _ in range(self.layers)]
        self.kv_mouse = [_cache(size, (frame_tokens, geometry.action_heads, action_head)) for _ in range(self.layers)]
        self.kv_keyboard = [_cache(size, (1, geometry.action_heads, action_head)) for _ in range(self.layers)]

    def __call__(
        self,
        x: Tensor,
        t: Tensor,
        visual_context: Tensor,
        cond_concat: Tensor,
        mouse_cond: Tensor | None,
        keyboard_cond: Tensor,
        current_start_frame: int,
        block: int = 3,
    ) -> Tensor:
        """The flow prediction for one block ``x`` [1, C, F, H, W] at per-frame ``t`` [1, F]; the
        conditions are the reference's: the block's ``cond_concat`` and the actions of every video frame
        from the first to the block's last, ``[1, 1 + 4 (start + F - 1), ...]``."""
        sd, g = self.sd, self.g
        x = torch.cat([x, cond_concat], dim=1)
        patch = sd["patch_embedding.weight"]
        hidden = F.conv3d(x, patch, sd["patch_embedding.bias"], stride=tuple(patch.shape[2:]))
        grid = (hidden.shape[2], hidden.shape[3], hidden.shape[4])
        hidden = hidden.flatten(2).transpose(1, 2)
        frames = grid[0]
        dim = self.dim
        e = _linear(sd, "time_embedding.0", _sinusoid(sd["time_embedding.0.weight"].shape[1], t.flatten()))
        e = _linear(sd, "time_embedding.2", F.silu(e))
        e0 = _linear(sd, "time_projection.1", F.silu(e)).unflatten(1, (6, dim)).unflatten(0, t.shape)
        ctx = _layer_norm(visual_context, sd, "img_emb.proj.0", 1e-5)
        ctx = F.gelu(_linear(sd, "img_emb.proj.1", ctx))
        ctx = _layer_norm(_linear(sd, "img_emb.proj.3", ctx), sd, "img_emb.proj.4", 1e-5)
        start = current_start_frame
        seq = self.frame_tokens
        for i in range(self.layers):
            p = f"blocks.{i}"
            mod = (sd[f"{p}.modulation"].unsqueeze(1) + e0).chunk(6, dim=2)
            normed = (_layer_norm(hidden, None, "", g.eps).unflatten(1, (frames, seq)) * (1 + mod[1]) + mod[0]).flatten(
                1, 2
            )
            y = self._self_attention(i, normed, grid, start)
            hidden = hidden + (y.unflatten(1, (frames, seq)) * mod[2]).flatten(1, 2)
            hidden = hidden + self._cross_attention(p, _layer_norm(hidden, sd, f"{p}.norm3", g.eps), ctx)
            if i in g.action_blocks:
                hidden = self._action(i, hidden, grid, mouse_cond, keyboard_cond, start, block)
            normed = (_layer_norm(hidden, None, "", g.eps).unflatten(1, (frames, seq)) * (1 + mod[4]) + mod[3]).flatten(
                1, 2
            )
            y = _linear(sd, f"{p}.ffn.2", F.gelu(_linear(sd, f"{p}.ffn.0", normed), approximate="tanh"))
            hidden = hidden + (y.unflatten(1, (frames, seq)) * mod[5]).flatten(1, 2)
        head_mod = (sd["head.modulation"].unsqueeze(1) + e.unflatten(0, t.shape).unsqueeze(2)).chunk(2, dim=2)
        out = _layer_norm(hidden, None, "", g.eps).unflatten(1, (frames, seq)) * (1 + head_mod[1]) + head_mod[0]
        out = _linear(sd, "head.head", out)
        p_t, p_h, p_w = patch.shape[2:]
        channels = out.shape[-1] // (p_t * p_h * p_w)
        out = out.reshape(1, *grid, p_t, p_h, p_w, channels)
        out = torch.einsum("bfhwpqrc->bcfphqwr", out)
        return out.reshape(1, channels, grid[0] * p_t, grid[1] * p_h, grid[2] * p_w)

    def _self_attention(self, i: int, x: Tensor, grid: tuple[int, int, int], start_frame: int) -> Tensor:
        sd, n = self.sd, self.g.num_heads
        p = f"blocks.{i}.self_attn"
        b, s, _ = x.shape
        q = _wan_rms(_linear(self.sd, f"{p}.q", x), sd[f"{p}.norm_q.weight"]).view(b, s, n, -1)
        k = _wan_rms(_linear(self.sd, f"{p}.k", x), sd[f"{p}.norm_k.weight"]).view(b, s, n, -1)
        v = _linear(self.sd, f"{p}.v", x).view(b, s, n, -1)
        q = _causal_rope(q, grid, self.freqs, start_frame)
        k = _causal_rope(k, grid, self.freqs, start_frame)
        window = self.g.local_attn_size * self.frame_tokens
        out = _cached_attend(self.kv[i], q, k, v, start_frame * self.frame_tokens, window)
        return _linear(self.sd, f"{p}.o", out.flatten(2))

    def _cross_attention(self, p: str, x: Tensor, ctx: Tensor) -> Tensor:
        sd, n = self.sd, self.g.num_heads
        b = x.shape[0]
        q = _wan_rms(_linear(sd, f"{p}.cross_attn.q", x), sd[f"{p}.cross_attn.norm_q.weight"]).view(
            b, -1, n, x.shape[-1] // n
        )
        k = _wan_rms(_linear(sd, f"{p}.cross_attn.k", ctx), sd[f"{p}.cross_attn.norm_k.weight"]).view(
            b, -1, n, x.shape[-1] // n
        )
        v = _linear(sd, f"{p}.cross_attn.v", ctx).view(b, -1, n, x.shape[-1] // n)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return _linear(sd, f"{p}.cross_attn.o", out.flatten(2))

    def _action(
        self,
        i: int,
        x: Tensor,
        grid: tuple[int, int, int],
        mouse_condition: Tensor | None,
        keyboard_condition: Tensor,
        start_frame: int,
        block: int,
    ) -> Tensor:
        sd, g = self.sd, self.g
        p = f"blocks.{i}.action_model"
        tt, th, tw = grid
        S = th * tw
        B, n_frames, _ = keyboard_condition.shape
        n_feats = (n_frames - 1) // g.ratio + 1
        assert n_feats == start_frame + block
        pad_t = g.ratio * g.window
        freqs = (self.action_cos, self.action_sin)
        heads = g.action_heads
        hidden_states = x
        if g.mouse:
            assert mouse_condition is not None
            C = mouse_condition.shape[2]
            hs = x.reshape(B, tt, S, -1).transpose(1, 2).reshape(B * S, tt, -1)  # "B (T S) C -> (B S) T C"
            gm = reference_windows(mouse_condition, block, g.window, g.ratio)  # [B, F, pad_t, C]
            gm = gm.unsqueeze(-1).expand(B, block, pad_t, C, S).permute(0, 4, 1, 2, 3).reshape(B * S, block, pad_t * C)
            feat = torch.cat([hs, gm], dim=-1)
            feat = _linear(sd, f"{p}.mouse_mlp.0", feat)
            feat = _linear(sd, f"{p}.mouse_mlp.2", F.gelu(feat, approximate="tanh"))
            feat = _layer_norm(feat, sd, f"{p}.mouse_mlp.3", 1e-5)
            qkv = F.linear(feat, sd[f"{p}.t_qkv.weight"], sd.get(f"{p}.t_qkv.bias"))
            q, k, v = qkv.view(B * S, block, 3, heads, -1).permute(2, 0, 1, 3, 4)  # "B L (K H D) -> K B L H D"
            q = _action_rms(q)
            k = _action_rms(k)
            q = _apply_action_rope(q, freqs[0], freqs[1], start_frame)
            k = _apply_action_rope(k, freqs[0], freqs[1], start_frame)
            attn = _cached_attend(self.kv_mouse[i], q, k, v, start_frame, g.local_attn_size)
            attn = (
                attn.reshape(B, S, block, -1).transpose(1, 2).reshape(B, block * S, -1)
            )  # "(b S) T h d -> b (T S) (h d)"
            hidden_states = x + F.linear(attn, sd[f"{p}.proj_mouse.weight"], sd.get(f"{p}.proj_mouse.bias"))
        embed = _linear(sd, f"{p}.keyboard_embed.2", F.silu(_linear(sd, f"{p}.keyboard_embed.0", keyboard_condition)))
        gk = reference_windows(embed, block, g.window, g.ratio).reshape(B, block, -1)
        mouse_q = F.linear(hidden_states, sd[f"{p}.mouse_attn_q.weight"], sd.get(f"{p}.mouse_attn_q.bias"))
        kv = F.linear(gk, sd[f"{p}.keyboard_attn_kv.weight"], sd.get(f"{p}.keyboard_attn_kv.bias"))
        q = mouse_q.view(B, mouse_q.shape[1], heads, -1)
        k, v = kv.view(B, block, 2, heads, -1).permute(2, 0, 1, 3, 4)
        q = _action_rms(q)
        k = _action_rms(k)
        D = q.shape[-1]
        q = q.view(B, tt, S, heads, D).transpose(1, 2).reshape(B * S, tt, heads, D)
        q = _apply_action_rope(q, freqs[0], freqs[1], start_frame)
        k = _apply_action_rope(k, freqs[0], freqs[1], start_frame)
        k = k.expand(S, *k.shape[1:])
        v = v.expand(S, *v.shape[1:])
        # The reference keeps k[:1] (one session) and repeats the window S times for the attention.
        cache = self.kv_keyboard[i]
        end = _write(cache, k[:1], v[:1], start_frame)
        window = slice(max(0, end - g.local_attn_size), end)
        attn = _attend(q, cache.k[:, window].repeat(S, 1, 1, 1), cache.v[:, window].repeat(S, 1, 1, 1))
        attn = (
            attn.reshape(B, S, tt, heads * D).transpose(1, 2).reshape(B, tt * S, heads * D)
        )  # "(B S) T H D -> B (T S) (H D)"
        return hidden_states + F.linear(attn, sd[f"{p}.proj_keyboard.weight"], sd.get(f"{p}.proj_keyboard.bias"))


def wan_clip_features(sd: Mapping[str, Tensor], pixels: Tensor, heads: int, image_size: int) -> Tensor:
    """``CLIPModel.encode_video`` of Wan's ``clip.py`` on one image ``pixels`` [1, 3, H, W] in [-1, 1]: resized
    (bicubic) to the encoder's input, to [0, 1], normalised with CLIP's mean and std, then the vision
    tower's ``forward(use_31_block=True)`` (every block but the last), on the OpenCLIP names."""
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    video = F.interpolate(pixels, size=(image_size, image_size), mode="bicubic", align_corners=False)
    video = (video.mul(0.5).add(0.5) - mean) / std
    patch = sd["visual.patch_embedding.weight"]
    x = F.conv2d(video, patch, stride=patch.shape[-1]).flatten(2).permute(0, 2, 1)
    b, _, dim = x.shape
    x = torch.cat([sd["visual.cls_embedding"].expand(b, -1, -1), x], dim=1) + sd["visual.pos_embedding"]
    x = _layer_norm(x, sd, "visual.pre_norm", 1e-5)
    layers = len({k.split(".")[2] for k in sd if k.startswith("visual.transformer.")})
    for i in range(layers - 1):
        p = f"visual.transformer.{i}"
        h = _layer_norm(x, sd, f"{p}.norm1", 1e-5)
        q, k, v = _linear(sd, f"{p}.attn.to_qkv", h).view(b, -1, 3, heads, dim // heads).unbind(2)
        x = x + _linear(sd, f"{p}.attn.proj", _attend(q, k, v).reshape(b, -1, dim))
        h = _layer_norm(x, sd, f"{p}.norm2", 1e-5)
        x = x + _linear(sd, f"{p}.mlp.2", F.gelu(_linear(sd, f"{p}.mlp.0", h)))
    return x
