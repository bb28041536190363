"""The Wan2.1 families run with their authors' inference settings (schedule, context, prompt-switch rule).

The numbers below are copied from the released configs and code (docs/models.md names each
file and commit), not from the module under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import wan_files  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models import load_model  # noqa: E402
from worldserve.models.base import SessionOptions  # noqa: E402
from worldserve.models.wan.config import CONFIGS, get_config  # noqa: E402
from worldserve.models.wancausal.families import FAMILIES, family_config  # noqa: E402

CPU = torch.device("cpu")


def rounded(schedule: object, digits: int = 6) -> list[tuple[float, float]]:
    return [(round(t, 3), round(s, digits)) for t, s in schedule]


def test_each_family_has_its_authors_schedule_context_and_switch_rule() -> None:
    size = CONFIGS["1.3b"]
    sf = family_config(size, FAMILIES["self-forcing"])
    # Self-Forcing: 1000/750/500/250 warped through the shift-5 table.
    assert rounded(sf.schedule()) == [(1000.0, 1.0), (937.5, 0.9375), (833.333, 0.833333), (625.0, 0.625)]
    assert (sf.block_frames, sf.sink_frames, sf.window_frames) == (3, 3, 15)  # 21 latent frames with the block
    assert sf.block_frames + sf.sink_frames + sf.window_frames == 21
    # CausVid: 1000/757/522 unwarped, shift 8; sigma from the table entry nearest the timestep.
    cv = family_config(size, FAMILIES["causvid"])
    assert rounded(cv.schedule()) == [(1000.0, 1.0), (757.0, 0.756757), (522.0, 0.521739)]
    assert cv.shift == 8.0
    assert (cv.sink_frames, cv.window_frames) == (3, 15)
    # LongLive: Self-Forcing's schedule; local_attn_size 12 with sink 3 -> window 6; KV re-cache keeping the sink.
    ll = FAMILIES["longlive"]
    assert rounded(family_config(size, ll).schedule()) == rounded(sf.schedule())
    assert (ll.sink_frames, ll.window_frames, ll.block_frames) == (3, 6, 3)
    assert (ll.prompt_switch, ll.recache_sink, ll.ema) == ("recache", False, False)
    # Krea: 14B, 5 steps (linspace(1000, 0, 5) warped), the last at timestep 0 with the table's last sigma.
    kr = FAMILIES["krea"]
    krea = family_config(CONFIGS[kr.size], kr)
    assert kr.size == "14b"
    assert rounded(krea.schedule(), 5) == [
        (1000.0, 1.0),
        (937.5, 0.9375),
        (833.333, 0.83333),
        (625.0, 0.625),
        (0.0, 0.00498),
    ]
    assert (krea.sink_frames, krea.window_frames) == (1, 2)  # kv_cache_num_frames = 3
    assert (kr.prompt_switch, kr.recache_sink, kr.prompt_transition) == ("recache", True, 2)
    # Wan2.1 itself: 50 Euler steps on the shift-5 grid.
    wan = family_config(size, FAMILIES["wan"])
    assert (len(wan.schedule()), wan.sampler, wan.schedule()[0][0]) == (50, "euler", 1000.0)
    assert family_config(size, FAMILIES["wan"], steps=4).denoising_steps == (1000.0, 750.0, 500.0, 250.0)
    for family in FAMILIES.values():
        assert family.sources, family.name  # every setting names where it comes from


def test_the_family_follows_the_checkpoints_published_name_and_sets_the_sampler(tmp_path: Path) -> None:
    weights = wan_files.random_transformer(get_config("tiny"))
    cases = {
        "self_forcing_dmd.pt": "self-forcing",
        "model.pt": "causvid",
        "longlive_base.pt": "longlive",
    }
    for index, (name, family) in enumerate(cases.items()):
        folder = tmp_path / str(index)
        wan_files.save_self_forcing(folder / name, weights)
        model = load_model("wan-causal", weights=str(folder), text="hashed", vae="random", threads=1)
        assert model.family.name == family
        assert f"family {family}" in model.spec.description
    from safetensors.torch import save_file

    krea = tmp_path / "krea"
    krea.mkdir()  # Krea's single safetensors file, keys under "model." (release_server.py reads model.blocks.0...)
    save_file({f"model.{k}": v for k, v in weights.items()}, str(krea / "krea-realtime-video-14b.safetensors"))
    model = load_model("wan-causal", weights=str(krea), text="hashed", vae="random", threads=1)
    assert model.family.name == "krea"
    assert (model.config.sink_frames, len(model.config.schedule()), model.prompt_switch) == (1, 5, "recache")
    assert torch.equal(
        dict(model.forward.transformer.named_parameters())["blocks.1.norm2.weight"], weights["blocks.1.norm3.weight"]
    )
    causvid = load_model("wan-causal", weights=str(tmp_path / "1"), text="hashed", vae="random", threads=1)
    assert causvid.config.schedule() == family_config(causvid.config, FAMILIES["causvid"]).schedule()
    # The network is fed CausVid's raw timesteps; x0 uses the table's sigma.
    x0, record = _sample_one_block(causvid, SessionOptions(seed=3))
    assert [r[1][0, 0].item() for r in record] == [1000.0, 757.0, 522.0]
    x, _, flow = record[-1]
    assert torch.allclose(x0, x - 0.5217391304347826 * flow, atol=1e-6)


def _sample_one_block(model: object, options: SessionOptions) -> tuple[object, list[object]]:
    """One block of a primed session through the model's own sampler, every step recorded."""
    from wan_files import draw_noise
    from worldserve.models.wan.sampler import StepRecord, sample_block

    config = model.config
    cache = model.new_state("s", options).cache
    shape = (config.latent_channels, config.block_frames, config.latent_height, config.latent_width)
    generator = torch.Generator().manual_seed(options.seed)
    record: list[StepRecord] = []
    text = torch.zeros(1, config.text_len, config.text_dim)
    still = torch.zeros(1, config.block_frames, config.action_dim)
    with torch.no_grad():
        noise = lambda: draw_noise([generator], shape, CPU)  # noqa: E731
        x0 = sample_block(model.forward, [cache], noise, text, still, model.rope([cache.next_frame], 3), config, record)
    return x0, record


