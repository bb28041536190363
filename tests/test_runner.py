"""The model runner alone (no engine, no processes): states, contiguity, residency, fail-closed."""

from __future__ import annotations

import numpy as np
import pytest

from runtime_models import FaultyModel, Truth, keys
from worldserve import TickRequest
from worldserve.models import SessionOptions, load_model
from worldserve.runtime import AdmissionRefusedError, ModelRunner, ResidencyLimits, TickFailedError
from worldserve.runtime.messages import TickFailure, TickOutput

pytestmark = pytest.mark.timeout(20)


def tick(session: str, chunk: int, *controls, prompt: str | None = None, **flags: bool) -> TickRequest:
    return TickRequest(session, f"{session}-{chunk}", chunk, (), prompt, tuple(controls), **flags)


def ok(result: object) -> np.ndarray:
    assert isinstance(result, TickOutput), result
    return result.frames


def failed(result: object, code: str) -> str:
    assert isinstance(result, TickFailure), result
    assert result.code == code, result
    return result.message


def runner(limits: ResidencyLimits | None = None, **options: object) -> ModelRunner:
    return ModelRunner(FaultyModel(**options), limits)


def test_frames_follow_the_ticks_exactly_and_sessions_are_independent() -> None:
    r = ModelRunner(load_model("procedural"))
    r.admit("a", SessionOptions(prompt="snowy", seed=3))
    r.admit("b", SessionOptions(seed=4))
    truth_a, truth_b = Truth(3, "snowy"), Truth(4)
    script = [((keys("D"),), None), ((), "desert"), ((keys("W", "A"),), None)]
    for chunk, (controls, prompt) in enumerate(script):
        report = r.step([tick("a", chunk, *controls, prompt=prompt), tick("b", chunk)])
        assert np.array_equal(ok(report.results[0]), truth_a.next(prompt, controls))
        assert np.array_equal(ok(report.results[1]), truth_b.next(None, ()))
        assert report.compute_s > 0


def test_a_gap_fails_out_of_sync_and_releases_the_state() -> None:
    r = runner()
    r.admit("a", SessionOptions())
    ok(r.step([tick("a", 0)]).results[0])
    message = failed(r.step([tick("a", 2)]).results[0], "out_of_sync")
    assert "next chunk is 1" in message
    assert r.resident_sessions() == ()
    # Never regenerated from an empty history: the next tick fails too.
    failed(r.step([tick("a", 0)]).results[0], "not_resident")


def test_reset_restarts_from_the_options_at_chunk_zero() -> None:
    r = runner()
    r.admit("a", SessionOptions(prompt="forest", seed=7))
    first = ok(r.step([tick("a", 0, keys("S"))]).results[0])
    ok(r.step([tick("a", 1, keys("S"))]).results[0])
    assert r.reset_ar_diffusion_session("a") is True
    failed(r.step([tick("a", 2)]).results[0], "out_of_sync")  # the count restarted
    r.admit("a", SessionOptions(prompt="forest", seed=7))
    assert np.array_equal(ok(r.step([tick("a", 0, keys("S"))]).results[0]), first)
    # A reset tick (vllm-omni's flag) starts over inside the step.
    again = ok(r.step([tick("a", 0, keys("S"), reset=True)]).results[0])
    assert np.array_equal(again, first)


def test_lifecycle_rpcs_are_idempotent_and_close_releases() -> None:
    r = runner()
    assert r.reset_ar_diffusion_session("nobody") is True
    assert r.close_ar_diffusion_session("nobody") is True
    r.admit("a", SessionOptions())
    assert r.close_ar_diffusion_session("a") is True
    assert r.close_ar_diffusion_session("a") is True
    assert r.resident_sessions() == ()
    failed(r.step([tick("a", 0)]).results[0], "not_resident")
    assert r.call("no_such_method") == {"supported": False, "error": "worker 0 has no RPC method 'no_such_method'."}
    r.admit("b", SessionOptions())
    ok(r.step([tick("b", 0, close_session=True)]).results[0])
    assert r.resident_sessions() == ()


