"""The Wan2.1-based families and their authors' inference settings, each number with its source.

Owns: :class:`Family` and :data:`FAMILIES` (``self-forcing``, ``causvid``, ``longlive``,
``krea``, ``wan``): the denoising step list as the released config writes it, whether it is
warped through the shifted table, the shift, the update rule, the block, the context (sink and
window, in latent frames), the context timestep, the prompt-switch rule (``keep`` or
``recache``, and whether a re-cache recomputes the sink), the default prompt transition, the EMA
choice, and the size its released checkpoint has; :func:`family_config` (a size's configuration
with a family's settings; ``steps=``: :func:`uniform_steps`) and :func:`guess_family`. Where the
released code does something this serving path does not (rolling past the training length,
re-encoded anchors), the family's ``notes`` say so. Must not know: torch, files, sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from worldserve.models.wan.config import WanCausalConfig

__all__ = ["FAMILIES", "Family", "family_config", "get_family", "guess_family", "uniform_steps"]

SF = "guandeh17/Self-Forcing@33593df"
CV = "tianweiy/CausVid@ca21150"
LL = "NVlabs/LongLive@2462895"  # the last Wan2.1-T2V-1.3B release, before LongLive 2.0 (57f39c1)
KR = "krea-ai/realtime-video@acf4b7b"
WAN = "Wan-Video/Wan2.1@9737cba"


def uniform_steps(steps: int) -> tuple[float, ...]:
    """``steps`` timesteps evenly spaced from 1000 down (the last one ``1000 / steps``, not 0)."""
    return tuple(1000.0 - 1000.0 * i / steps for i in range(steps))


@dataclass(frozen=True, slots=True)
class Family:
    """One family's inference settings; ``sources`` names where each comes from (repo@commit path)."""

    name: str
    title: str
    size: str
    denoising_steps: tuple[float, ...]
    warp: bool
    shift: float
    sampler: str
    block_frames: int
    sink_frames: int
    window_frames: int
    context_timestep: float
    prompt_switch: str
    recache_sink: bool
    prompt_transition: int
    ema: bool
    sources: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "self-forcing": Family(
        name="self-forcing",
        title="Self-Forcing (DMD), Wan2.1-T2V-1.3B",
        size="1.3b",
        denoising_steps=(1000, 750, 500, 250),
        warp=True,
        shift=5.0,
        sampler="renoise",
        block_frames=3,
        sink_frames=3,
        window_frames=15,
        context_timestep=0.0,
        prompt_switch="keep",
        recache_sink=True,
        prompt_transition=0,
        ema=True,
        sources={
            "steps, warp, shift, block": f"{SF} configs/self_forcing_dmd.yaml (denoising_step_list, "
            "warp_denoising_step: true, timestep_shift: 5.0, num_frame_per_block: 3)",
            "context": f"{SF} utils/wan_wrapper.py (local_attn_size=-1, sink_size=0) and "
            "wan/modules/causal_model.py (max_attention_size 32760 tokens = 21 latent frames)",
            "context timestep": f"{SF} configs/default_config.yaml (context_noise: 0)",
            "EMA": f"{SF} README.md (inference.py --use_ema)",
        },
        notes=(
            "The released inference attends to everything up to 21 latent frames (81 video frames) and "
            "stops there (its KV cache holds 32760 tokens and does not roll; demo.py runs 7 blocks). Past that, "
            "this serving path keeps the primed first block as the sink and the 15 most recent frames, so every "
            "block sees the 18 earlier frames the model was trained to see at most.",
        ),
    ),
    "causvid": Family(
        name="causvid",
        title="CausVid (DMD, autoregressive), Wan2.1-T2V-1.3B",
        size="1.3b",
        denoising_steps=(1000, 757, 522),
        warp=False,
        shift=8.0,
        sampler="renoise",
        block_frames=3,
        sink_frames=3,
        window_frames=15,
        context_timestep=0.0,
        prompt_switch="keep",
        recache_sink=True,
        prompt_transition=0,
        ema=False,
        sources={
            "steps, warp, shift, block": f"{CV} configs/wan_causal_dmd.yaml (denoising_step_list 1000/757/522/0, "
            "the final 0 dropped by causal_inference.py; warp_denoising_step: false; timestep_shift: 8.0; "
            "num_frame_per_block: 3)",
            "sigma lookup": f"{CV} causvid/models/wan/wan_wrapper.py (FlowMatchScheduler(shift=8, sigma_min=0, "
            "extra_one_step=True), sigma at the nearest table timestep)",
            "context": f"{CV} causvid/models/wan/causal_inference.py (KV cache of 32760 tokens = 21 latent frames)",
            "context timestep": f"{CV} causvid/models/wan/causal_inference.py (cache re-run at timestep * 0)",
            "EMA": f"{CV} minimal_inference/longvideo_autoregressive_inference.py (state_dict['generator'])",
        },
        notes=(
            "The released inference attends to everything up to 21 latent frames; its long-video script then "
            "starts a fresh rollout from 3 overlap frames (the last frame re-encoded plus 2 latents). This "
            "serving path instead rolls: the primed first block as the sink and the 15 most recent frames.",
        ),
    ),
    "longlive": Family(
        name="longlive",
        title="LongLive (frame sink + short window, KV re-cache), Wan2.1-T2V-1.3B + LoRA",
        size="1.3b",
        denoising_steps=(1000, 750, 500, 250),
        warp=True,
        shift=5.0,
        sampler="renoise",
        block_frames=3,
        sink_frames=3,
        window_frames=6,
        context_timestep=0.0,
        prompt_switch="recache",
        recache_sink=False,
        prompt_transition=0,
        ema=False,
        sources={
            "steps, warp, shift, block": f"{LL} configs/longlive_inference.yaml and "
            "longlive_interactive_inference.yaml (denoising_step_list, warp_denoising_step: true, "
            "timestep_shift: 5.0, num_frame_per_block: 3)",
            "context": f"{LL} same configs (local_attn_size: 12, sink_size: 3): 12 frames = sink 3 + window 6 + "
            "the block's 3; wan/modules/causal_model.py keeps the sink and rolls the rest",
            "prompt switch": f"{LL} pipeline/interactive_causal_inference.py (_recache_after_switch: recompute "
            "the cached frames under the new prompt; global_sink: true keeps the sink's K/V)",
            "EMA, LoRA": f"{LL} configs (use_ema: false; adapter lora rank 256, alpha 256)",
        },
        notes=(
            "LongLive's re-cache recomputes the last min(12, frames) frames in one forward in which every "
            "recomputed frame sees the sink and all the recomputed frames (no causal mask inside the "
            "window); this serving path recomputes them block by block, each block seeing the sink and the "
            "blocks before it, as they were first computed. Both keep the sink's K/V (global_sink).",
        ),
    ),
    "krea": Family(
        name="krea",
        title="Krea Realtime 14B (Self-Forcing distillation of Wan2.1-T2V-14B)",
        size="14b",
        denoising_steps=(1000, 750, 500, 250, 0),
        warp=True,
        shift=5.0,
        sampler="renoise",
        block_frames=3,
        sink_frames=1,
        window_frames=2,
        context_timestep=0.0,
        prompt_switch="recache",
        recache_sink=True,
        prompt_transition=2,
        ema=True,
        sources={
            "steps": f"{KR} release_server.py (GenerateParams.num_denoising_steps = 5; get_denoising_schedule in "
            "v2v.py: linspace(1000, 0, 5) warped = 1000, 937.5, 833.3, 625, 0; configs/self_forcing_server_14b.yaml "
            "lists the same)",
            "shift, block": f"{KR} configs/self_forcing_server_14b.yaml (timestep_shift: 5.0, num_frame_per_block: 3)",
            "context": f"{KR} release_server.py (kv_cache_num_frames = 3: the first latent frame and the 2 most "
            "recent, recomputed before every block; the block's own 3 on top)",
            "prompt switch": f"{KR} release_server.py (recompute_kv_cache before every block under the current "
            "prompt embedding; interpolate_prompt_embeds over interp_steps = 4 blocks by default)",
        },
        notes=(
            "Krea recomputes the context's K/V before every block from the clean latents; this serving path "
            "keeps them from each block's commit pass and recomputes them (sink included) whenever a block's "
            "prompt embedding differs from the one they were computed under, which is every block of a transition.",
            "Krea's interpolation of S blocks is torch.lerp over linspace(0, 1, S): its first block after a "
            "change still uses the old prompt (weight 0); prompt_transition=S-2 gives the same blend from the "
            "first block (default 2 for Krea's 4).",
            "Once the first latent frame leaves its window, Krea re-encodes the oldest decoded context frame as "
            "the anchor and places the context at positions 0-2 before the block; this serving path keeps the "
            "session's true first frame as the sink, at its absolute position.",
        ),
    ),
    "wan": Family(
        name="wan",
        title="Wan2.1 T2V (the undistilled base model, bidirectional), 1.3B or 14B",
        size="1.3b",
        denoising_steps=uniform_steps(50),
        warp=True,
        shift=5.0,
        sampler="euler",
        block_frames=3,
        sink_frames=3,
        window_frames=15,
        context_timestep=0.0,
        prompt_switch="keep",
        recache_sink=True,
        prompt_transition=0,
        ema=True,
        sources={
            "steps, shift": f"{WAN} generate.py (sample_steps 50 for t2v, sample_shift 5.0)",
            "frames": f"{WAN} generate.py (frame_num 81 = 21 latent frames)",
        },
        notes=(
            "Wan2.1 is a bidirectional model, trained to denoise all 21 latent frames together; run "
            "block-causally it is a baseline for loading and throughput, not a realtime model.",
            "Wan samples with UniPC (order 2) and classifier-free guidance 5.0 (a second, negative-prompt "
            "forward per step); here each step is a flow-matching Euler step on the same shifted grid, "
            "without guidance (steps= sets how many).",
        ),
    ),
}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown wan-causal family {name!r}; known: {sorted(FAMILIES)}.") from None


def guess_family(size: str, implied: str | None) -> str:
    """The family a checkpoint's published name implies, else the size's (14b: Krea), else Self-Forcing."""
    if implied is not None:
        return implied
    return "krea" if size == "14b" else "self-forcing"


def family_config(config: WanCausalConfig, family: Family, steps: int | None = None) -> WanCausalConfig:
    """``config``'s size with ``family``'s inference settings (``steps``: a uniform grid of that many steps)."""
    denoising = family.denoising_steps
    if steps is not None:
        if steps <= 0:
            raise ValueError(f"steps must be positive; got {steps}.")
        denoising = uniform_steps(steps)
    return replace(
        config,
        denoising_steps=denoising,
        warp=family.warp,
        shift=family.shift,
        sampler=family.sampler,
        block_frames=family.block_frames,
        sink_frames=family.sink_frames,
        window_frames=family.window_frames if config.name != "tiny" else config.window_frames,
        context_timestep=family.context_timestep,
        family=family.name,
    )
