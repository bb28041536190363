"""tinyworld: the cache-vs-full-sequence oracle, the shipped weights behind the model interface."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from worldserve import ChunkMetadata, ControlInput, TickRequest, parse_chunk_envelope  # noqa: E402
from worldserve.models import SessionOptions, load_model  # noqa: E402
from worldserve.models.precision import native_low_precision  # noqa: E402
from worldserve.models.tinyworld.accel import DEFAULT_ACCEL, FastSampler  # noqa: E402
from worldserve.models.tinyworld.adapter import TinyWorldModel  # noqa: E402
from worldserve.models.tinyworld.cache import KVCache  # noqa: E402
from worldserve.models.tinyworld.config import TinyWorldConfig  # noqa: E402
from worldserve.models.tinyworld.data import CanvasBank, make_batch  # noqa: E402
from worldserve.models.tinyworld.eval import StyleClassifier, phase_shift, psnr  # noqa: E402
from worldserve.models.tinyworld.network import (  # noqa: E402
    ChunkInputs,
    KeyframeInputs,
    TinyWorldNet,
    keyframe_window,
)
from worldserve.models.tinyworld.sampler import SampleTrace, encode_keyframes, sample_chunk, to_pixels, to_uint8  # noqa: E402
from worldserve.models.tinyworld.text import tokenize  # noqa: E402
from worldserve.models.tinyworld.weights import DEFAULT_WEIGHTS, load_net  # noqa: E402
from worldserve.models.world import STYLES, World  # noqa: E402

KEYS = "worldserve.keys.v1"
CAMERA = "worldserve.camera.v1"

#: CPU-bound model work: generous, so that a slow or busy CPU (e.g. float32 without AVX-512) passes too.
pytestmark = pytest.mark.timeout(600)


def keys(*held: str) -> ControlInput:
    return ControlInput("keys", KEYS, {"held": list(held)})


def tick(session: str, chunk: int, *controls: ControlInput, prompt: str | None = None) -> TickRequest:
    return TickRequest(session, f"{session}-{chunk}", chunk, (), prompt, tuple(sorted(controls, key=lambda c: c.track)))


@pytest.fixture(scope="module")
def shipped() -> TinyWorldModel:
    return TinyWorldModel()


def _random_net(config: TinyWorldConfig) -> TinyWorldNet:
    torch.manual_seed(3)
    net = TinyWorldNet(config)
    with torch.no_grad():  # zero-initialised gates would hide most of the network from the check
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return net.eval()


def _cached_vs_full(net: TinyWorldNet, chunks: int) -> float:
    """Largest |x0| difference between a cached chunk-by-chunk rollout and the no-cache full forward."""
    config = net.config
    batch = make_batch(np.random.default_rng(1), CanvasBank([11, 12], 160), 2, chunks, config)
    caches = [KVCache(config) for _ in range(2)]
    encode_keyframes(net, caches, batch.keyframes[:, 0], batch.keyframe_text[:, 0], batch.keyframe_controls[:, 0])
    keyframes = [batch.keyframes[:, 0]]
    traces = []
    generator = torch.Generator().manual_seed(5)
    shape = (len(config.steps), 2, config.frames_per_chunk, 3, config.height, config.width)
    for n in range(chunks):
        trace = SampleTrace()
        noise = torch.randn(shape, generator=generator)
        x0 = sample_chunk(net, caches, noise, batch.chunk_text[:, n], batch.chunk_controls[:, n], keyframes[-1], trace)
        last = to_pixels(to_uint8(x0[:, -1]))
        encode_keyframes(net, caches, last, batch.chunk_text[:, n], batch.chunk_controls[:, n, -1])
        keyframes.append(last)
        traces.append(trace)
    assert caches[0].written == chunks + 1
    kf = KeyframeInputs(
        torch.stack(keyframes[:chunks], dim=1),
        torch.cat([batch.keyframe_text[:, :1], batch.chunk_text[:, : chunks - 1]], dim=1),
        torch.cat([batch.keyframe_controls[:, :1], batch.chunk_controls[:, : chunks - 1, -1]], dim=1),
    )
    worst = 0.0
    with torch.no_grad():
        for step, level in enumerate(config.steps):
            noisy = torch.stack([trace.inputs[step] for trace in traces], dim=1)
            full = net(kf, ChunkInputs(noisy, torch.full((2, chunks), level), batch.chunk_text, batch.chunk_controls))
            cached = torch.stack([trace.outputs[step] for trace in traces], dim=1)
            worst = max(worst, float((full - cached).abs().max()))
    return worst


@pytest.mark.parametrize("chunks", [2, 7])
def test_cached_rollout_equals_full_sequence_forward(chunks: int) -> None:
    # window 2: from the 4th chunk on the window slides (keyframes drop out; the sink stays).
    net = _random_net(TinyWorldConfig(window=2, dim=64, depth=2, heads=2, channels=(8, 16, 32)))
    assert keyframe_window(6, 2) == [0, 4, 5]
    assert _cached_vs_full(net, chunks) < 1e-4


def test_shipped_weights_cached_rollout_equals_full_sequence_forward() -> None:
    net = load_net()
    assert _cached_vs_full(net, net.config.window + 3) < 1e-4


def test_shipped_weights_run_through_the_model_interface(shipped: TinyWorldModel) -> None:
    assert DEFAULT_WEIGHTS.stat().st_size <= 25 * 1024 * 1024
    model = load_model("worldserve.models.tinyworld.adapter:TinyWorldModel")
    spec = model.spec
    assert (spec.name, spec.frames_per_chunk, spec.height, spec.width) == ("tinyworld", 4, 48, 48)
    assert spec.styles == STYLES
    assert spec.state_bytes >= shipped.config.cache_bytes()
    state = model.new_state("s", SessionOptions(prompt="forest", seed=3))
    for index, controls in enumerate(
        [(keys("D"),), (keys(),), (ControlInput("camera", CAMERA, {"dx": -1.5, "dy": 3}),)]
    ):
        request = tick("s", index, *controls)
        frames, metadata = parse_chunk_envelope(model.step([(state, request)])[0])
        assert metadata == ChunkMetadata.from_tick(request)
        assert frames.shape == (4, 48, 48, 3)
        assert frames.dtype == np.uint8
    model.release(state)


def test_cache_memory_is_fixed(shipped: TinyWorldModel) -> None:
    state = shipped.new_state("s", SessionOptions(seed=2))
    size = state.cache.nbytes
    for index in range(shipped.config.window + 4):
        shipped.step([(state, tick("s", index, keys("W")))])
    assert state.cache.nbytes == size
    assert state.cache.written == shipped.config.window + 5
    assert bool(state.cache.valid.all())


#: bfloat16 as served: only where the CPU computes it natively (elsewhere it is served in float32).
NATIVE_BF16 = native_low_precision(torch.device("cpu"), "bfloat16")
needs_native_bf16 = pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bfloat16: served in float32")


@pytest.mark.parametrize("precision", ["float32", pytest.param("bfloat16", marks=needs_native_bf16)])
def test_batched_step_equals_per_session_steps(precision: str) -> None:
    # bfloat16 kernels may pick other blockings by batch size on some CPUs: a few more levels of slack.
    shipped = TinyWorldModel(precision=precision)
    worst, share = (2, 0.01) if precision == "float32" else (24, 0.2)
    sessions = [
        ("a", SessionOptions(prompt="snow", seed=1), (keys("D"),)),
        (
            "b",
            SessionOptions(prompt="a sandy desert", seed=2),
            (ControlInput("camera", CAMERA, {"dx": 1.5, "dy": -2}),),
        ),
        ("c", SessionOptions(seed=3), ()),
    ]
    alone = []
    for name, options, controls in sessions:
        state = shipped.new_state(name, options)
        alone.append([parse_chunk_envelope(shipped.step([(state, tick(name, i, *controls))])[0])[0] for i in range(3)])
    states = [shipped.new_state(name, options) for name, options, _ in sessions]
    together: list[list[np.ndarray]] = [[] for _ in sessions]
    for i in range(3):
        outs = shipped.step([(s, tick(n, i, *c)) for s, (n, _, c) in zip(states, sessions, strict=True)])
        for k, envelope in enumerate(outs):
            together[k].append(parse_chunk_envelope(envelope)[0])
    for single, batched in zip(alone, together, strict=True):
        for a, b in zip(single, batched, strict=True):
            diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
            # Same session noise; only float summation order may differ with the batch size.
            assert diff.max() <= worst, (precision, int(diff.max()))
            assert (diff > 0).mean() < share, (precision, float((diff > 0).mean()))
            assert psnr(a, b) > 35.0


@pytest.mark.parametrize("prompt", ["zxqv blorf 123", "", "ÜBER schnee ☃ snow!!", "word " * 200, None])
def test_unknown_prompt_words_are_fine(shipped: TinyWorldModel, prompt: str | None) -> None:
    assert len(tokenize(prompt, 4096, 16)) <= 32
    state = shipped.new_state("s", SessionOptions(prompt=prompt, seed=4))
    frames, _ = parse_chunk_envelope(shipped.step([(state, tick("s", 0, keys("A"), prompt=prompt))])[0])
    assert frames.shape == (4, 48, 48, 3)


def test_start_image_is_used(shipped: TinyWorldModel) -> None:
    image = World(77).render(500, -300, 48, 48, "desert")
    default = World(5).render(0, 0, 48, 48, "desert")
    with_image = shipped.new_state("s", SessionOptions(prompt="desert", seed=5, image=image.tobytes()))
    frames, _ = parse_chunk_envelope(shipped.step([(with_image, tick("s", 0, keys()))])[0])
    assert psnr(frames[-1], image) > psnr(frames[-1], default) + 5.0
    with pytest.raises(ValueError, match="48x48 RGB"):
        shipped.new_state("t", SessionOptions(image=b"\x00" * 10))


def test_evaluation_tools_work_on_true_frames() -> None:
    world = World(1_000_001)
    a = world.render(0, 0, 48, 48, "forest")
    for step in [(2, 0), (-2, 2), (4, -3), (0, 0)]:
        assert phase_shift(a, world.render(step[0], step[1], 48, 48, "forest")) == step
    classifier = StyleClassifier.fit(range(1000, 1004), views=6)
    hits = [classifier.predict(world.render(40 * i, 0, 48, 48, style)) == style for i in range(5) for style in STYLES]
    assert np.mean(hits) >= 0.8


def side_by_side(first: TinyWorldModel, second: TinyWorldModel, options: SessionOptions, held: str) -> list[float]:
    """PSNR between two models' frames, chunk by chunk, for one session holding one key."""
    one, two = first.new_state("a", options), second.new_state("b", options)
    scores = []
    for index in range(3):
        a, _ = parse_chunk_envelope(first.step([(one, tick("a", index, keys(held)))])[0])
        b, _ = parse_chunk_envelope(second.step([(two, tick("b", index, keys(held)))])[0])
        scores.append(psnr(a, b))
    return scores


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_tinyworld_on_cuda_matches_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cpu, gpu = TinyWorldModel(precision="float32"), TinyWorldModel(device="cuda", precision="float32")
    assert next(gpu.net.parameters()).device.type == "cuda"
    scores = side_by_side(cpu, gpu, SessionOptions(prompt="forest", seed=1_000_077), "D")
    assert min(scores) > 35.0, scores


