"""TAEHV (``decoder=taehv``) against the published definition's one-shot decode, re-typed here.

The reference below is a separate, functional re-typing of madebyollin/taehv's ``TAEHV.decoder``
run the published "parallel" way (every frame at once, each memory block's past the frames
shifted by one with zeros first, the first 3 output frames trimmed), reading the weights by their
published key names; it imports nothing of worldserve's decoder. The streamed, batched decode
must equal it chunk by chunk; a published state dict loads key by key; both Wan models serve with
it and keep their atomic step / rollback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models import load_model  # noqa: E402
from worldserve.models.base import SessionOptions  # noqa: E402
from worldserve.models.wan.config import CONFIGS  # noqa: E402
from worldserve.models.wan.decoders import (  # noqa: E402
    DecoderChoice,
    build_frame_decoder,
    choose_decoder,
    frame_decoder_bytes,
)
from worldserve.models.wan.statedict import WeightsError  # noqa: E402
from worldserve.models.wan.taehv import (  # noqa: E402
    TaehvDecoder,
    TaehvStream,
    load_taehv_weights,
    taehv_variant,
)
from worldserve.protocol import TickRequest  # noqa: E402

TOL = 1e-5
SMALL = (16, 8, 8, 8)


# --- the published decoder, re-typed (functional, by its published key names) --------------------


def published_keys(
    latent: int, widths: tuple[int, ...], grow_rows_first: int | None = None, patch: int = 1
) -> dict[str, tuple[int, ...]]:
    """``TAEHV.decoder``'s parameters: Clamp, conv, ReLU, 3 x (3 MemBlock, Upsample, TGrow, conv), ReLU, conv
    (to ``3 * patch**2`` channels: ``taew2_2``'s ``patch_size`` 2)."""
    keys: dict[str, tuple[int, ...]] = {"decoder.1.weight": (widths[0], latent, 3, 3), "decoder.1.bias": (widths[0],)}
    index = 3
    for group, stride in enumerate((1, 2, 2)):
        n = widths[group]
        for _ in range(3):
            keys[f"decoder.{index}.conv.0.weight"] = (n, 2 * n, 3, 3)
            keys[f"decoder.{index}.conv.0.bias"] = (n,)
            for inner in (2, 4):
                keys[f"decoder.{index}.conv.{inner}.weight"] = (n, n, 3, 3)
                keys[f"decoder.{index}.conv.{inner}.bias"] = (n,)
            index += 1
        index += 1  # Upsample
        rows = n * stride if not (group == 0 and grow_rows_first) else grow_rows_first
        keys[f"decoder.{index}.conv.weight"] = (rows, n, 1, 1)
        index += 1
        keys[f"decoder.{index}.weight"] = (widths[group + 1], n, 3, 3)
        index += 1
    keys[f"decoder.{index + 1}.weight"] = (3 * patch * patch, widths[3], 3, 3)
    keys[f"decoder.{index + 1}.bias"] = (3 * patch * patch,)
    return keys


def random_published(latent: int, widths: tuple[int, ...], seed: int = 0, **kw: Any) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in published_keys(latent, widths, **kw).items():
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        out[key] = torch.randn(shape, generator=generator) / fan_in**0.5
    return out


def reference_decode(sd: dict[str, Tensor], latents: Tensor, patch: int = 1) -> Tensor:
    """The published one-shot (parallel) decode of ``latents`` ``[N, T, C, h, w]``: ``[N, 4T - 3, 3, 8ph, 8pw]``
    (``patch`` p: the published ``postprocess_output_frames``' pixel shuffle, then the clamp and the trim)."""
    n, t = latents.shape[:2]
    x = torch.tanh(latents.flatten(0, 1) / 3) * 3
    x = F.relu(F.conv2d(x, sd["decoder.1.weight"], sd["decoder.1.bias"], padding=1))
    index = 3
    for stride in (1, 2, 2):
        for _ in range(3):
            seq = x.reshape(n, t, *x.shape[1:])
            past = F.pad(seq, (0, 0, 0, 0, 0, 0, 1, 0))[:, :t].reshape(x.shape)
            p = f"decoder.{index}.conv."
            y = F.relu(F.conv2d(torch.cat([x, past], 1), sd[p + "0.weight"], sd[p + "0.bias"], padding=1))
            y = F.relu(F.conv2d(y, sd[p + "2.weight"], sd[p + "2.bias"], padding=1))
            y = F.conv2d(y, sd[p + "4.weight"], sd[p + "4.bias"], padding=1)
            x = F.relu(y + x)
            index += 1
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        index += 1
        c = x.shape[1]
        weight = sd[f"decoder.{index}.conv.weight"][-c * stride :]
        x = F.conv2d(x, weight).reshape(-1, c, *x.shape[2:])
        t *= stride
        index += 1
        x = F.conv2d(x, sd[f"decoder.{index}.weight"], padding=1)
        index += 1
    x = F.conv2d(F.relu(x), sd[f"decoder.{index + 1}.weight"], sd[f"decoder.{index + 1}.bias"], padding=1)
    if patch > 1:
        x = F.pixel_shuffle(x, patch)
    return x.reshape(n, t, *x.shape[1:]).clamp(0, 1)[:, 3:]


def small_stream(latent: int = 4, seed: int = 0, patch: int = 1) -> tuple[TaehvStream, dict[str, Tensor]]:
    sd = random_published(latent, SMALL, seed, patch=patch)
    module = TaehvDecoder(latent, SMALL, patch=patch)
    module.decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in sd.items()})
    return TaehvStream(module.eval()), sd