def test_the_euler_sampler_takes_the_flow_matching_ode_step() -> None:
    model = load_model("wan-causal", config="tiny", family="wan", steps=3, threads=1)
    config = model.config
    assert config.sampler == "euler"
    x0, record = _sample_one_block(model, SessionOptions(seed=4))
    sigmas = [s for _, s in config.schedule()] + [0.0]
    for index, (x, _, flow) in enumerate(record):
        following = record[index + 1][0] if index + 1 < len(record) else x0
        assert torch.allclose(following, x + (sigmas[index + 1] - sigmas[index]) * flow, atol=1e-5)


def test_the_vae_decode_flops_are_what_torch_counts_on_the_decoder() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from worldserve.models.wan.build import build_vae
    from worldserve.models.wan.vae import VaeStream

    config = CONFIGS["1.3b"]
    with torch.device("meta"):  # the full-size decoder, shapes only: no memory, no compute
        stream = VaeStream(build_vae(config).eval())
        cache = stream.new_cache()
        latents = torch.zeros(1, config.latent_channels, 3, config.latent_height, config.latent_width)
        with torch.no_grad():
            stream.decode(latents, [cache], first=True)
            with FlopCounterMode(display=False) as counter:
                stream.decode(latents, [cache])
    assert counter.get_total_flops() == config.vae_decode_flops()
    assert round(config.vae_decode_flops() / 1e12, 1) == 40.7  # +20 % on Self-Forcing's 202.7 TFLOP per block


