"""ABot-World's control adapter: a block's key bits -> features added to its patch embeddings.

Owns: :class:`ControlAdapter`, laid out as the reference's ``SimpleAdapter``
(``wan/modules/model.py``; in the checkpoint under ``act_control_adapter.``): ``pixel_unshuffle``
(no weights), ``conv`` (``keys * repeat * downscale**2`` -> the model width, the patch's kernel and
stride, no padding) and ``residual_blocks.N.conv1`` / ``.conv2`` (3x3, padding 1, a ReLU between, the
input added back), and :func:`key_map`, the reference's input for a block's keys.

What the reference feeds it (``pipeline/causal_inference.py`` ``set_act``): the eight key bits
broadcast over every pixel of the video and every latent frame of the block, each bit repeated in
``repeat`` = 4 consecutive channels (32 in all); the adapter's output, one model-width feature per
patch and latent frame, is added to the block's patch embeddings at scale 1 (``CausalWanModel.
_apply_control_adapters``; the wrapper's default ``act_context_scale``). :meth:`ControlAdapter.forward`
is that path, the reference's arithmetic on a full-size map.

:meth:`ControlAdapter.key_features` gets the same features without building the map: the map is
constant over the image, so after the unshuffle every channel of key *k*'s group holds bit *k*, and the
unpadded patch convolution is the same at every patch: its bias plus, per key, the sum of the kernel
over that key's channels and taps, times the bit. The residual blocks (padded, so the border
differs) then run on that constant grid, once per frame size rather than per latent frame. Equal to
:meth:`forward` up to the order of the sums (``tests/test_abot_controls.py``); at 704x1280 it skips a
``[32, 704, 1280]`` map and an 8192-channel convolution per frame. The results are kept per key set
and grid (at most 256 key sets), until a weight changes.

Must not know: the transformer, sessions, the controls' wire form.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["ControlAdapter", "key_map"]


class _Residual(nn.Module):
    """``ResidualBlock``: conv 3x3 -> ReLU -> conv 3x3, plus the input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.conv2(torch.relu(self.conv1(x))) + x
        return out


def key_map(bits: Sequence[int], frames: int, height: int, width: int, *, repeat: int = 4) -> Tensor:
    """The reference's adapter input for one block: ``[1, len(bits) * repeat, frames, height, width]``."""
    values = torch.tensor([float(bit) for bit in bits]).repeat_interleave(repeat)
    return values.view(1, -1, 1, 1, 1).expand(1, values.numel(), frames, height, width).contiguous()


class ControlAdapter(nn.Module):
    """See the module docstring; ``dim`` is the transformer's width."""

    def __init__(
        self,
        dim: int,
        *,
        keys: int = 8,
        repeat: int = 4,
        downscale: int = 16,
        patch: tuple[int, int] = (2, 2),
        residual_blocks: int = 1,
        memo: int = 256,
    ) -> None:
        super().__init__()
        self.keys, self.repeat, self.downscale, self.patch = keys, repeat, downscale, patch
        self.pixel_unshuffle = nn.PixelUnshuffle(downscale)
        self.conv = nn.Conv2d(keys * repeat * downscale * downscale, dim, kernel_size=patch, stride=patch)
        self.residual_blocks = nn.Sequential(*[_Residual(dim) for _ in range(residual_blocks)])
        self._memo: OrderedDict[tuple[object, ...], Tensor] = OrderedDict()
        self._memo_size = memo

    @property
    def pixels_per_patch(self) -> tuple[int, int]:
        """Video pixels per output feature along height and width (the VAE's and the patch's together)."""
        return self.downscale * self.patch[0], self.downscale * self.patch[1]

    def forward(self, context: Tensor) -> Tensor:
        """The reference's path: ``context`` ``[B, keys * repeat, F, H, W]`` -> ``[B, dim, F, H / 32, W / 32]``."""
        batch, channels, frames, height, width = context.shape
        flat = context.permute(0, 2, 1, 3, 4).reshape(batch * frames, channels, height, width)
        out: Tensor = self.residual_blocks(self.conv(self.pixel_unshuffle(flat)))
        return out.view(batch, frames, *out.shape[1:]).permute(0, 2, 1, 3, 4)

    def key_features(self, bits: Sequence[int], grid: tuple[int, int]) -> Tensor:
        """One latent frame's features ``[dim, h, w]`` for the key ``bits`` on a ``grid`` of (h, w) patches."""
        if len(bits) != self.keys:
            raise ValueError(f"the control adapter takes {self.keys} key bits; got {len(bits)}.")
        weight = self.conv.weight
        key = (
            tuple(int(bit) for bit in bits),
            tuple(grid),
            weight.dtype,
            weight.device,
            tuple((p.data_ptr(), p._version) for p in self.parameters()),
        )
        cached = self._memo.get(key)
        if cached is not None:
            self._memo.move_to_end(key)
            return cached
        with torch.no_grad():
            # [dim, keys]: per key, the kernel summed over its repeat * downscale**2 channels and its taps.
            per_key = weight.float().view(weight.shape[0], self.keys, -1).sum(-1)
            bias = self.conv.bias.float() if self.conv.bias is not None else torch.zeros_like(per_key[:, 0])
            values = torch.tensor([float(bit) for bit in bits], device=weight.device)
            vector = (bias + per_key @ values).to(weight.dtype)
            grid_map = vector.view(1, -1, 1, 1).expand(1, vector.numel(), *grid).contiguous()
            features: Tensor = self.residual_blocks(grid_map)[0]
        if len(self._memo) >= self._memo_size:
            self._memo.popitem(last=False)
        self._memo[key] = features
        return features

    def block_features(self, bits: Sequence[Sequence[int]], frames: int, grid: tuple[int, int]) -> Tensor:
        """Features for a batch of blocks, row *i* with the key ``bits[i]``: ``[B, dim, frames, h, w]``
        (each row's one frame of features, the same for every latent frame of its block)."""
        rows = [self.key_features(row, grid) for row in bits]
        return torch.stack(rows)[:, :, None].expand(-1, -1, frames, -1, -1)