def test_residency_evicts_idle_lru_never_pinned_and_refuses_when_full() -> None:
    r = runner(ResidencyLimits(max_sessions=2))
    assert r.admit("a", SessionOptions()) == ()
    assert r.admit("b", SessionOptions()) == ()
    ok(r.step([tick("a", 0)]).results[0])  # a is now more recently used than b
    assert r.admit("c", SessionOptions()) == ("b",)
    failed(r.step([tick("b", 0)]).results[0], "evicted")
    with pytest.raises(AdmissionRefusedError, match="every resident session is in use or has a tick in flight"):
        r.admit("d", SessionOptions(), pinned={"a", "c"})
    assert r.resident_sessions() == ("a", "c")  # a refusal touches nothing
    assert r.admit("d", SessionOptions(), pinned={"a"}) == ("c",)
    assert r.residency().evictions == 2


def test_memory_budget_counts_state_bytes() -> None:
    state_bytes = load_model("procedural").spec.state_bytes
    r = ModelRunner(load_model("procedural"), ResidencyLimits(memory_budget_bytes=3 * state_bytes + 1))
    assert r.capacity == 3
    for name in "abc":
        r.admit(name, SessionOptions())
    assert r.admit("d", SessionOptions()) == ("a",)
    tiny = ModelRunner(load_model("procedural"), ResidencyLimits(memory_budget_bytes=state_bytes - 1))
    with pytest.raises(AdmissionRefusedError, match="cannot hold any session"):
        tiny.admit("a", SessionOptions())


def test_atomic_model_failure_fails_only_the_culprit() -> None:
    r = runner(atomic=True)
    truth = {name: Truth(seed) for name, seed in (("a", 1), ("c", 3))}
    r.admit("a", SessionOptions(seed=1))
    r.admit("bad", SessionOptions(prompt="poison", seed=2))
    r.admit("c", SessionOptions(seed=3))
    report = r.step([tick("a", 0, keys("D")), tick("bad", 0), tick("c", 0)])
    assert np.array_equal(ok(report.results[0]), truth["a"].next(None, [keys("D")]))
    assert "poisoned session bad" in failed(report.results[1], "model_error")
    assert np.array_equal(ok(report.results[2]), truth["c"].next(None, ()))
    assert r.resident_sessions() == ("a", "c")
    # A tick after the failure (the engine cancelled the failed one mid-step, a preemption, and made
    # it again) is told why the state is gone, not merely that it is: until a reset.
    assert not r.rollback_ar_diffusion_session("bad", 0)
    again = r.step([tick("bad", 0)]).results[0]
    assert "the session's last step failed: model step raised RuntimeError: poisoned session bad" in failed(
        again, "model_error"
    )
    # The survivors continue from exactly where they were (not advanced twice).
    report = r.step([tick("a", 1, keys("D")), tick("c", 1)])
    assert np.array_equal(ok(report.results[0]), truth["a"].next(None, [keys("D")]))
    assert np.array_equal(ok(report.results[1]), truth["c"].next(None, ()))


def test_non_atomic_model_failure_releases_the_whole_batch_explicitly() -> None:
    r = runner(atomic=False)
    r.admit("a", SessionOptions(seed=1))
    r.admit("bad", SessionOptions(prompt="poison"))
    r.admit("c", SessionOptions(seed=3))
    r.admit("other", SessionOptions(seed=4))
    report = r.step([tick("a", 0), tick("bad", 0), tick("c", 0)])
    for result in report.results:
        assert "every state of the batch was released" in failed(result, "model_error")
    assert r.resident_sessions() == ("other",)  # not in the batch: untouched
    ok(r.step([tick("other", 0)]).results[0])


def test_bad_output_is_refused_and_released() -> None:
    r = runner()
    r.admit("g", SessionOptions(prompt="garbage"))
    r.admit("a", SessionOptions())
    report = r.step([tick("g", 0), tick("a", 0)])
    assert "payload must be uint8 [4, 48, 48, 3]; got uint8 [1, 2, 3]" in failed(report.results[0], "bad_output")
    ok(report.results[1])
    assert r.resident_sessions() == ("a",)


def test_batches_are_split_at_the_model_limit() -> None:
    r = runner(max_batch_size=2)
    for name in "abcde":
        r.admit(name, SessionOptions())
    report = r.step([tick(name, 0) for name in "abcde"])
    assert all(isinstance(result, TickOutput) for result in report.results)
    model = r._model
    assert isinstance(model, FaultyModel)
    assert model.steps == 3


def test_a_state_that_cannot_be_created_is_a_coded_error() -> None:
    r = runner()
    with pytest.raises(TickFailedError, match="could not create a state") as caught:
        r.admit("a", SessionOptions(image=b"\0" * 5))
    assert caught.value.code == "model_error"
    assert r.resident_sessions() == ()