# --- (1) streamed == one-shot -----------------------------------------------------------------------


@torch.no_grad()
def test_the_streamed_decode_equals_the_published_one_shot_decode() -> None:
    stream, sd = small_stream()
    latents = torch.randn(1, 4, 12, 4, 5)  # [B, C, F, h, w]: 4 chunks of 3 latent frames
    cache = stream.new_cache()
    chunks = [stream.decode(latents[:, :, i : i + 3], [cache], first=i == 0) for i in range(0, 12, 3)]
    assert [c.shape[2] for c in chunks] == [9, 12, 12, 12]  # the VAE's 1 + 4(F - 1), then 4F
    streamed = (torch.cat(chunks, dim=2) + 1) / 2  # [-1, 1] -> the reference's [0, 1]
    one_shot = reference_decode(sd, latents.transpose(1, 2)).transpose(1, 2)
    assert streamed.shape == one_shot.shape == (1, 3, 45, 32, 40)
    assert (streamed - one_shot).abs().max().item() <= TOL
    assert one_shot.std() > 0.01  # the frames are not a constant


# --- (2) batched == alone ---------------------------------------------------------------------------


@torch.no_grad()
def test_a_batch_of_sessions_at_different_positions_decodes_as_each_alone() -> None:
    stream, _ = small_stream(seed=1)
    torch.manual_seed(2)
    history = [torch.randn(1, 4, 3 * k, 4, 4) for k in (2, 0, 1)]  # sessions 2, 0 and 1 chunks in
    alone_caches = []
    for past in history:
        cache = stream.new_cache()
        for i in range(0, past.shape[2], 3):
            stream.decode(past[:, :, i : i + 3], [cache], first=i == 0)
        alone_caches.append(cache)
    batch_caches = [list(cache) for cache in alone_caches]
    before = [list(cache) for cache in alone_caches]
    latents = torch.randn(3, 4, 3, 4, 4)
    firsts = [False, True, False]
    together = stream.decode_rows(latents, batch_caches, firsts)
    for row in range(3):
        alone = stream.decode_rows(latents[row : row + 1], [alone_caches[row]], [firsts[row]])[0]
        assert together[row].shape == alone.shape == (3, 9 if firsts[row] else 12, 32, 32)
        assert (together[row] - alone).abs().max().item() <= TOL
        for mine, theirs in zip(batch_caches[row], alone_caches[row], strict=True):
            assert (mine - theirs).abs().max().item() <= TOL
    # The decode rebinds the lists' entries to fresh tensors: copies taken before it are untouched.
    assert before[1] == [None] * 9
    assert all(old is not new for old, new in zip(before[0], batch_caches[0], strict=True))


# --- (3) the published key layout ---------------------------------------------------------------------