@needs_native_bf16
def test_bfloat16_serving_stays_close_to_float32() -> None:
    exact, fast = TinyWorldModel(precision="float32"), TinyWorldModel(precision="bfloat16")
    assert (exact.precision, fast.precision) == ("float32", "bfloat16")
    scores = side_by_side(exact, fast, SessionOptions(prompt="islands", seed=1_000_055), "S")
    assert min(scores) > 30.0, scores
    with pytest.raises(ValueError, match="precision must be"):
        TinyWorldModel(precision="fp8")


# -- the fast serving path (accel) against the reference path ------------------------------

#: |x0| tolerance of one fast denoising chunk against the reference, on identical inputs (float32).
FAST_X0_TOLERANCE = 1e-4


def _caches_after(net: TinyWorldNet, keyframes: int, sessions: int) -> list[KVCache]:
    """Sessions' caches holding ``keyframes`` random keyframes each (encoded by the reference path)."""
    config = net.config
    generator = torch.Generator().manual_seed(9)
    caches = [KVCache(config) for _ in range(sessions)]
    for _ in range(keyframes):
        frames = torch.rand((sessions, 3, config.height, config.width), generator=generator) * 2 - 1
        text = torch.randint(0, config.text_buckets, (sessions, config.max_words), generator=generator)
        controls = torch.randn((sessions, 4), generator=generator) * 2
        encode_keyframes(net, caches, frames, text, controls)
    return caches


