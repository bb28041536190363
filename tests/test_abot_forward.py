"""``abot-world``'s cached forward against a re-typed reference of ABot-World's streaming forward.

A tiny checkpoint is written under the published key names (``original_layout``: Wan's original
names and ``act_control_adapter.*``) to a safetensors file, loaded by worldserve's loader into the
diffusers modules and the control adapter, and streamed block by block through
:class:`~worldserve.models.abot.forward.ABotForward` and the KV cache, and through
``tests/abot_reference.py`` (``CausalWanModel._forward_inference`` re-typed, on the same tensors by
their original names): every pass's flow prediction is equal, in the first block (the start image at
timestep 0, the reference slots as queries, one slot masked out), across the window's evictions and
the relative RoPE's rebases, and for two sessions at different positions batched in one call.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from abot_reference import ABotReference  # noqa: E402
from test_abot_controls import _reference_map, _ReferenceAdapter  # noqa: E402
from worldserve.models.abot.checkpoint import (  # noqa: E402
    ADAPTER_PREFIX,
    build_adapter,
    load_checkpoint,
    original_layout,
    read_checkpoint,
)
from worldserve.models.abot.config import CONFIGS  # noqa: E402
from worldserve.models.abot.controls import KEY_ORDER  # noqa: E402
from worldserve.models.abot.forward import ABotForward  # noqa: E402
from worldserve.models.wan.build import build_transformer  # noqa: E402
from worldserve.models.wan.cache import BatchKV, KVCache  # noqa: E402
from worldserve.models.wan.rope import FrameRope, RelativeWindow, slot_times  # noqa: E402
from worldserve.models.wan.statedict import WeightsError  # noqa: E402

CONFIG = CONFIGS["tiny"]
WAN = CONFIG.wan
CPU = torch.device("cpu")
TOL = {"rtol": 1e-5, "atol": 1e-5}  # diffusers' timestep features are float32; the rest is float64


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in original_layout(CONFIG).items():
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            sd[name] = 1 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
        else:
            sd[name] = 0.2 * torch.randn(shape, generator=generator, dtype=torch.float64)
    return sd


def _ours(path):
    transformer, adapter = build_transformer(WAN), build_adapter(CONFIG)
    load_checkpoint(read_checkpoint(path), transformer, adapter, CONFIG)
    return ABotForward(transformer.double().eval(), adapter.double().eval(), CONFIG)


def _reference(sd):
    adapter = _ReferenceAdapter(
        CONFIG.keys * CONFIG.key_repeat, WAN.dim, (2, 2), (2, 2), downscale_factor=CONFIG.adapter_downscale
    )
    adapter.load_state_dict({k[len(ADAPTER_PREFIX) :]: v for k, v in sd.items() if k.startswith(ADAPTER_PREFIX)})
    return ABotReference(
        sd,
        heads=WAN.num_heads,
        patch=WAN.patch,
        grid=(WAN.latent_height // 2, WAN.latent_width // 2),
        slots=CONFIG.ref_slots,
        ref_grid=(1, *CONFIG.ref_grid),
        local=CONFIG.local_frames,
        limit=CONFIG.rope_limit,
        text_len=WAN.text_len,
        adapter=adapter.double().eval(),
    )


class _Session:
    """One session's stream on worldserve's side: its cache, relative-RoPE base, reference, inputs."""

    def __init__(self, sd, seed: int, mask: list[float]) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = KVCache(WAN, CPU, torch.float64, ref_tokens=CONFIG.ref_tokens)
        self.base = 0
        self.reference = _reference(sd)
        self.text = self._rand(1, WAN.text_len, WAN.text_dim)
        side = CONFIG.ref_resolution // WAN.vae_spatial
        self.ref_latents = self._rand(1, CONFIG.ref_slots, WAN.latent_channels, 1, side, side)
        self.ref_mask = torch.tensor([mask], dtype=torch.float64)
        self.image = self._rand(1, WAN.latent_channels, 1, WAN.latent_height, WAN.latent_width)

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64)

    def inputs(self, first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """A pass's noisy latents and timesteps, the commit pass's clean ones, and the block's key bits."""
        frames = WAN.block_frames
        noisy = self._rand(1, WAN.latent_channels, frames, WAN.latent_height, WAN.latent_width)
        clean = self._rand(1, WAN.latent_channels, frames, WAN.latent_height, WAN.latent_width)
        t = torch.full((1, frames), 700.0 + 100 * float(torch.rand(1, generator=self.generator)), dtype=torch.float64)
        if first:  # the start image, clean, at timestep 0
            noisy[:, :, :1] = clean[:, :, :1] = self.image
            t[:, 0] = 0
        bits = [int(b) for b in (torch.rand(len(KEY_ORDER), generator=self.generator) < 0.4)]
        return noisy, clean, t, bits