def test_a_published_state_dict_loads_key_by_key_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    published = random_published(4, SMALL, seed=3, grow_rows_first=2 * SMALL[0])  # a stride-2 TGrow stored
    published["encoder.0.weight"] = torch.zeros(64, 3, 3, 3)  # the encoder's keys are skipped
    path = tmp_path / "taew2_1.pth"
    torch.save(published, path)
    module = TaehvDecoder(4, SMALL)
    load_taehv_weights(path, module)
    state = module.state_dict()
    for key, value in published.items():
        if key.startswith("encoder."):
            assert key not in state
        elif key == "decoder.7.conv.weight":
            assert torch.equal(state[key], value[-SMALL[0] :])  # the last frame's rows, as the published loader
        else:
            assert torch.equal(state[key], value), key
    assert len([k for k in published if k.startswith("decoder.")]) == len(state)

    wrong = dict(published)
    wrong["decoder.20.weight"] = torch.zeros(8, 9, 3, 3)
    torch.save(wrong, tmp_path / "wrong.pth")
    with pytest.raises(
        WeightsError,
        match=r"^TAEHV decoder \S*wrong\.pth: the file has .*decoder\.20\.weight: expected \(8, 8, 3, 3\), "
        r"found \(8, 9, 3, 3\); expected madebyollin's TAEHV",
    ):
        load_taehv_weights(tmp_path / "wrong.pth", TaehvDecoder(4, SMALL))
    extra = {**published, "decoder.99.weight": torch.zeros(1)}
    torch.save(extra, tmp_path / "extra.pth")
    with pytest.raises(
        WeightsError, match=r"^TAEHV decoder \S*extra\.pth: the file has .*not in the model \(1\): decoder\.99\.weight"
    ):
        load_taehv_weights(tmp_path / "extra.pth", TaehvDecoder(4, SMALL))
    missing = {k: v for k, v in published.items() if k != "decoder.3.conv.2.bias"}
    torch.save(missing, tmp_path / "missing.pth")
    with pytest.raises(
        WeightsError, match=r"^TAEHV decoder \S*missing\.pth: the file has .*missing \(1\): decoder\.3\.conv\.2\.bias"
    ):
        load_taehv_weights(tmp_path / "missing.pth", TaehvDecoder(4, SMALL))
    # a file that is not a torch file is named as the TAEHV decoder too, with what was expected (issue 30 item 2)
    (tmp_path / "garbage.pth").write_text("not a torch file")
    with pytest.raises(
        WeightsError, match=r"^TAEHV decoder \S*garbage\.pth: not a torch file .*; expected madebyollin's TAEHV"
    ):
        load_taehv_weights(tmp_path / "garbage.pth", TaehvDecoder(4, SMALL))


def test_the_decoder_option_is_taehv_or_vae_and_a_folder_s_file_is_used_only_with_taehv(tmp_path: Path) -> None:
    (tmp_path / "taehv").mkdir()
    (tmp_path / "taehv" / "taew2_1.pth").write_bytes(b"")
    folder = str(tmp_path)
    assert choose_decoder(None, None, folder, trained=True, model="m").kind == "vae"
    assert choose_decoder("taehv", None, folder, trained=True, model="m").taehv == tmp_path / "taehv" / "taew2_1.pth"
    assert choose_decoder("taehv", "random", folder, trained=True, model="m").taehv is None
    assert choose_decoder("taehv", None, None, trained=False, model="m").taehv is None  # load=dummy: the stand-in
    with pytest.raises(WeightsError, match=r"decoder=taehv: pass taehv=PATH .*or taehv=random"):
        choose_decoder("taehv", None, None, trained=True, model="m")
    with pytest.raises(ValueError, match="needs decoder=taehv"):
        choose_decoder(None, "x.pth", None, trained=False, model="m")
    with pytest.raises(ValueError, match="decoder must be one of vae, taehv"):
        choose_decoder("tiny", None, None, trained=False, model="m")


# --- (3b) Wan2.2's latents: taew2_2.pth (48 channels, 2x2 pixel-shuffled patches, 16x spatial) ------------