def _fast_vs_reference(net: TinyWorldNet, keyframes: int) -> float:
    """Largest |x0| difference of one chunk for 3 sessions, reference vs :class:`FastSampler`, same inputs."""
    config = net.config
    sessions = 3
    caches = _caches_after(net, keyframes, sessions)
    generator = torch.Generator().manual_seed(4)
    f = config.frames_per_chunk
    noise = torch.randn((len(config.steps), sessions, f, 3, config.height, config.width), generator=generator)
    text = torch.randint(0, config.text_buckets, (sessions, config.max_words), generator=generator)
    text[0] = 0  # an empty prompt
    controls = torch.randn((sessions, f, 4), generator=generator) * 3
    keyframe = torch.rand((sessions, 3, config.height, config.width), generator=generator) * 2 - 1
    reference = sample_chunk(net, caches, noise, text, controls, keyframe)
    fast = FastSampler(net).sample_chunk(caches, noise, text, controls, keyframe)
    return float((fast - reference).abs().max())


@pytest.mark.parametrize("motion_path", [True, False])
@pytest.mark.parametrize("keyframes", [1, 6])  # a cache still filling (masked), and a full one (no mask)
def test_fast_path_equals_reference_with_random_weights(motion_path: bool, keyframes: int) -> None:
    config = TinyWorldConfig(window=2, dim=64, depth=2, heads=2, channels=(8, 16, 32), motion_path=motion_path)
    assert _fast_vs_reference(_random_net(config), keyframes) < FAST_X0_TOLERANCE


