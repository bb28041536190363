"""``InteractionPlan`` without sockets: vllm-omni's prompt and camera handler rules at chunk boundaries,
what each chunk applies, and the event lists it reports. Checked against the rules as vllm-omni
0.30.0's handlers state them (``diffusion/interaction/modality_handlers/prompt.py`` and
``camera.py``), one boundary at a time."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from worldserve.models import load_model
from worldserve.models.base import ControlSchema, ModelSpec
from worldserve.models.world import Motion
from worldserve.server.realtime_plan import (
    TRANSITION_SCHEMA,
    Boundary,
    InteractionPlan,
    InteractionRefused,
    parse_interaction,
)

SPEC = load_model("procedural").spec
TRANSITION = ControlSchema(
    track="prompt_transition",
    schema=TRANSITION_SCHEMA,
    description="blend to a new prompt over N chunks",
    json_schema={"type": "object", "properties": {"chunks": {"type": "integer", "minimum": 0}}, "required": ["chunks"]},
    example={"chunks": 3},
)
BLENDING = dataclasses.replace(SPEC, controls=(*SPEC.controls, TRANSITION))


def message(event: dict[str, Any], event_id: str | None = None, **more: Any) -> dict[str, Any]:
    interaction: dict[str, Any] = {"event": event, **more}
    if event_id is not None:
        interaction["event_id"] = event_id
    return {"type": "session.interaction", "interaction": interaction}


def camera(mode: str, translation: list[float]) -> dict[str, Any]:
    return {"multi_modal_data": {"camera": {"mode": mode, "data": {"translation": translation}}}}


def queue(plan: InteractionPlan, event: dict[str, Any], event_id: str, **more: Any) -> None:
    plan.queue(plan.check(parse_interaction(message(event, event_id, **more), "generated")))


def lists(boundary: Boundary) -> tuple[list[str], list[str], list[str]]:
    return list(boundary.started), list(boundary.active), list(boundary.completed)


@pytest.mark.parametrize("spec", [SPEC, BLENDING], ids=["switch", "blend"])
def test_prompt_transitions_follow_vllm_omnis_prompt_handler(spec: ModelSpec) -> None:
    plan = InteractionPlan(spec)
    blends = spec is BLENDING
    assert plan.transitions is blends
    queue(plan, {"prompt": "desert"}, "a")  # transition_chunks absent: 3 where the model blends
    first = plan.boundary()
    assert first.prompt == "desert"
    if blends:  # vllm-omni's 3 chunks (1/3, 2/3, then the new prompt alone) are the track's 2 blended blocks
        assert [c.data for c in first.controls if c.track == "prompt_transition"] == [{"chunks": 2}]
        assert lists(first) == (["a"], ["a"], [])
        assert lists(plan.boundary()) == ([], ["a"], [])
        assert lists(plan.boundary()) == ([], ["a"], ["a"])
    else:  # no prompt_transition track: an immediate switch, a transition of 0 chunks
        assert all(c.track != "prompt_transition" for c in first.controls)
        assert lists(first) == (["a"], ["a"], ["a"])
    assert lists(plan.boundary()) == ([], [], [])
    # Last write wins at a boundary: an earlier queued prompt never starts.
    queue(plan, {"prompt": "forest"}, "b", transition_chunks=2)
    queue(plan, {"prompt": "snow"}, "c", transition_chunks=0)
    switched = plan.boundary()
    assert switched.prompt == "snow"
    assert lists(switched) == (["c"], ["c"], ["c"])
    if blends:
        assert [c.data for c in switched.controls if c.track == "prompt_transition"] == [{"chunks": 0}]
        # A transition cut short by a newer prompt: it advances (active), then the new one starts.
        queue(plan, {"prompt": "islands"}, "d", transition_chunks=4)
        plan.boundary()
        queue(plan, {"prompt": "desert"}, "e", transition_chunks=1)
        assert lists(plan.boundary()) == (["e"], ["d", "e"], ["e"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunks", [None, 1, 4, 0])
def test_wan_causal_blends_a_prompt_change_with_vllm_omnis_weights_chunk_by_chunk(chunks: int | None) -> None:
    """The plan's events, fed to the real wan-causal (it declares the track) as the session would:
    chunk k of an N-chunk transition is k / N of the way (vllm-omni's ``_current_alpha``), and the
    chunk the lists say completed it is the first with the new prompt alone."""
    from worldserve.models.base import SessionOptions
    from worldserve.protocol import TickRequest

    model = load_model("wan-causal", config="tiny", load="dummy", threads=1)
    plan = InteractionPlan(model.spec)
    assert plan.transitions
    state = model.new_state("s", SessionOptions(prompt="islands", seed=1))
    prompt, held = "islands", ()
    queue(plan, {"prompt": "desert dunes"}, "p", **({} if chunks is None else {"transition_chunks": chunks}))
    n = 3 if chunks is None else chunks
    weights, completed = [], None
    for index in range(max(n, 1)):
        boundary = plan.boundary()
        prompt = boundary.prompt or prompt
        held = boundary.controls or held  # a control holds until replaced
        model.step([(state, TickRequest("s", f"s-{index}", index, prompt=prompt, controls=held))])
        _source, target, weight = state.prompt.key
        assert target == "desert dunes"
        weights.append(weight)
        if "p" in boundary.completed:
            completed = index
    assert weights == pytest.approx([(k + 1) / max(n, 1) for k in range(max(n, 1))])
    assert completed == max(n, 1) - 1  # the last chunk, the first with the new prompt alone
    assert lists(plan.boundary()) == ([], [], [])
    # Longer than the track's maximum (64 blocks): refused when queued (interaction_failed), not at its chunk.
    with pytest.raises(InteractionRefused, match="chunks"):
        plan.check(parse_interaction(message({"prompt": "snow"}, "long", transition_chunks=66), "x"))
    plan.check(parse_interaction(message({"prompt": "snow"}, "longest", transition_chunks=65), "x"))


def test_camera_velocity_holds_until_replaced_and_moves_as_motion_does() -> None:
    plan = InteractionPlan(SPEC)
    queue(plan, camera("velocity", [0.05, 0.0, 0.0]), "right")
    first = plan.boundary()
    assert [c.data for c in first.controls] == [{"dx": 2.0, "dy": 0.0}]
    assert lists(first) == (["right"], ["right"], [])
    held = plan.boundary()
    assert held.controls == ()  # the track holds its value: nothing to send
    assert lists(held) == ([], ["right"], [])
    queue(plan, camera("velocity", [-0.025, 0.0, 0.05]), "back-left")
    turned = plan.boundary()
    assert [c.data for c in turned.controls] == [{"dx": -1.0, "dy": -2.0}]  # +Z is up the screen
    assert lists(turned) == (["back-left"], ["back-left"], ["right"])
    # Two camera events at one boundary: the first starts and is replaced at once.
    queue(plan, camera("velocity", [0.0, 0.0, 0.0]), "stop")
    queue(plan, camera("velocity", [0.05, 0.0, 0.0]), "go")
    both = plan.boundary()
    assert lists(both) == (["stop", "go"], ["go"], ["back-left", "stop"])


def test_a_camera_target_moves_at_a_constant_speed_to_its_pose_relative_to_the_start() -> None:
    plan = InteractionPlan(SPEC)
    queue(plan, camera("velocity", [0.05, 0.0, 0.0]), "right")
    plan.boundary()  # 4 frames at 2 px: x = 8
    motion = Motion()
    motion.advance(2.0, 0.0, 4)
    queue(plan, camera("target", [0.0, 0.0, 0.1]), "home", transition_chunks=2)  # (0, -4) from the start
    first = plan.boundary()
    (control,) = first.controls
    assert lists(first) == (["home"], ["home"], ["right"])
    second = plan.boundary()
    assert lists(second) == ([], [], ["home"])
    motion.advance(control.data["dx"], control.data["dy"], 8)
    assert motion.pixel == (0, -4)  # reached exactly, as the model integrates it
    stopped = plan.boundary()
    assert [c.data for c in stopped.controls] == [{"dx": 0.0, "dy": 0.0}]
    assert lists(stopped) == ([], [], [])
    # Out of reach at its boundary: refused there, and the camera is left as it was.
    queue(plan, camera("target", [10.0, 0.0, 0.0]), "far")
    far = plan.boundary()
    assert [event_id for event_id, _ in far.refused] == ["far"]
    assert lists(far) == ([], [], [])


@pytest.mark.parametrize(
    ("event", "more", "reason"),
    [
        ({"multi_modal_data": {"camera": {"mode": "orbit", "data": {}}}}, {}, "mode"),
        ({"multi_modal_data": {"camera": {"mode": "velocity", "data": {"translation": [1, 2]}}}}, {}, "translation"),
        ({"multi_modal_data": {"camera": {"data": {"rotation": [0, 0, 0, 0]}}}}, {}, "non-zero"),
        ({"multi_modal_data": {"camera": {"mode": "velocity", "data": {"translation": [0.0, 0.0, 1.0]}}}}, {},
         "minimum"),
        ({"multi_modal_data": {"camera": {"data": {"translation": [0.1, 0.0, 0.0]}}}}, {"transition_chunks": 0},
         "transition_chunks"),
    ],
)  # fmt: skip
def test_what_the_view_cannot_do_is_refused(event: dict[str, Any], more: dict[str, Any], reason: str) -> None:
    plan = InteractionPlan(SPEC)
    with pytest.raises(InteractionRefused, match=reason):
        plan.check(parse_interaction(message(event, "x", **more), "generated"))


def test_a_model_without_a_camera_track_refuses_camera_interactions() -> None:
    plan = InteractionPlan(dataclasses.replace(SPEC, controls=(), continuous_tracks=()))
    assert not plan.camera
    with pytest.raises(InteractionRefused, match="'camera' is not supported"):
        plan.check(parse_interaction(message(camera("velocity", [0.0, 0.0, 0.0]), "x"), "generated"))
    queue(plan, {"prompt": "snow"}, "p")
    assert plan.boundary().prompt == "snow"


def test_the_interactions_shape_is_checked_as_vllm_omni_checks_it() -> None:
    assert parse_interaction(message({"prompt": "a"}), "made-here").event_id == "made-here"
    assert parse_interaction(message({"prompt": "a"}, transition_chunks=2.0), "x").transition_chunks == 2
    for bad, text in [
        ({"type": "session.interaction", "interaction": []}, "interaction object"),
        (message({"prompt": "a"}, ""), "non-empty string"),
        (message({}), "non-empty event.prompt"),
        (message({"prompt": 3, "multi_modal_data": {"camera": {}}}), "non-empty string when provided"),
        (message({"prompt": "a", "multi_modal_data": {}}), "non-empty object when provided"),
        (message({"multi_modal_data": {"camera": 1}}), "must be an object"),
        (message({"prompt": "a"}, transition_chunks=True), "integer"),
    ]:
        with pytest.raises(ValueError, match=text):
            parse_interaction(bad, "x")