@torch.no_grad()
def test_the_wan22_variant_streamed_and_batched_equals_the_published_one_shot_decode() -> None:
    stream, sd = small_stream(latent=48, seed=11, patch=2)
    torch.manual_seed(12)
    latents = torch.randn(2, 48, 9, 3, 4)  # two sessions, 3 chunks of 3 latent frames
    one_shot = reference_decode(sd, latents.transpose(1, 2), patch=2).transpose(1, 2)
    assert one_shot.shape == (2, 3, 33, 48, 64)  # 16x spatial, 1 + 4(F - 1) frames
    assert one_shot.std() > 0.01
    caches = [stream.new_cache(), stream.new_cache()]
    # Session 1 starts a chunk later than session 0: the middle chunk is one batch of a first and a later chunk.
    parts: list[list[Tensor]] = [[], []]
    parts[0] += stream.decode_rows(latents[:1, :, 0:3], caches[:1], [True])
    for (a, b), firsts in (((3, 0), [False, True]), ((6, 3), [False, False])):
        rows = torch.cat([latents[:1, :, a : a + 3], latents[1:, :, b : b + 3]])
        out = stream.decode_rows(rows, caches, firsts)
        parts[0].append(out[0])
        parts[1].append(out[1])
    parts[1] += stream.decode_rows(latents[1:, :, 6:9], caches[1:], [False])
    for row in range(2):
        streamed = (torch.cat(parts[row], dim=1) + 1) / 2
        assert streamed.shape == one_shot[row].shape
        assert (streamed - one_shot[row]).abs().max().item() <= TOL


def test_a_taew2_2_shaped_file_loads_key_by_key_and_the_other_wan_s_file_is_refused(tmp_path: Path) -> None:
    widths = (256, 128, 64, 64)
    published = random_published(48, widths, seed=13, grow_rows_first=2 * widths[0], patch=2)
    published["encoder.0.weight"] = torch.zeros(64, 12, 3, 3)  # its encoder takes 2x2 patches of RGB: skipped
    assert published["decoder.22.weight"].shape == (12, 64, 3, 3)
    path = tmp_path / "taew2_2.pth"
    torch.save(published, path)
    variant = taehv_variant(published)
    assert variant is not None
    assert variant.file == "taew2_2.pth"
    module = TaehvDecoder(48, patch=2)
    load_taehv_weights(path, module)
    state = module.state_dict()
    assert len([k for k in published if k.startswith("decoder.")]) == len(state)
    for key, value in published.items():
        if key.startswith("decoder."):
            expect = value[-widths[0] :] if key == "decoder.7.conv.weight" else value
            assert torch.equal(state[key], expect), key

    with pytest.raises(
        WeightsError,
        match=r"^TAEHV decoder \S*taew2_2\.pth: the file decodes Wan2\.2's latent space \(48 channels, 16x spatial\); "
        r"the model's latents are Wan2\.1's \(16 channels, 8x spatial\); expected madebyollin's TAEHV decoder for "
        r"taew2_1\.pth",
    ):
        load_taehv_weights(path, TaehvDecoder(16))
    wan21 = tmp_path / "taew2_1.pth"
    torch.save(random_published(16, SMALL, seed=14), wan21)
    with pytest.raises(
        WeightsError,
        match=r"^TAEHV decoder \S*taew2_1\.pth: the file decodes Wan2\.1's latent space \(16 channels, 8x spatial\); "
        r"the model's latents are Wan2\.2's \(48 channels, 16x spatial\); expected .*taew2_2\.pth",
    ):
        load_taehv_weights(wan21, TaehvDecoder(48, SMALL, patch=2))
    # Neither: the published _super decoder (its first layer a 1x1 convolution without a bias).
    torch.save({"decoder.0.weight": torch.zeros(512, 48, 1, 1), "decoder.1.conv.0.weight": torch.zeros(1)}, wan21)
    with pytest.raises(WeightsError, match=r"^TAEHV decoder \S*taew2_1\.pth: not a TAEHV decoder for Wan latents"):
        load_taehv_weights(wan21, TaehvDecoder(48, SMALL, patch=2))