@pytest.mark.parametrize("keyframes", [2, 5])
def test_fast_path_equals_reference_with_shipped_weights(keyframes: int) -> None:
    assert _fast_vs_reference(load_net(), keyframes) < FAST_X0_TOLERANCE


#: |key|, |value| tolerance of the fast cache pass against the reference (keys and values reach ~20).
FAST_KV_TOLERANCE = 1e-4


@pytest.mark.parametrize("motion_path", [True, False])
def test_fast_cache_pass_equals_reference(motion_path: bool) -> None:
    # From the sink (empty cache) through a filling cache (masked) to a full, sliding one:
    # the fast pass writes the same keys and values into the same slots.
    config = TinyWorldConfig(window=2, dim=64, depth=2, heads=2, channels=(8, 16, 32), motion_path=motion_path)
    for net in (_random_net(config), load_net()):
        config = net.config
        fast = FastSampler(net)
        generator = torch.Generator().manual_seed(6)
        reference = [KVCache(config) for _ in range(3)]
        served = [KVCache(config) for _ in range(3)]
        for _ in range(config.window + 3):
            frames = torch.rand((3, 3, config.height, config.width), generator=generator) * 2 - 1
            text = torch.randint(0, config.text_buckets, (3, config.max_words), generator=generator)
            text[1] = 0  # an empty prompt
            controls = torch.randn((3, 4), generator=generator) * 2
            encode_keyframes(net, reference, frames, text, controls)
            fast.encode_keyframes(served, frames, text, controls)
            for one, two in zip(reference, served, strict=True):
                assert one.written == two.written
                assert torch.equal(one.valid, two.valid)
                assert float((one.keys - two.keys).abs().max()) < FAST_KV_TOLERANCE
                assert float((one.values - two.values).abs().max()) < FAST_KV_TOLERANCE
        assert float(reference[0].keys.abs().max()) > 0.1  # the caches are not trivially equal