def _run(forward: ABotForward, rope: FrameRope, window: RelativeWindow, sessions: list[_Session]) -> None:
    """One block for every session (all first blocks or none), each pass checked against its reference."""
    first = sessions[0].cache.next_frame == 0
    assert all((s.cache.next_frame == 0) == first for s in sessions)
    starts = [s.cache.next_frame for s in sessions]
    for session, start in zip(sessions, starts, strict=True):
        base = window.base_for(session.base, start, WAN.block_frames)
        if base != session.base and not first:
            session.base = base
            session.cache.rotate_refs(
                *rope.slots(slot_times(base, CONFIG.ref_slots, CONFIG.ref_tokens_per_slot), CONFIG.ref_grid)
            )
    drawn = [s.inputs(first) for s in sessions]
    noisy = torch.cat([d[0] for d in drawn])
    clean = torch.cat([d[1] for d in drawn])
    t = torch.cat([d[2] for d in drawn])
    keys = [d[3] for d in drawn]
    text = torch.cat([s.text for s in sessions])
    refs = ref_rope = None
    if first:
        refs = forward.ref_tokens(
            torch.cat([s.ref_latents for s in sessions]), torch.cat([s.ref_mask for s in sessions])
        )
        cos, sin = rope.slots(slot_times(0, CONFIG.ref_slots, CONFIG.ref_tokens_per_slot), CONFIG.ref_grid)
        ref_rope = (cos.expand(len(sessions), -1, -1, -1), sin.expand(len(sessions), -1, -1, -1))
    frame_rope = rope(starts, WAN.block_frames)
    kv = BatchKV([s.cache for s in sessions])
    got = forward(noisy, t, text, keys, kv, frame_rope, refs=refs, ref_rope=ref_rope)
    kv.record()
    zero = torch.zeros_like(t)
    assert forward(clean, zero, text, keys, kv, frame_rope, refs=refs, ref_rope=ref_rope, head=False) is None
    kv.commit()
    for row, (session, start, (x, x0, tt, bits)) in enumerate(zip(sessions, starts, drawn, strict=True)):
        act = _reference_map(
            dict(zip(KEY_ORDER, map(bool, bits), strict=True)), WAN.height, WAN.width, WAN.block_frames
        )
        refs_in = (session.ref_latents, session.ref_mask) if first else (None, None)
        want = session.reference(x, tt, session.text, act.double(), start, *refs_in)
        session.reference(x0, torch.zeros_like(tt), session.text, act.double(), start, *refs_in)  # its commit pass
        torch.testing.assert_close(got[row : row + 1], want, **TOL)
        assert session.base == session.reference.attention[0].base


def test_the_stream_equals_the_references_across_evictions_rebases_and_a_batch(tmp_path) -> None:
    sd = _checkpoint()
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    safetensors_torch.save_file(sd, str(path))
    forward = _ours(path)
    rope = FrameRope(WAN, CPU)
    window = RelativeWindow(CONFIG.local_frames, limit=CONFIG.rope_limit, table=CONFIG.rope_table)
    a = _Session(sd, seed=1, mask=[1.0, 0.0])  # its second reference image missing: a zero slot
    b = _Session(sd, seed=2, mask=[1.0, 1.0])
    with torch.no_grad():
        for _ in range(3):
            _run(forward, rope, window, [a])
        _run(forward, rope, window, [b])
        for _ in range(9):  # a ahead of b: caches of different lengths in one call, then both full
            _run(forward, rope, window, [a, b])
    assert a.base > 0
    assert b.base > 0
    assert a.reference.attention[0].base != b.reference.attention[0].base
    assert a.cache.cached_frames == b.cache.cached_frames == WAN.window_frames


def test_a_missing_reference_image_is_a_zero_slot(tmp_path) -> None:
    """A slot masked out (no image) has zero tokens; the others are as unmasked."""
    sd = _checkpoint(seed=3)
    path = tmp_path / "ckpt.safetensors"
    safetensors_torch.save_file(sd, str(path))
    forward = _ours(path)
    latents = torch.randn(1, CONFIG.ref_slots, WAN.latent_channels, 1, 4, 4, dtype=torch.float64)
    masked = forward.ref_tokens(latents, torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    full = forward.ref_tokens(latents, torch.tensor([[1.0, 1.0]], dtype=torch.float64))
    tps = CONFIG.ref_tokens_per_slot
    assert torch.equal(masked[:, :tps], full[:, :tps])
    assert not masked[:, tps:].any()
    assert full[:, tps:].abs().sum() > 0


def test_a_checkpoint_without_the_adapter_or_with_a_wrong_shape_is_refused(tmp_path) -> None:
    sd = _checkpoint()
    transformer, adapter = build_transformer(WAN), build_adapter(CONFIG)
    no_adapter = tmp_path / "no_adapter.safetensors"
    safetensors_torch.save_file({k: v for k, v in sd.items() if not k.startswith(ADAPTER_PREFIX)}, str(no_adapter))
    with pytest.raises(WeightsError, match="not an ABot-World checkpoint"):
        load_checkpoint(read_checkpoint(no_adapter), transformer, adapter, CONFIG)
    wrong = dict(sd)
    wrong[ADAPTER_PREFIX + "conv.weight"] = torch.zeros(3, 3, dtype=torch.float64)
    bad = tmp_path / "bad.safetensors"
    safetensors_torch.save_file(wrong, str(bad))
    with pytest.raises(WeightsError, match=r"act_control_adapter\.conv\.weight"):
        load_checkpoint(read_checkpoint(bad), transformer, adapter, CONFIG)