@torch.no_grad()
def test_a_wan22_configuration_decodes_with_the_wan22_variant_at_16x(tmp_path: Path) -> None:
    from dataclasses import replace

    config = replace(CONFIGS["tiny"], name="tiny-wan2.2", latent_channels=48, vae_patch=2, width=96)
    assert (config.latent_height, config.latent_width) == (4, 6)
    cpu = torch.device("cpu")
    decoder = build_frame_decoder(DecoderChoice("taehv"), None, config, cpu, torch.float32, 0)  # type: ignore[arg-type]
    assert isinstance(decoder, TaehvStream)
    assert decoder.module.patch == 2
    cache = decoder.new_cache()
    first = decoder.decode(torch.randn(1, 48, 3, 4, 6), [cache], first=True)
    later = decoder.decode(torch.randn(1, 48, 3, 4, 6), [cache])
    assert first.shape == (1, 3, 9, 64, 96)
    assert later.shape == (1, 3, 12, 64, 96)
    assert decoder.nbytes(cache) == frame_decoder_bytes(DecoderChoice("taehv"), config, 4)
    (tmp_path / "taehv").mkdir()
    (tmp_path / "taehv" / "taew2_2.pth").write_bytes(b"")
    found = choose_decoder("taehv", None, str(tmp_path), trained=True, model="m", taehv_file="taew2_2.pth")
    assert found.taehv == tmp_path / "taehv" / "taew2_2.pth"
    with pytest.raises(WeightsError, match=r"holds no taew2_1\.pth"):
        choose_decoder("taehv", None, str(tmp_path), trained=True, model="m")


# --- (4) the models with decoder=taehv ------------------------------------------------------------------


def tick(session: str, index: int) -> TickRequest:
    return TickRequest(session, f"{session}-{index}", index)


@torch.no_grad()
def test_wan_causal_serves_with_taehv_from_its_file_and_a_failed_step_keeps_the_decoder_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worldserve.models.wan import serving

    path = tmp_path / "taew2_1.pth"
    torch.save(random_published(4, (256, 128, 64, 64), seed=5), path)  # the published widths, tiny's 4 channels
    model = load_model("wan-causal", config="tiny", threads=1, decoder="taehv", taehv=str(path))
    twin = load_model("wan-causal", config="tiny", threads=1, decoder="taehv", taehv=str(path))
    assert "decoder: TAEHV (weights taew2_1.pth" in model.spec.description
    loaded = torch.load(path)
    assert all(torch.equal(v, loaded[f"decoder.{k}"]) for k, v in model.decoder.module.decoder.state_dict().items())
    states = [m.new_state("a", SessionOptions(seed=3)) for m in (model, twin)]
    for i in range(2):
        a, b = (m.step([(s, tick("a", i))])[0]["payload"] for m, s in zip((model, twin), states, strict=True))
        assert a.shape == (12, 64, 64, 3)
        assert np.array_equal(a, b)
    held = model.decoder.nbytes(states[0].decoder)
    assert held == model.decoder_cache_bytes
    assert held < model.spec.state_bytes
    before = list(states[0].decoder)

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("frames failed")

    with monkeypatch.context() as patch:  # fails after the decode advanced the batch's copies of the states
        patch.setattr(serving, "host_frames", broken)
        with pytest.raises(RuntimeError, match="frames failed"):
            model.step([(states[0], tick("a", 2))])
    assert all(old is new for old, new in zip(before, states[0].decoder, strict=True))
    a, b = (m.step([(s, tick("a", 2))])[0]["payload"] for m, s in zip((model, twin), states, strict=True))
    assert np.array_equal(a, b)


@torch.no_grad()
def test_matrix_game_with_taehv_batches_and_a_rolled_back_step_restores_the_decoder_state() -> None:
    model = load_model("matrix-game-2", threads=1, decoder="taehv")
    assert "decoder: TAEHV (random weights" in model.spec.description
    image = (np.random.default_rng(0).random((48, 80, 3)) * 255).astype(np.uint8).tobytes()
    first, twin, late = (model.new_state(s, SessionOptions(seed=5, image=image)) for s in ("a", "b", "c"))
    out = model.step([(first, tick("a", 0)), (twin, tick("b", 0))])
    assert out[0]["payload"].shape == (12, 48, 80, 3)
    undo = model.snapshot(first)
    before = list(first.decoder)
    model.step([(first, tick("a", 1))])  # the chunk to cancel
    assert any(old is not new for old, new in zip(before, first.decoder, strict=True))
    model.restore(first, undo)
    assert all(old is new for old, new in zip(before, first.decoder, strict=True))
    # The restored session, its twin and a session at its first chunk, in one batch, as each alone would.
    together = model.step([(first, tick("a", 1)), (late, tick("c", 0))])
    alone = model.step([(twin, tick("b", 1))])[0]["payload"]
    assert np.abs(together[0]["payload"].astype(int) - alone.astype(int)).max() <= 1  # one uint8 step