def _network(config: object) -> object:
    from worldserve.models.wan.build import build_transformer
    from worldserve.models.wancausal.actions import ActionEmbedding
    from worldserve.models.wancausal.forward import CachedForward

    torch.manual_seed(0)
    return CachedForward(
        build_transformer(config).eval(), ActionEmbedding(config.action_dim, config.dim).eval(), config
    )


def _dense(forward: object, latents: object, timesteps: object, text: object, per_frame: object) -> object:
    """The library's dense block-causal forward, the action embedding added through a public hook."""

    def hook(module: object, inputs: object, output: object) -> object:
        return output + forward.actions(per_frame)

    handle = forward.transformer.condition_embedder.time_proj.register_forward_hook(hook)
    try:
        return forward.transformer(latents, timesteps, text, enable_diffusion_forcing=True, return_dict=False)[0]
    finally:
        handle.remove()


@torch.no_grad()
def test_after_a_prompt_switch_with_recache_the_next_block_equals_a_dense_forward_under_the_new_prompt() -> None:
    from wan_files import draw_noise
    from worldserve.models.wan.cache import BlockLog, KVCache
    from worldserve.models.wan.rope import FrameRope
    from worldserve.models.wan.sampler import StepRecord, commit_block, recache_context, sample_block

    config = get_config("tiny").with_window(30)  # nothing leaves the window: the dense forward is the reference
    forward = _network(config)
    rope = FrameRope(config, CPU)
    block = config.block_frames
    shape = (config.latent_channels, block, config.latent_height, config.latent_width)
    generator = torch.Generator().manual_seed(1)
    old, new = (torch.randn(1, config.text_len, config.text_dim, generator=generator) for _ in range(2))
    cache, log = KVCache(config, CPU, torch.float32), BlockLog(block)
    committed = [torch.randn(1, *shape, generator=generator)]
    actions = [torch.zeros(1, block, config.action_dim)]
    commit_block(forward, [cache], committed[0], old, actions[0], rope([0], block), config)
    log.add(0, committed[0], actions[0])
    for _ in range(2):  # two blocks under the old prompt
        act = torch.randn(1, block, config.action_dim, generator=generator)
        offsets = [cache.next_frame]
        noise = lambda: draw_noise([generator], shape, CPU)  # noqa: E731
        x0 = sample_block(forward, [cache], noise, old, act, rope(offsets, block), config)
        log.add(cache.next_frame, x0, act)
        commit_block(forward, [cache], x0, old, act, rope(offsets, block), config)
        committed.append(x0)
        actions.append(act)
    committed_slots = slice(block * config.tokens_per_frame, None)  # past the scratch slots a pass writes
    before = cache.keys[:, :, committed_slots].clone()
    act = torch.randn(1, block, config.action_dim, generator=generator)
    per_frame = torch.cat([*actions, act], dim=1)
    state = generator.get_state()
    results = {}
    for rule in ("recache", "keep"):
        generator.set_state(state)
        target = (
            recache_context(forward, cache, log, new, rope, config, keep_sink=False) if rule == "recache" else cache
        )
        record: list[StepRecord] = []
        noise = lambda: draw_noise([generator], shape, CPU)  # noqa: E731
        sample_block(forward, [target], noise, new, act, rope([target.next_frame], block), config, record)
        worst = 0.0
        for x, timesteps, flow in record:
            dense = torch.cat([*committed, x], dim=2)
            frames = dense.shape[2]
            dense_t = torch.cat([torch.full((1, frames - block), config.context_timestep), timesteps], dim=1)
            reference = _dense(forward, dense, dense_t, new, per_frame)[:, :, -block:]
            worst = max(worst, (reference - flow).abs().max().item())
        results[rule] = worst
    assert results["recache"] <= 1e-5  # the whole context as if computed under the new prompt
    assert results["keep"] > 1e-3  # without it the old prompt's context stays
    assert torch.equal(cache.keys[:, :, committed_slots], before)  # the re-cache wrote a copy, not the cache
    kept = recache_context(forward, cache, log, new, rope, config, keep_sink=True)
    sink = slice(block * config.tokens_per_frame, 2 * block * config.tokens_per_frame)
    assert torch.equal(kept.keys[:, :, sink], cache.keys[:, :, sink])  # LongLive's global sink: kept as it was
    window = slice(2 * block * config.tokens_per_frame, 4 * block * config.tokens_per_frame)
    assert not torch.equal(kept.keys[:, :, window], cache.keys[:, :, window])


