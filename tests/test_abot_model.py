"""The ``abot-world`` model: its chunks, its keys, batching, atomic steps, its folder, a real server.

The tiny config with random weights (``load=dummy``), on a CPU: what is asserted is what happened
(frames, states, which sessions' frames are equal), not how fast.
"""

from __future__ import annotations

from pathlib import Path

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

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("decoder failed")

    with monkeypatch.context() as patch:
        patch.setattr(model.decoder, "decode_rows", broken)
        with pytest.raises(RuntimeError, match="decoder failed"):
            model.step([(failing, _tick("failing", 6, "W"))])
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
