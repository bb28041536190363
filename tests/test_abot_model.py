"""The ``abot-world`` model: its chunks, its keys, batching, atomic steps, its folder, a real server.

The tiny config with random weights (``load=dummy``), on a CPU: what is asserted is what happened
(frames, states, which sessions' frames are equal), not how fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_abot_forward import _checkpoint  # noqa: E402
from test_wan22_vae import write_published  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models import SessionOptions, load_model  # noqa: E402
from worldserve.models.abot.config import CONFIGS  # noqa: E402
from worldserve.models.abot.model import ABotWorldModel  # noqa: E402
from worldserve.models.wan.build import build_vae, seeded_init  # noqa: E402
from worldserve.models.wan.statedict import WeightsError  # noqa: E402
from worldserve.protocol import ControlInput, TickRequest  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _keys(*held: str) -> ControlInput:
    return ControlInput("keys", "worldserve.keys.v1", {"held": list(held)})


def _tick(session: str, index: int, *held: str) -> TickRequest:
    return TickRequest(session_id=session, request_id=f"{session}-{index}", chunk_index=index, controls=(_keys(*held),))


def _frames(model: ABotWorldModel, rows: list[tuple[object, TickRequest]]) -> list[np.ndarray]:
    return [np.asarray(envelope["payload"]) for envelope in model.step(rows)]


@pytest.fixture(scope="module")
def model() -> ABotWorldModel:
    built = load_model("abot-world", threads=1)
    assert isinstance(built, ABotWorldModel)
    return built


def test_every_chunk_has_twelve_frames_and_the_first_opens_on_the_start_frame(model: ABotWorldModel) -> None:
    spec = model.spec
    assert (spec.frames_per_chunk, spec.height, spec.width, spec.atomic_step) == (12, 128, 128, True)
    assert [c.track for c in spec.controls] == ["keys"]
    state = model.new_state("a", SessionOptions(seed=4))
    chunks = [_frames(model, [(state, _tick("a", i, "W"))])[0] for i in range(8)]  # past a rebase (limit 20)
    assert all(chunk.shape == (12, 128, 128, 3) for chunk in chunks)
    first = chunks[0]
    assert all(np.array_equal(first[i], first[3]) for i in range(3))  # the start frame, held for 3
    assert not np.array_equal(first[3], first[4])
    assert state.base > 0  # the relative RoPE's window moved
    assert state.cache.cached_frames == CONFIGS["tiny"].wan.window_frames


def test_keys_steer_the_world_and_a_session_is_a_function_of_its_seed_and_keys(model: ABotWorldModel) -> None:
    a, b, c = (model.new_state(name, SessionOptions(seed=9)) for name in "abc")
    for i in range(3):
        fa, fb, fc = (
            _frames(model, [(state, _tick(name, i, *held))])[0]
            for state, name, held in ((a, "a", ("W",)), (b, "b", ("W",)), (c, "c", ("J",)))
        )
        assert np.array_equal(fa, fb)  # same seed, same keys: the same frames
        assert not np.array_equal(fa, fc)  # other keys: another world


def test_a_batch_of_first_and_later_blocks_equals_each_alone(model: ABotWorldModel) -> None:
    alone = {name: model.new_state(name, SessionOptions(seed=seed)) for name, seed in (("x", 1), ("y", 2))}
    together = {name: model.new_state(name, SessionOptions(seed=seed)) for name, seed in (("x", 1), ("y", 2))}
    want_x0 = _frames(model, [(alone["x"], _tick("x", 0, "A"))])[0]
    got_x0 = _frames(model, [(together["x"], _tick("x", 0, "A"))])[0]
    assert np.array_equal(want_x0, got_x0)
    for i in range(3):  # x at block i + 1, y at block i: its first, then later ones
        want = [
            _frames(model, [(alone["x"], _tick("x", i + 1, "D"))])[0],
            _frames(model, [(alone["y"], _tick("y", i, "I", "W"))])[0],
        ]
        got = _frames(model, [(together["x"], _tick("x", i + 1, "D")), (together["y"], _tick("y", i, "I", "W"))])
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g.astype(np.int16), w.astype(np.int16), atol=1)  # batched float sums


def test_a_step_that_fails_leaves_the_state_as_it_was(model: ABotWorldModel, monkeypatch: pytest.MonkeyPatch) -> None:
    plain, failing = (model.new_state(name, SessionOptions(seed=5)) for name in ("plain", "failing"))
    for i in range(6):  # up to the block that rebases (block 6, frame 18: it rotates the slots first)
        _frames(model, [(plain, _tick("plain", i, "W"))])
        _frames(model, [(failing, _tick("failing", i, "W"))])
    base, next_frame = failing.base, failing.cache.next_frame

    decode_parts = model.decoder.decode_parts

    def broken(*args: Any, **kwargs: Any) -> Iterator[object]:
        yield next(decode_parts(*args, **kwargs))  # a part is out, then the decoder fails
        raise RuntimeError("decoder failed")

    heard: list[int] = []
    with monkeypatch.context() as patch:
        patch.setattr(model.decoder, "decode_parts", broken)
        with pytest.raises(RuntimeError, match="decoder failed"):
            model.step([(failing, _tick("failing", 6, "W"))], on_part=lambda row, frames: heard.append(len(frames)))
    assert heard == [4]
    assert (failing.base, failing.cache.next_frame) == (base, next_frame)
    assert failing.cache.ref_keys is not None
    for i in range(6, 8):
        want = _frames(model, [(plain, _tick("plain", i, "W"))])[0]
        assert np.array_equal(_frames(model, [(failing, _tick("failing", i, "W"))])[0], want)


def test_a_step_undone_is_as_if_it_never_ran(model: ABotWorldModel) -> None:
    """``can_rollback``: the first block, a plain one and the one that rebases, each made and undone."""
    assert model.spec.can_rollback
    undone, straight = (model.new_state(name, SessionOptions(seed=7)) for name in ("undone", "straight"))
    for i in range(7):
        if i in (0, 3, 6):
            snapshot = model.snapshot(undone)
            _frames(model, [(undone, _tick("undone", i, "W", "L"))])
            model.restore(undone, snapshot)
        got = _frames(model, [(undone, _tick("undone", i, "J"))])[0]
        assert np.array_equal(got, _frames(model, [(straight, _tick("straight", i, "J"))])[0]), i
    assert undone.base == straight.base > 0


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "ABot-World-0-5B-LF"
    folder.mkdir()
    safetensors_torch.save_file(
        {k: v.float() for k, v in _checkpoint().items()}, str(folder / "diffusion_pytorch_model.safetensors")
    )
    with seeded_init(torch.device("cpu"), 3):
        write_published(build_vae(CONFIGS["tiny"].wan), folder / "Wan2.2_VAE.pth")
    return folder


def test_its_published_folder_loads_and_what_is_missing_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    with pytest.raises(WeightsError, match="needs its text encoder"):
        load_model("abot-world", weights=str(folder), config="tiny", threads=1)
    loaded = load_model("abot-world", weights=str(folder), config="tiny", text="hashed", threads=1)
    assert loaded.spec.version.startswith("abot-tiny:sha256:")
    assert "checkpoint weights (diffusion_pytorch_model.safetensors)" in loaded.spec.description
    state = loaded.new_state("a", SessionOptions(seed=1))
    (frames,) = _frames(loaded, [(state, _tick("a", 0, "W"))])  # type: ignore[arg-type]
    assert frames.shape == (12, 128, 128, 3)
    (folder / "Wan2.2_VAE.pth").unlink()
    with pytest.raises(WeightsError, match=r"needs its VAE .*Wan2\.2_VAE\.pth"):
        load_model("abot-world", weights=str(folder), config="tiny", text="hashed", threads=1)
    with pytest.raises(ValueError, match="needs weights=DIR"):
        load_model("abot-world", config="5b")


async def test_a_real_server_plays_it_and_applies_keys() -> None:
    from server_harness import start_server
    from worldserve.client import WorldClient

    server = start_server("--model", "abot-world", "--threads-per-worker", "1", timeout=180.0)
    try:
        async with WorldClient(server.ws) as client:
            info = await client.start(seed=3)
            assert info.model["name"] == "abot-world"
            pressed = await client.send_event(controls=[_keys("W", "L")])
            got = [await client.next_chunk(timeout=60)]
            while pressed.event_id not in got[-1].applied_event_ids:
                assert len(got) < 6, "the keys were not applied within 6 chunks"
                got.append(await client.next_chunk(timeout=60))
            got.append(await client.next_chunk(timeout=60))
            assert all(chunk.frames.shape == (12, 128, 128, 3) for chunk in got)
            assert [chunk.chunk_index for chunk in got] == list(range(len(got)))
    finally:
        server.stop()
    assert "Traceback" not in server.log()


def _references(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    side = CONFIGS["tiny"].ref_resolution
    return tuple(rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(CONFIGS["tiny"].ref_slots))


def _with_references(seed: int, images: tuple[np.ndarray, ...]) -> SessionOptions:
    return SessionOptions(seed=seed, references=tuple(image.tobytes() for image in images))


def test_reference_images_become_the_slots_as_the_reference_encodes_them(model: ABotWorldModel) -> None:
    """Re-typed from ``set_ref_latent_mask_from_exists_paths`` and ``_prepare_ref_tokens``: each image alone,
    ``x * 2 / 255 - 1``, through the VAE's encode (normalised), the transformer's patch embedding, mask 1."""
    spec = model.spec
    assert (spec.reference_slots, spec.reference_size) == (("head", "left"), 64)
    assert spec.to_dict()["reference_slots"] == ["head", "left"]
    images = _references(1)
    got = model.reference_tokens(_with_references(0, images))
    wanted = []
    for image in images:
        pixels = torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1) * (2.0 / 255.0) - 1.0
        latent = model.vae.encode(pixels[None, :, None])  # [1, C, 1, h, w]
        embedded = model.forward.transformer.patch_embedding(latent.to(model.dtype))  # type: ignore[union-attr]
        wanted.append(embedded.flatten(2).transpose(1, 2))  # [1, tokens per slot, dim]
    torch.testing.assert_close(got, torch.cat(wanted, dim=1), rtol=1e-5, atol=1e-5)
    assert got.shape == (1, CONFIGS["tiny"].ref_tokens, CONFIGS["tiny"].wan.dim)
    assert not model.reference_tokens(SessionOptions(seed=0)).any()  # none: every slot masked


def test_reference_images_change_the_world_and_batch_as_alone(model: ABotWorldModel) -> None:
    images = _references(2)
    plain, referenced, again = (
        model.new_state("p", SessionOptions(seed=3)),
        model.new_state("r", _with_references(3, images)),
        model.new_state("q", _with_references(3, images)),
    )
    first_plain = _frames(model, [(plain, _tick("p", 0, "W"))])[0]
    first_ref = _frames(model, [(referenced, _tick("r", 0, "W"))])[0]
    # The slots are queries and keys of the first block, and every later block attends to their K/V.
    assert not np.array_equal(first_plain, first_ref)
    second_ref = _frames(model, [(referenced, _tick("r", 1, "W"))])[0]
    # One pass: a first block with reference images beside one without, each as alone.
    other = model.new_state("o", SessionOptions(seed=3))
    together = _frames(model, [(again, _tick("q", 0, "W")), (other, _tick("o", 0, "W"))])
    for got, want in zip(together, (first_ref, first_plain), strict=True):
        np.testing.assert_allclose(got.astype(np.int16), want.astype(np.int16), atol=1)  # batched float sums
    # Random tiny weights move pixels little, so the slots' keys in each cache tell the rows apart.
    for state in (plain, referenced, again, other):
        state.cache.flush()
    ref_keys = {
        name: state.cache.ref_keys for name, state in (("p", plain), ("r", referenced), ("q", again), ("o", other))
    }
    assert all(keys is not None for keys in ref_keys.values())
    torch.testing.assert_close(ref_keys["q"], ref_keys["r"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ref_keys["o"], ref_keys["p"], rtol=1e-4, atol=1e-5)
    assert (ref_keys["r"] - ref_keys["p"]).abs().max() > 1e-2
    later = _frames(model, [(again, _tick("q", 1, "W"))])[0]
    np.testing.assert_allclose(later.astype(np.int16), second_ref.astype(np.int16), atol=1)


def test_reference_images_are_all_or_none_and_of_the_slot_size(model: ABotWorldModel) -> None:
    images = _references(3)
    with pytest.raises(ValueError, match=r"takes 2 reference images \(head, left\), all or none; got 1"):
        model.new_state("a", SessionOptions(references=(images[0].tobytes(),)))
    with pytest.raises(ValueError, match=r"reference image 'left' must be 64x64 RGB"):
        model.new_state("a", SessionOptions(references=(images[0].tobytes(), b"\0" * 30)))


def _png(image: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_server_decodes_reference_images_by_slot_all_or_none() -> None:
    """Any size of PNG/JPEG, resized to the square as the reference pipeline does (``Image.resize``); raw RGB
    of the square as it is; a slot missing or unknown, or a model with no slots, named in the error."""
    import base64
    import io

    from PIL import Image

    from worldserve.models.base import ModelSpec
    from worldserve.server.encoding import decode_references

    spec = ModelSpec("m", 4, 16.0, 8, 8, (), 1, 0, reference_slots=("head", "left"), reference_size=64)
    wide = np.random.default_rng(5).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    square = np.random.default_rng(6).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    b64 = base64.b64encode
    head, left = decode_references({"left": b64(square.tobytes()).decode(), "head": b64(_png(wide)).decode()}, spec)
    resized = np.asarray(Image.open(io.BytesIO(_png(wide))).convert("RGB").resize((64, 64)), dtype=np.uint8)
    assert head == resized.tobytes()
    assert left == square.tobytes()
    with pytest.raises(ValueError, match=r"takes reference images head, left, all of them or none; missing left\."):
        decode_references({"head": b64(square.tobytes()).decode()}, spec)
    with pytest.raises(ValueError, match=r"missing left; unknown front"):
        decode_references({"head": b64(square.tobytes()).decode(), "front": ""}, spec)
    with pytest.raises(ValueError, match=r"reference image 'left' is neither PNG, JPEG nor raw RGB of 64x64"):
        decode_references({"head": b64(square.tobytes()).decode(), "left": b64(b"not an image").decode()}, spec)
    with pytest.raises(ValueError, match=r"takes no reference images"):
        decode_references({"head": ""}, ModelSpec("n", 4, 16.0, 8, 8, (), 1, 0))


async def test_a_real_server_starts_a_world_from_reference_images_and_replays_it(tmp_path: Path) -> None:
    from server_harness import start_server
    from worldserve.client import WorldClient, WorldError
    from worldserve.runtime.journal import read_journal
    from worldserve.tools.replay import replay

    record = tmp_path / "journals"
    server = start_server(
        "--model", "abot-world", "--threads-per-worker", "1", "--record-dir", str(record), timeout=180.0
    )
    images = _references(7)
    try:
        async with WorldClient(server.ws) as refused:
            with pytest.raises(WorldError) as error:
                await refused.start(seed=1, references={"head": images[0]})
            assert error.value.code == "invalid_image"
            assert "missing left" in error.value.message
        async with WorldClient(server.ws) as client:
            big = np.kron(images[1], np.ones((8, 8, 1), dtype=np.uint8))  # 512x512: a large start message
            info = await client.start(seed=3, media="raw", references={"head": images[0], "left": _png(big)})
            assert (info.model["reference_slots"], info.model["reference_size"]) == (["head", "left"], 64)
            pressed = await client.send_event(controls=[_keys("W", "L")])
            got = [await client.next_chunk(timeout=60)]
            while pressed.event_id not in got[-1].applied_event_ids:
                assert len(got) < 6, "the keys were not applied within 6 chunks"
                got.append(await client.next_chunk(timeout=60))
            await client.close()
    finally:
        server.stop()
    assert "Traceback" not in server.log()
    journal = next(record.glob("*.jsonl"))
    start = read_journal(journal).start
    assert len(start.options.references) == 2
    assert start.options.references[0] == images[0].tobytes()
    replayed = await replay(journal, executor="inprocess")
    live = np.concatenate([chunk.frames for chunk in got])
    assert np.array_equal(replayed.frames[: len(live)], live)
    # The same journal without its reference images replays another world: they were used.
    no_refs = dataclasses.replace(
        read_journal(journal), start=dataclasses.replace(start, options=SessionOptions(seed=3))
    )
    assert not np.array_equal((await replay(no_refs, executor="inprocess")).frames[: len(live)], live)


def test_inspect_names_its_folder_what_is_missing_and_a_serve_command_that_loads(tmp_path: Path) -> None:
    import shlex

    from worldserve.tools.inspect import format_inspection, inspect_path

    folder = _folder(tmp_path)
    (folder / "taew2_2.pth").write_bytes(b"")  # found by its name; read only when decoder=taehv is asked for
    result = inspect_path(folder)
    assert result.model == "abot-world"
    assert set(result.parts) == {"transformer", "vae"}
    assert result.missing == ["text_encoder", "tokenizer"]
    assert (result.config, result.sizes["layers"]) == ("tiny", 2)
    text = format_inspection(result)
    assert "model: abot-world" in text
    assert "taew2_2.pth here: --model-option decoder=taehv" in text
    command = shlex.split(result.command)
    assert command[:4] == ["worldserve", "serve", "--model", "abot-world"]
    options = dict(item.split("=", 1) for item in command[5::2])
    assert options == {"weights": str(folder), "config": "tiny", "text": "hashed"}
    served = load_model("abot-world", threads=1, **options)  # the command's options serve the folder
    assert served.spec.version.startswith("abot-tiny:sha256:")
    assert inspect_path(folder / "diffusion_pytorch_model.safetensors").model == "abot-world"  # its keys say so
    (folder / "Wan2.2_VAE.pth").unlink()
    without_vae = inspect_path(folder)
    assert without_vae.command == ""
    assert without_vae.missing[0] == "vae"
    assert any("no VAE (Wan2.2_VAE.pth)" in note for note in without_vae.notes)