def test_a_prompt_transition_blends_the_embedding_over_n_blocks() -> None:
    from worldserve.models.wancausal.prompts import PromptTrack
    from worldserve.protocol import prompt_transition_control

    table = {"a": torch.zeros(2, 4), "b": torch.ones(2, 4)}
    track = PromptTrack("a", table["a"])
    weights, recached = [], []
    for index in range(5):
        controls = (prompt_transition_control(2),) if index == 0 else ()
        plan = track.plan("b", controls, table.__getitem__, default=0, recache=True)
        track.apply(plan)
        weights.append(round(plan.embedding[0, 0].item(), 4))
        recached.append(plan.recache)
    assert weights == [0.3333, 0.6667, 1.0, 1.0, 1.0]  # 2 blended blocks, then the new prompt alone
    assert recached == [True, True, True, False, False]  # each new embedding once, then the context has it
    at_once = PromptTrack("a", table["a"]).plan("b", (), table.__getitem__, default=0, recache=False)
    assert at_once.embedding[0, 0].item() == 1.0  # default 0: the first block takes the new prompt
    assert at_once.recache is False  # prompt_switch=keep never recomputes


def test_the_model_declares_the_transition_track_and_a_switch_reaches_the_context() -> None:
    from worldserve.models.base import SpecControlValidator
    from worldserve.models.world import keys_control
    from worldserve.protocol import TickRequest, prompt_transition_control

    keep = load_model("wan-causal", config="tiny", family="self-forcing", threads=1)
    recache = load_model("wan-causal", config="tiny", family="longlive", threads=1)
    assert recache.prompt_switch == "recache"
    assert keep.prompt_switch == "keep"
    assert keep.spec.control("prompt_transition").schema == "worldserve.prompt_transition.v1"
    assert "prompt_transition" not in keep.spec.continuous_tracks  # one per prompt change, never coalesced
    SpecControlValidator(keep.spec).validate_controls([prompt_transition_control(3)])
    with pytest.raises(ValueError, match="minimum"):
        SpecControlValidator(keep.spec).validate_controls([prompt_transition_control(-1)])
    outputs = {}
    for name, model in (("keep", keep), ("recache", recache)):
        state = model.new_state("s", SessionOptions(prompt="snowy peaks", seed=2))
        frames = []
        for index, prompt in enumerate(("snowy peaks", "desert dunes at night")):
            tick = TickRequest("s", f"s-{index}", index, prompt=prompt, controls=(keys_control("W"),))
            frames.append(model.step([(state, tick)])[0]["payload"])
        outputs[name] = (state, frames)
    state, _ = outputs["recache"]
    assert state.prompt.context_key == ("desert dunes at night", "desert dunes at night", 1.0)
    assert len(state.log.blocks) == 3  # the primed block and the two generated ones, all in the window


def test_an_explicit_family_runs_another_familys_checkpoint_with_its_settings(tmp_path: Path) -> None:
    from worldserve.models.wan.statedict import WeightsError

    wan_files.save_self_forcing(tmp_path / "self_forcing_dmd.pt", wan_files.random_transformer(get_config("tiny")))
    model = load_model("wan-causal", weights=str(tmp_path), family="causvid", text="hashed", vae="random", threads=1)
    assert model.weights.parts.transformer == tmp_path / "self_forcing_dmd.pt"
    assert (model.family.name, model.config.shift) == ("causvid", 8.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no transformer checkpoint under it"):
        load_model("wan-causal", weights=str(tmp_path / "empty"), text="hashed", vae="random")
