"""The shared world and the procedural model, run for real."""

from __future__ import annotations

import numpy as np
import pytest

from worldserve import ChunkMetadata, ControlInput, TickRequest, parse_chunk_envelope
from worldserve.models import SessionOptions, SpecControlValidator, load_model
from worldserve.models.world import STYLES, World, style_for_prompt

KEYS = "worldserve.keys.v1"
CAMERA = "worldserve.camera.v1"


def keys(*held: str) -> ControlInput:
    return ControlInput("keys", KEYS, {"held": list(held)})


def tick(chunk: int, *controls: ControlInput, prompt: str | None = None, events: tuple[int, ...] = ()) -> TickRequest:
    return TickRequest("s", f"r{chunk}", chunk, events, prompt, tuple(sorted(controls, key=lambda c: c.track)))


def test_world_is_deterministic_and_seeded() -> None:
    a = World(1).render(10, -20, 48, 48, "forest")
    assert np.array_equal(a, World(1).render(10, -20, 48, 48, "forest"))
    assert not np.array_equal(a, World(2).render(10, -20, 48, 48, "forest"))
    # A window is a crop of a larger window: the world does not depend on the view.
    big = World(1).render(0, -30, 80, 80, "forest")
    assert np.array_equal(big[10:58, 10:58], a)


def test_styles_have_distinct_palettes() -> None:
    frames = {style: World(5).render(0, 0, 64, 64, style) for style in STYLES}
    means = {style: frame.reshape(-1, 3).mean(axis=0) for style, frame in frames.items()}
    for a in STYLES:
        for b in STYLES:
            if a < b:
                assert np.abs(means[a] - means[b]).sum() > 20, (a, b)


@pytest.mark.parametrize(
    ("prompt", "style"),
    [
        ("a snowy mountain pass", "snow"),
        ("Sahara dunes at noon", "desert"),
        ("deep green woods", "forest"),
        ("tropical archipelago", "islands"),
        ("zxqv unknown words 123", "islands"),
        (None, "islands"),
    ],
)
def test_style_for_prompt(prompt: str | None, style: str) -> None:
    assert style_for_prompt(prompt) == style


@pytest.mark.parametrize(("held", "shift"), [(("D",), (-8, 0)), (("A",), (8, 0)), (("W",), (0, 8)), (("S",), (0, -8))])
def test_keys_move_the_view(held: tuple[str, ...], shift: tuple[int, int]) -> None:
    model = load_model("procedural")
    state = model.new_state("s", SessionOptions(seed=9))
    first = parse_chunk_envelope(model.step([(state, tick(0))])[0])[0][-1]
    moved = parse_chunk_envelope(model.step([(state, tick(1, keys(*held)))])[0])[0][-1]
    # 4 frames at 2 px per frame: the content shifts 8 px against the motion.
    dx, dy = shift
    h, w = first.shape[:2]
    src = first[max(0, -dy) : h - max(0, dy), max(0, -dx) : w - max(0, dx)]
    dst = moved[max(0, dy) : h - max(0, -dy), max(0, dx) : w - max(0, -dx)]
    assert np.array_equal(src, dst)


def test_envelope_echoes_tick_and_frames_follow_prompt() -> None:
    model = load_model("procedural")
    state = model.new_state("s", SessionOptions(prompt="islands", seed=4))
    request = tick(0, prompt="snow field", events=(3, 5))
    frames, metadata = parse_chunk_envelope(model.step([(state, request)])[0])
    assert metadata == ChunkMetadata.from_tick(request)
    assert frames.shape == (4, 48, 48, 3)
    assert frames.dtype == np.uint8
    assert np.array_equal(frames[0], World(4).render(0, 0, 48, 48, "snow"))


def test_start_image_is_pasted_at_the_start_view() -> None:
    model = load_model("procedural")
    image = np.full((48, 48, 3), 7, dtype=np.uint8)
    state = model.new_state("s", SessionOptions(seed=1, image=image.tobytes()))
    frames = parse_chunk_envelope(model.step([(state, tick(0, keys("D")))])[0])[0]
    assert (frames[-1][:, :40] == 7).all()
    assert not (frames[-1][:, 40:] == 7).all()
    with pytest.raises(ValueError, match="48x48 RGB"):
        model.new_state("t", SessionOptions(image=b"\x00" * 10))


def test_spec_validator_names_track_schema_and_problem() -> None:
    validator = SpecControlValidator(load_model("procedural").spec)
    validator.validate_controls([keys("W", "D"), ControlInput("camera", CAMERA, {"dx": -1.5, "dy": 4})])
    with pytest.raises(ValueError, match=r"'keys'.*worldserve.keys.v1.*'Q' is not one of"):
        validator.validate_controls([keys("Q")])
    with pytest.raises(ValueError, match="no control track 'jump'"):
        validator.validate_controls([ControlInput("jump", "x", {})])
    with pytest.raises(ValueError, match="expects schema"):
        validator.validate_controls([ControlInput("camera", "other", {"dx": 0, "dy": 0})])


def test_a_step_that_raises_moves_no_state() -> None:
    model = load_model("procedural")
    assert model.spec.atomic_step
    state = model.new_state("s", SessionOptions(seed=3))
    with pytest.raises(TypeError, match="foreign state"):
        model.step([(state, tick(0, keys("D"))), (object(), tick(0))])
    again = parse_chunk_envelope(model.step([(state, tick(0))])[0])[0]
    assert np.array_equal(again[0], World(3).render(0, 0, 48, 48, "islands"))  # still at the start view


def test_a_builtin_model_without_its_extra_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    for name in [m for m in sys.modules if m.startswith("worldserve.models.tinyworld")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(ModuleNotFoundError, match=r"'tinyworld' extra.*--model procedural"):
        load_model("tinyworld")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        load_model("nope")
