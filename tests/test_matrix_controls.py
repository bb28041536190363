"""``matrix-game-2``'s controls mean what they meant in training (tiny config, random weights, CPU).

Each variant's spec declares its own action space (the keys it was trained on; the mouse only where it
has one), refused at acceptance otherwise; a tick's held keys and mouse become the reference's
per-video-frame conditions, grouped per latent frame as the reference groups them (checked against
``matrix_reference.reference_windows``, the reference's own grouping re-typed); a session needs its
start image; a step can be undone, and a failed one changes nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from matrix_reference import reference_windows  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models import load_model  # noqa: E402
from worldserve.models.base import SessionOptions, SpecControlValidator  # noqa: E402
from worldserve.models.matrixgame.adapter import MatrixGameModel  # noqa: E402
from worldserve.models.matrixgame.controls import keyboard_action, keys_control, mouse_control  # noqa: E402
from worldserve.models.matrixgame.forward import MatrixConditions  # noqa: E402
from worldserve.protocol import ControlInput, TickRequest  # noqa: E402


def image(seed: int = 0, height: int = 48, width: int = 80) -> bytes:
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8).tobytes()


def tick(session: str, index: int, *controls: ControlInput) -> TickRequest:
    return TickRequest(session, f"{session}-{index}", index, controls=controls)


@pytest.fixture(scope="module")
def models() -> dict[str, MatrixGameModel]:
    return {name: MatrixGameModel(variant=name) for name in ("universal", "gta-drive", "templerun")}


def test_each_variant_declares_its_own_action_space_and_refuses_the_rest_at_acceptance(
    models: dict[str, MatrixGameModel],
) -> None:
    accept = {name: SpecControlValidator(model.spec).validate_controls for name, model in models.items()}
    accept["universal"]([keys_control("W", "A"), mouse_control(0.1, -0.05)])
    accept["gta-drive"]([keys_control("S"), mouse_control(-0.1, 0.0)])
    accept["templerun"]([keys_control("Z")])
    with pytest.raises(ValueError, match="model 'matrix-game-2' has no control track 'mouse'"):
        accept["templerun"]([mouse_control(0.1, 0.0)])  # Temple Run was trained without a mouse
    with pytest.raises(ValueError, match="'Z' is not one of \\['W', 'S', 'A', 'D'\\]"):
        accept["universal"]([keys_control("Z")])
    with pytest.raises(ValueError, match="'A' is not one of \\['W', 'S'\\]"):
        accept["gta-drive"]([keys_control("A")])
    with pytest.raises(ValueError, match="is too long"):
        accept["templerun"]([keys_control("W", "A")])  # one-hot in training: one key at a time
    with pytest.raises(ValueError, match=r"greater than the maximum of 1\.0"):
        accept["universal"]([mouse_control(2.0, 0.0)])
    assert models["templerun"].spec.continuous_tracks == ("keys",)
    assert models["universal"].spec.continuous_tracks == ("keys", "mouse")


def test_held_keys_become_the_references_keyboard_vectors(models: dict[str, MatrixGameModel]) -> None:
    universal, gta, temple = (models[n].variant for n in ("universal", "gta-drive", "templerun"))
    assert keyboard_action([keys_control("W", "A")], universal) == [1, 0, 1, 0]  # forward_left
    assert keyboard_action([keys_control("D")], universal) == [0, 0, 0, 1]
    assert keyboard_action([], universal) == [0, 0, 0, 0]
    assert keyboard_action([keys_control("S")], gta) == [0, 1]
    # Temple Run: nomove, jump, slide, turn left, turn right, move left, move right.
    assert keyboard_action([], temple) == [1, 0, 0, 0, 0, 0, 0]
    expected = {"W": 1, "S": 2, "Z": 3, "C": 4, "A": 5, "D": 6}
    for key, index in expected.items():
        vector = keyboard_action([keys_control(key)], temple)
        assert vector.index(1.0) == index
        assert sum(vector) == 1.0


def test_a_session_needs_its_start_image(models: dict[str, MatrixGameModel]) -> None:
    model = models["universal"]
    assert model.spec.requires_image
    assert model.spec.to_dict()["takes_prompt"] is False  # no text encoder: a player offers no prompt
    with pytest.raises(ValueError, match="starts a world from a start image: send one \\(80x48 RGB\\)"):
        model.new_state("s", SessionOptions(seed=1))
    with pytest.raises(ValueError, match="start image must be 80x48 RGB"):
        model.new_state("s", SessionOptions(seed=1, image=image(height=8)))


class Capture:
    """The conditions each denoising pass of a step was given."""

    def __init__(self, model: MatrixGameModel) -> None:
        self.forward = model.forward
        self.seen: list[MatrixConditions] = []
        model.forward = self  # type: ignore[assignment]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(args[3])
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("variant", ["universal", "templerun"])
@torch.no_grad()
def test_each_latent_frame_reads_the_references_window_of_held_actions(variant: str) -> None:
    model = MatrixGameModel(variant=variant)
    capture = Capture(model)
    state = model.new_state("s", SessionOptions(seed=3, image=image()))
    if variant == "universal":
        held = [(("W",), 0.1, 0.0), (("W", "A"), -0.05, 0.1), ((), 0.0, 0.0), (("D",), 0.2, -0.1)]
    else:
        held = [(("W",), 0, 0), (("Z",), 0, 0), ((), 0, 0), (("C",), 0, 0)]
    keyboard_frames: list[list[float]] = []
    mouse_frames: list[list[float]] = []
    for index, (keys, yaw, pitch) in enumerate(held):
        controls = [keys_control(*keys)] + ([mouse_control(yaw, pitch)] if model.variant.mouse else [])
        capture.seen.clear()
        model.step([(state, tick("s", index, *controls))])
        frames = 9 if index == 0 else 12  # the first latent frame is one video frame
        keyboard_frames += [keyboard_action(controls, model.variant)] * frames
        mouse_frames += [[pitch, yaw]] * frames
        seen = capture.seen[-1]
        assert seen.offsets == (3 * index,)
        expected = reference_windows(torch.tensor([keyboard_frames]), 3)
        assert torch.equal(seen.keyboard, expected)
        if model.variant.mouse:
            assert seen.mouse is not None
            assert torch.equal(seen.mouse, reference_windows(torch.tensor([mouse_frames]), 3))
        else:
            assert seen.mouse is None


@torch.no_grad()
def test_a_rolled_back_step_leaves_the_session_as_a_twin_that_never_took_it(models: dict[str, MatrixGameModel]) -> None:
    model = models["universal"]
    assert model.spec.can_rollback
    assert model.spec.atomic_step
    first = model.new_state("a", SessionOptions(seed=5, image=image(1)))
    twin = model.new_state("b", SessionOptions(seed=5, image=image(1)))
    for state, sid in ((first, "a"), (twin, "b")):
        model.step([(state, tick(sid, 0, keys_control("W")))])
    undo = model.snapshot(first)
    model.step([(first, tick("a", 1, keys_control("S"), mouse_control(0.3, 0.3)))])  # the chunk to cancel
    model.restore(first, undo)
    a = model.step([(first, tick("a", 1, keys_control("A")))])[0]["payload"]
    b = model.step([(twin, tick("b", 1, keys_control("A")))])[0]["payload"]
    assert np.array_equal(a, b)
    assert first.caches.next_frame == twin.caches.next_frame == 6


@torch.no_grad()
def test_a_failed_step_changes_nothing_and_a_batch_matches_its_sessions_alone(
    models: dict[str, MatrixGameModel],
) -> None:
    model = models["gta-drive"]
    states = [model.new_state(str(i), SessionOptions(seed=i, image=image(i))) for i in range(3)]
    twins = [model.new_state(str(i), SessionOptions(seed=i, image=image(i))) for i in range(3)]
    moves = [[keys_control("W"), mouse_control(0.1, 0.0)], [keys_control("S")], []]
    model.step([(states[0], tick("0", 0, *moves[0]))])  # session 0 is one block ahead
    model.step([(twins[0], tick("0", 0, *moves[0]))])
    decode = model.vae.decode_parts

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("decoder out of memory")

    model.vae.decode_parts = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        model.step([(s, tick(s.session_id, 1 if i == 0 else 0, *moves[i])) for i, s in enumerate(states)])
    model.vae.decode_parts = decode  # type: ignore[method-assign]
    together = model.step([(s, tick(s.session_id, 1 if i == 0 else 0, *moves[i])) for i, s in enumerate(states)])
    for i, twin in enumerate(twins):
        alone = model.step([(twin, tick(twin.session_id, 1 if i == 0 else 0, *moves[i]))])[0]["payload"]
        assert np.abs(together[i]["payload"].astype(int) - alone.astype(int)).max() <= 1  # one uint8 step
    assert [s.caches.next_frame for s in states] == [6, 3, 3]


def test_state_bytes_cover_what_a_session_holds(models: dict[str, MatrixGameModel]) -> None:
    model = models["universal"]
    state = model.new_state("s", SessionOptions(seed=1, image=image()))
    model.step([(state, tick("s", 0, keys_control("W")))])
    model.step([(state, tick("s", 1, keys_control("W")))])
    held = state.caches.nbytes + model.vae.nbytes(state.decoder) + state.image.nbytes
    held += state.features.numel() * state.features.element_size()
    assert held <= model.spec.state_bytes
    assert state.caches.nbytes == model.config.kv_bytes(4)
    with pytest.raises(ValueError, match="needs weights=DIR or checkpoint=PATH"):
        load_model("matrix-game-2", config="1.3b")
