"""The Wan2.1 families run with their authors' inference settings (schedule, context, prompt-switch rule).

The numbers below are copied from the released configs and code (docs/models.md names each
file and commit), not from the module under test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import wan_files  # noqa: E402
from worldserve.models import load_model  # noqa: E402
from worldserve.models.base import SessionOptions  # noqa: E402
from worldserve.models.wancausal.config import CONFIGS, get_config  # noqa: E402
from worldserve.models.wancausal.families import FAMILIES, family_config  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    from worldserve.models.wancausal.sampler import StepRecord, draw_noise, sample_block

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
    causvid = load_model("wan-causal", weights=str(tmp_path / "1"), text="hashed", vae="random", threads=1)
    assert causvid.config.schedule() == family_config(causvid.config, FAMILIES["causvid"]).schedule()
    # The network is fed CausVid's raw timesteps; x0 uses the table's sigma.
    from worldserve.models.wancausal.cache import KVCache

    config = causvid.config
    cache = KVCache(config, CPU, torch.float32)
    shape = (config.latent_channels, config.block_frames, config.latent_height, config.latent_width)
    generator = torch.Generator().manual_seed(3)
    record: list[StepRecord] = []
    text = torch.zeros(1, config.text_len, config.text_dim)
    still = torch.zeros(1, config.block_frames, config.action_dim)
    with torch.no_grad():
        x0 = sample_block(
            causvid.forward,
            [cache],
            lambda: draw_noise([generator], shape, CPU),
            text,
            still,
            causvid.rope([0], 3),
            config,
            record,
        )
    assert [r[1][0, 0].item() for r in record] == [1000.0, 757.0, 522.0]
    x, _, flow = record[-1]
    assert torch.allclose(x0, x - 0.5217391304347826 * flow, atol=1e-6)


def test_the_euler_sampler_takes_the_flow_matching_ode_step() -> None:
    from worldserve.models.wancausal.sampler import StepRecord, draw_noise, sample_block

    model = load_model("wan-causal", config="tiny", family="wan", steps=3, threads=1)
    config = model.config
    assert config.sampler == "euler"
    cache = model.new_state("s", SessionOptions(seed=1)).cache
    shape = (config.latent_channels, config.block_frames, config.latent_height, config.latent_width)
    generator = torch.Generator().manual_seed(4)
    record: list[StepRecord] = []
    text = torch.zeros(1, config.text_len, config.text_dim)
    still = torch.zeros(1, config.block_frames, config.action_dim)
    with torch.no_grad():
        x0 = sample_block(
            model.forward,
            [cache],
            lambda: draw_noise([generator], shape, CPU),
            text,
            still,
            model.rope([cache.next_frame], 3),
            config,
            record,
        )
    sigmas = [s for _, s in config.schedule()] + [0.0]
    for index, (x, _, flow) in enumerate(record):
        following = record[index + 1][0] if index + 1 < len(record) else x0
        assert torch.allclose(following, x + (sigmas[index + 1] - sigmas[index]) * flow, atol=1e-5)


def test_the_vae_decode_flops_are_what_torch_counts_on_the_decoder() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from worldserve.models.wancausal.build import build_vae
    from worldserve.models.wancausal.vae import VaeStream

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