def test_fast_model_serves_the_reference_frames_and_caches() -> None:
    # Sessions run on for several chunks, so that any difference would compound through the
    # uint8 keyframes fed back: frames stay within 2 levels (nearly all equal), caches close.
    reference = TinyWorldModel(precision="float32", accel="none")
    fast = TinyWorldModel(precision="float32", accel="eager")
    assert fast.accel == "eager"
    assert TinyWorldModel(precision="float32").accel == DEFAULT_ACCEL
    sessions = [("a", SessionOptions(prompt="snow", seed=1)), ("b", SessionOptions(prompt="a sandy desert", seed=2))]
    ref_states = [reference.new_state(name, options) for name, options in sessions]
    fast_states = [fast.new_state(name, options) for name, options in sessions]
    for index in range(reference.config.window + 3):
        ticks = [tick(name, index, keys("D" if index % 2 else "W")) for name, _ in sessions]
        a = reference.step(list(zip(ref_states, ticks, strict=True)))
        b = fast.step(list(zip(fast_states, ticks, strict=True)))
        for one, two in zip(a, b, strict=True):
            diff = np.abs(parse_chunk_envelope(one)[0].astype(np.int16) - parse_chunk_envelope(two)[0].astype(np.int16))
            assert diff.max() <= 2, (index, int(diff.max()))
            assert (diff > 0).mean() < 0.01, (index, float((diff > 0).mean()))
    for one, two in zip(ref_states, fast_states, strict=True):
        assert one.cache.written == two.cache.written
        assert torch.equal(one.cache.valid, two.cache.valid)
        assert float((one.cache.keys - two.cache.keys).abs().max()) < 1e-2
        assert float((one.cache.values - two.cache.values).abs().max()) < 1e-2
    with pytest.raises(ValueError, match="accel must be"):
        TinyWorldModel(accel="turbo")


def test_compile_failure_falls_back_to_the_eager_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object, **_kwargs: object) -> object:
        def run(*_a: object, **_k: object) -> object:
            raise RuntimeError("no C++ compiler here\nmore detail")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    net = load_net()
    compiled = FastSampler(net, compile=True)
    eager = FastSampler(load_net())
    assert compiled.compiled
    assert compiled.fallback is None
    config = net.config
    caches = _caches_after(net, 2, 1)
    noise = torch.randn(len(config.steps), 1, config.frames_per_chunk, 3, config.height, config.width)
    text = torch.zeros(1, config.max_words, dtype=torch.int64)
    controls = torch.zeros(1, config.frames_per_chunk, 4)
    keyframe = torch.zeros(1, 3, config.height, config.width)
    out = compiled.sample_chunk(caches, noise, text, controls, keyframe)
    assert not compiled.compiled
    assert compiled.fallback == "RuntimeError: no C++ compiler here"
    assert torch.equal(out, eager.sample_chunk(caches, noise, text, controls, keyframe))


def test_a_shorter_sampler_schedule_runs_fewer_denoising_steps() -> None:
    """``steps``: a subset of the trained noise levels (the way to real time on slow float32 CPUs)."""
    full = TinyWorldModel(precision="float32", accel="none")
    short = TinyWorldModel(precision="float32", accel="none", steps="1,0.25")
    fast = TinyWorldModel(precision="float32", accel="eager", steps=(1.0, 0.25))
    assert short.config.steps == fast.config.steps == (1.0, 0.25)
    assert short.spec.version == f"{full.spec.version} steps=1,0.25"  # a journal replays with the same sampler
    calls = 0
    denoise = short.net.denoise_chunk

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return denoise(*args, **kwargs)  # type: ignore[arg-type]

    short.net.denoise_chunk = counted  # type: ignore[method-assign]
    frames = {}
    for name, model in (("full", full), ("short", short), ("fast", fast)):
        state = model.new_state("s", SessionOptions(prompt="forest", seed=3))
        frames[name] = parse_chunk_envelope(model.step([(state, tick("s", 0, keys("D")))])[0])[0].astype(np.int16)
    assert calls == 2
    assert np.abs(frames["short"] - frames["fast"]).max() <= 2  # the fast path computes the same schedule
    assert np.abs(frames["short"] - frames["full"]).mean() > 0.5  # and it is not the 4-step one
    for wrong in ("0.25,1", "1,0.3", "0.5,0.25", ""):
        with pytest.raises(ValueError, match="trained on"):
            TinyWorldModel(precision="float32", steps=wrong)
