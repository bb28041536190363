"""ABot-World's controls: the keys a block applies, and the control adapter against the reference's.

The reference adapter below is re-typed from its published definition (``amap-cvlab/ABot-World``
``wan/modules/model.py`` ``SimpleAdapter`` and ``ResidualBlock``; the input map from
``pipeline/causal_inference.py`` ``set_act``), so the test does not depend on that repository.
"""

from __future__ import annotations

import itertools

import jsonschema
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from worldserve.models.abot.control_adapter import ControlAdapter, key_map  # noqa: E402
from worldserve.models.abot.controls import (  # noqa: E402
    KEY_ORDER,
    KEYS_SCHEMA,
    NO_KEYS,
    block_keys,
    held_keys,
)
from worldserve.models.base import ModelSpec, SpecControlValidator  # noqa: E402
from worldserve.protocol import ControlInput  # noqa: E402


class _ReferenceResidual(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)

    def forward(self, x):
        residual = x
        out = self.relu(self.conv1(x))
        out = self.conv2(out)
        out += residual
        return out


class _ReferenceAdapter(nn.Module):
    def __init__(self, in_dim, out_dim, kernel_size, stride, downscale_factor=8, num_residual_blocks=1):
        super().__init__()
        self.pixel_unshuffle = nn.PixelUnshuffle(downscale_factor=downscale_factor)
        self.conv = nn.Conv2d(
            in_dim * downscale_factor * downscale_factor, out_dim, kernel_size=kernel_size, stride=stride, padding=0
        )
        self.residual_blocks = nn.Sequential(*[_ReferenceResidual(out_dim) for _ in range(num_residual_blocks)])

    def forward(self, x):
        bs, c, f, h, w = x.size()
        x = x.permute(0, 2, 1, 3, 4).contiguous().view(bs * f, c, h, w)
        out = self.residual_blocks(self.conv(self.pixel_unshuffle(x)))
        out = out.view(bs, f, out.size(1), out.size(2), out.size(3))
        return out.permute(0, 2, 1, 3, 4)


def _reference_map(keys_dict, height, width, num_frames):
    key_order = ["W", "A", "S", "D", "I", "J", "K", "L"]
    action = torch.tensor([1 if keys_dict.get(k, False) else 0 for k in key_order], dtype=torch.float32).unsqueeze(0)
    latents = action[:, None, None, :].repeat(1, height, width, 1).permute([3, 0, 1, 2]).unsqueeze(0)
    latents = latents.repeat_interleave(4, dim=1)
    return latents.repeat(1, 1, num_frames, 1, 1)


def _pair(dim=8, downscale=16, seed=0):
    torch.manual_seed(seed)
    reference = _ReferenceAdapter(32, dim, kernel_size=(2, 2), stride=(2, 2), downscale_factor=downscale)
    for p in reference.parameters():  # the default init leaves the residual branch tiny: make it count
        nn.init.normal_(p, std=0.05)
    ours = ControlAdapter(dim, downscale=downscale)
    ours.load_state_dict(reference.state_dict(), strict=True)  # the checkpoint's names, one to one
    return reference.eval(), ours.eval()


KEY_SETS = [(), ("W",), ("W", "A"), ("S", "D", "I", "L"), tuple(KEY_ORDER)]


def test_the_adapter_is_the_references_on_the_references_map():
    reference, ours = _pair()
    height, width = 64, 96  # 16x spatial (the VAE's) and 2x2 patches: a 2x3 grid
    with torch.no_grad():
        for keys in KEY_SETS:
            context = _reference_map({k: True for k in keys}, height, width, num_frames=3)
            bits = [1 if k in keys else 0 for k in KEY_ORDER]
            assert torch.equal(context, key_map(bits, 3, height, width))
            want = reference(context)
            assert want.shape == (1, 8, 3, 2, 3)
            assert torch.equal(ours(context), want)


@pytest.mark.parametrize(("downscale", "height", "width"), [(16, 64, 96), (4, 24, 40)])
def test_key_features_equal_the_full_map_path(downscale, height, width):
    reference, ours = _pair(downscale=downscale, seed=1)
    grid = (height // (2 * downscale), width // (2 * downscale))
    with torch.no_grad():
        outputs = set()
        for keys in itertools.chain(KEY_SETS, [("K",), ("J", "D")]):
            bits = [1 if k in keys else 0 for k in KEY_ORDER]
            want = reference(_reference_map({k: True for k in keys}, height, width, num_frames=2))
            got = ours.block_features([bits], frames=2, grid=grid)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            outputs.add(tuple(got.flatten().tolist()))
        assert len(outputs) == 7  # every key set gives its own features
        border, inner = want[0, :, 0, 0, 0], want[0, :, 0, -1, -1]
        if grid[0] > 2 and grid[1] > 2:
            assert not torch.allclose(border, inner)  # the padded residual convs see the edge


def test_key_features_are_kept_until_a_weight_changes():
    _, ours = _pair(seed=2)
    bits = [1, 0, 0, 0, 0, 0, 0, 1]
    first = ours.key_features(bits, (2, 3))
    assert ours.key_features(bits, (2, 3)) is first
    batch = ours.block_features([bits, [0] * 8], frames=3, grid=(2, 3))
    assert batch.shape == (2, 8, 3, 2, 3)
    assert torch.equal(batch[0, :, 2], first)
    _, other = _pair(seed=3)
    ours.load_state_dict(other.state_dict())
    changed = ours.key_features(bits, (2, 3))
    torch.testing.assert_close(changed, other.key_features(bits, (2, 3)))
    assert not torch.equal(changed, first)
    with pytest.raises(ValueError, match="8 key bits"):
        ours.key_features([1, 0], (2, 3))


def test_a_block_applies_the_keys_held_and_of_a_pair_the_one_pressed_last():
    first = block_keys({"W", "A"})
    assert first.applied == {"W", "A"}
    assert first.bits == (1, 1, 0, 0, 0, 0, 0, 0)
    # S pressed while W is held: S, pressed since the block before, wins; W counts again when S goes.
    second = block_keys({"W", "A", "S"}, first)
    assert second.applied == {"A", "S"}
    assert second.bits == (0, 1, 1, 0, 0, 0, 0, 0)
    third = block_keys({"W", "A", "S"}, second)
    assert third.applied == {"A", "S"}  # still held together: the winner stays
    assert block_keys({"W", "A"}, third).applied == {"W", "A"}
    # Both pressed in one tick from nothing: no order known, the first of KEY_ORDER.
    assert block_keys({"I", "K", "J", "L"}).applied == {"I", "J"}
    assert block_keys({"I", "K"}, block_keys({"K"})).applied == {"I"}
    assert NO_KEYS.bits == (0,) * 8
    with pytest.raises(ValueError, match="abot-world takes the keys"):
        block_keys({"W", "Z"})


def test_the_keys_track_takes_the_eight_keys_held():
    spec = ModelSpec("abot-test", 12, 16.0, 64, 96, (KEYS_SCHEMA,), max_batch_size=1, state_bytes=0)
    validator = SpecControlValidator(spec)
    good = ControlInput("keys", "worldserve.keys.v1", {"held": ["W", "L"]})
    validator.validate_controls([good])  # accepted
    assert held_keys([good]) == {"W", "L"}
    assert held_keys([]) == frozenset()
    for bad in ({"held": ["W", "W"]}, {"held": ["Z"]}, {"held": "W"}, {}):
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            validator.validate_controls([ControlInput("keys", "worldserve.keys.v1", bad)])
