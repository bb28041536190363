"""Matrix-Game 2.0's sizes, its three released variants, and the arithmetic they imply.

Owns: :class:`ActionConfig` (the action modules: which blocks carry one, the keyboard's width,
whether there is a mouse, their widths, the window of video-frame actions each latent frame
reads, their RoPE), :class:`ClipConfig` (the image encoder whose features the cross-attention
reads), :class:`Variant` and :data:`VARIANTS` (``universal``, ``gta-drive``, ``templerun``: the
action space each was trained on, its context and its schedule, each number with its source),
:class:`MatrixGameConfig` (a size with a variant: the Wan geometry the shared cache, sampler and
VAE run on, plus what Matrix-Game adds), :func:`matrix_config` and the per-session byte and FLOP
counts the spec and the docs quote. Must not know: torch, diffusers, sessions.

Matrix-Game 2.0 is Wan2.1-T2V-1.3B's transformer made image-to-world: no text encoder; the
cross-attention reads the start image's CLIP features; the latent input is the noisy latents
concatenated with a 4-channel first-frame mask and the start image's VAE latents (36 channels);
the first 15 blocks carry an action module between the cross-attention and the FFN. Its context
is a window of the most recent latent frames with no sink, the block's own frames included.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from worldserve.models.wan.config import CONFIGS as WAN_CONFIGS
from worldserve.models.wan.config import WanCausalConfig

__all__ = [
    "CONFIGS",
    "SIZES",
    "VARIANTS",
    "ActionConfig",
    "ClipConfig",
    "MatrixGameConfig",
    "Variant",
    "get_variant",
    "matrix_config",
]

MG = "SkyworkAI/Matrix-Game@3ceb311 Matrix-Game-2"
FV = "hao-ai-lab/FastVideo@2f3d407"


@dataclass(frozen=True, slots=True)
class ActionConfig:
    """The action modules (the reference's ``action_config``; names in brackets are its keys)."""

    #: Keyboard actions per video frame [keyboard_dim_in]: 4 (universal), 2 (GTA), 7 (Temple Run).
    keyboard_dim: int
    #: Whether there is a mouse branch [enable_mouse]; every variant has the keyboard branch.
    mouse: bool
    #: The transformer blocks that carry an action module [blocks].
    layers: tuple[int, ...]
    heads: int = 16  # [heads_num]
    keyboard_embed_dim: int = 128  # [hidden_size]: each video frame's keys are embedded to this
    keyboard_hidden: int = 1024  # [keyboard_hidden_dim]
    mouse_hidden: int = 1024  # [mouse_hidden_dim]
    mouse_dim: int = 2  # [mouse_dim_in]: (pitch, yaw) per video frame
    frames_per_latent: int = 4  # [vae_time_compression_ratio]
    window: int = 3  # [windows_size]: latent frames' worth of video-frame actions each latent frame reads
    #: RoPE split of a head (time, height, width) [mouse_qk_dim_list] and its theta [rope_theta]. Only the
    #: time part rotates: the height and width axes have one position (0), whose rotation is the identity.
    rope_dims: tuple[int, int, int] = (8, 28, 28)
    rope_theta: float = 256.0
    qkv_bias: bool = False  # [qkv_bias]

    @property
    def head_dim(self) -> int:
        return self.keyboard_hidden // self.heads

    @property
    def window_frames(self) -> int:
        """Video frames of actions each latent frame reads (12)."""
        return self.window * self.frames_per_latent

    def __post_init__(self) -> None:
        if self.keyboard_hidden % self.heads or self.mouse_hidden % self.heads:
            raise ValueError("the action modules' widths must split into their heads.")
        if self.mouse and self.mouse_hidden // self.heads != self.head_dim:
            raise ValueError("the mouse and keyboard attentions share one RoPE table: equal head widths.")
        if sum(self.rope_dims) != self.head_dim:
            raise ValueError(f"rope_dims {self.rope_dims} must sum to the action head width {self.head_dim}.")


@dataclass(frozen=True, slots=True)
class ClipConfig:
    """The image encoder: OpenCLIP's ViT-H/14 vision tower (Wan2.1-I2V's ``clip_xlm_roberta_vit_h_14``)."""

    dim: int = 1280
    layers: int = 32
    heads: int = 16
    mlp_dim: int = 5120
    image_size: int = 224
    patch: int = 14

    @property
    def tokens(self) -> int:
        """Tokens the cross-attention reads: one per patch and the class token (257)."""
        return (self.image_size // self.patch) ** 2 + 1


@dataclass(frozen=True, slots=True)
class Variant:
    """One released model: its action space, context, schedule and published files, with sources."""

    name: str
    title: str
    #: The reference's ``mode``.
    mode: str
    #: The keys a player holds, and the keyboard index each sets (the reference's ``KEYBOARD_IDX``).
    keys: tuple[tuple[str, int], ...]
    #: The keyboard index set when no key is held (Temple Run's ``nomove``), else None (all zeros).
    idle_index: int | None
    #: At most one key at a time (the actions were one-hot in training).
    one_hot: bool
    keyboard_dim: int
    mouse: bool
    #: Latent frames the self-attention and the action modules see, the block's own included [local_attn_size].
    local_attn_size: int
    denoising_steps: tuple[float, ...]
    #: The published checkpoint's folder and file in Skywork/Matrix-Game-2.0.
    published: str
    #: FastVideo's Diffusers folder of the same weights.
    diffusers: str
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.keys)


def _sources(mode: str, yaml: str) -> dict[str, str]:
    return {
        "steps, warp, shift, block, context noise": f"{MG} configs/inference_yaml/{yaml} (denoising_step_list, "
        "warp_denoising_step: true, timestep_shift: 5.0, num_frame_per_block: 3, context_noise: 0)",
        "context": f"{MG} configs/distilled_model/{mode}/config.json (local_attn_size, sink_size: 0) with "
        "wan/modules/causal_model.py (the KV cache holds local_attn_size frames, the block's own included; "
        "attention reads all of them) and pipeline/causal_inference.py (_initialize_kv_cache)",
        "action space": f"{MG} pipeline/causal_inference.py (get_current_action) and utils/conditions.py "
        "(the Bench_actions_* key indexes)",
        "actions per latent frame": f"{MG} wan/modules/action_module.py (the windows of windows_size * "
        "vae_time_compression_ratio video frames before each latent frame, the first frame's action as padding)",
    }


VARIANTS: dict[str, Variant] = {
    "universal": Variant(
        name="universal",
        title="Matrix-Game 2.0 universal (keyboard W/S/A/D + mouse)",
        mode="universal",
        keys=(("W", 0), ("S", 1), ("A", 2), ("D", 3)),
        idle_index=None,
        one_hot=False,
        keyboard_dim=4,
        mouse=True,
        local_attn_size=6,
        denoising_steps=(1000, 666, 333),
        published="base_distilled_model/base_distill.safetensors",
        diffusers="Matrix-Game-2.0-Base-Distilled-Diffusers",
        sources=_sources("universal", "inference_universal.yaml"),
    ),
    "gta-drive": Variant(
        name="gta-drive",
        title="Matrix-Game 2.0 GTA driving (keyboard W/S + mouse steering)",
        mode="gta_drive",
        keys=(("W", 0), ("S", 1)),
        idle_index=None,
        one_hot=False,
        keyboard_dim=2,
        mouse=True,
        local_attn_size=4,
        denoising_steps=(1000, 666, 333),
        published="gta_distilled_model/gta_keyboard2dim.safetensors",
        diffusers="Matrix-Game-2.0-GTA-Distilled-Diffusers",
        sources=_sources("gta_drive", "inference_gta_drive.yaml"),
    ),
    "templerun": Variant(
        name="templerun",
        title="Matrix-Game 2.0 Temple Run (7 one-hot keyboard actions, no mouse)",
        mode="templerun",
        # W jump, S slide, Z turn left, C turn right, A move left, D move right; none held: nomove (index 0).
        keys=(("W", 1), ("S", 2), ("Z", 3), ("C", 4), ("A", 5), ("D", 6)),
        idle_index=0,
        one_hot=True,
        keyboard_dim=7,
        mouse=False,
        local_attn_size=6,
        denoising_steps=(1000, 750, 500, 250),
        published="templerun_distilled_model/templerun_7dim_onlykey.safetensors",
        diffusers="Matrix-Game-2.0-TempleRun-Distilled-Diffusers",
        sources=_sources("templerun", "inference_templerun.yaml"),
    ),
}

#: The reference's ``mode`` names -> the variant names used here.
MODES = {variant.mode: name for name, variant in VARIANTS.items()}


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[MODES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown matrix-game-2 variant {name!r}; known: {sorted(VARIANTS)}.") from None


@dataclass(frozen=True, slots=True)
class MatrixGameConfig:
    """A size with a variant. ``wan`` is the Wan geometry the shared parts run on: its ``text_len``
    and ``text_dim`` are the cross-attention's context (the CLIP tokens and their width)."""

    name: str
    wan: WanCausalConfig
    action: ActionConfig
    clip: ClipConfig
    variant: str
    #: Channels of the first-frame mask concatenated before the start image's latents (the reference's 4).
    mask_channels: int = 4

    @property
    def in_channels(self) -> int:
        """The patch embedding's input: noisy latents, mask, start-image latents (36 at 1.3b)."""
        return 2 * self.wan.latent_channels + self.mask_channels

    @property
    def tokens_per_frame(self) -> int:
        return self.wan.tokens_per_frame

    def attention_kv_bytes(self, dtype_bytes: int) -> int:
        return self.wan.kv_bytes(dtype_bytes)

    def mouse_kv_bytes(self, dtype_bytes: int) -> int:
        """The mouse attention's K/V: every token of every cached frame, per action block."""
        if not self.action.mouse:
            return 0
        per_frame = 2 * len(self.action.layers) * self.tokens_per_frame * self.action.mouse_hidden * dtype_bytes
        return self.wan.cache_frames * per_frame

    def keyboard_kv_bytes(self, dtype_bytes: int) -> int:
        """The keyboard attention's K/V: one token per cached frame, per action block."""
        return self.wan.cache_frames * 2 * len(self.action.layers) * self.action.keyboard_hidden * dtype_bytes

    def kv_bytes(self, dtype_bytes: int) -> int:
        return (
            self.attention_kv_bytes(dtype_bytes)
            + self.mouse_kv_bytes(dtype_bytes)
            + self.keyboard_kv_bytes(dtype_bytes)
        )

    def action_flops(self, query_frames: int, key_frames: int) -> int:
        """Multiply-adds x2 of one action module over ``query_frames`` against ``key_frames`` of its caches."""
        a = self.action
        lq = query_frames * self.tokens_per_frame
        dim = self.wan.dim
        flops = 0
        if a.mouse:
            c = a.mouse_hidden
            flops += 2 * lq * (dim + a.mouse_dim * a.window_frames) * c + 2 * lq * c * c  # mouse MLP
            flops += 2 * lq * c * 3 * c  # q, k, v
            flops += 2 * 2 * lq * key_frames * c  # each token against its own column of frames
            flops += 2 * lq * c * dim  # out
        k = a.keyboard_hidden
        frames = query_frames * a.frames_per_latent * a.window
        flops += 2 * frames * (a.keyboard_dim * a.keyboard_embed_dim + a.keyboard_embed_dim**2)  # key embedding
        flops += 2 * query_frames * a.keyboard_embed_dim * a.window_frames * 2 * k  # k, v
        flops += 2 * lq * dim * k + 2 * 2 * lq * key_frames * k + 2 * lq * k * dim  # q, attention, out
        return flops

    def forward_flops(self, query_frames: int, key_frames: int) -> int:
        """One forward over ``query_frames`` attending to ``key_frames``: the Wan blocks, the action
        modules, the 36-channel patch embedding and the image embedder."""
        wan = self.wan
        lq = query_frames * self.tokens_per_frame
        patch = 2 * lq * self.in_channels * wan.patch[0] * wan.patch[1] * wan.patch[2] * wan.dim
        image = 2 * self.clip.tokens * (self.clip.dim * self.clip.dim + self.clip.dim * wan.dim)
        actions = len(self.action.layers) * self.action_flops(query_frames, key_frames)
        return wan.forward_flops(query_frames, key_frames) + actions + patch + image

    def block_flops(self) -> int:
        """FLOPs of one AR block at the full window: every denoising step plus the commit pass."""
        wan = self.wan
        return (len(wan.denoising_steps) + 1) * self.forward_flops(wan.block_frames, wan.cache_frames)


def _wan(base: WanCausalConfig, name: str, **sizes: object) -> WanCausalConfig:
    return replace(base, name=name, **sizes)  # type: ignore[arg-type]


#: (Wan geometry, action widths, CLIP) per size; a variant sets the keyboard, mouse, context and schedule.
SIZES: dict[str, tuple[WanCausalConfig, ActionConfig, ClipConfig]] = {
    # A tiny Matrix-Game: 2 blocks (the first with an action module), a non-square 48x80 video (3x5 patches
    # per latent frame), a 4-channel tiny VAE, a 3-layer CLIP of 5 tokens: the whole path on a CPU in seconds.
    "tiny": (
        _wan(
            WAN_CONFIGS["tiny"],
            "tiny",
            text_len=5,
            text_dim=16,
            height=48,
            width=80,
            fps=25.0,
        ),
        ActionConfig(
            keyboard_dim=4,
            mouse=True,
            layers=(0,),
            heads=2,
            keyboard_embed_dim=8,
            keyboard_hidden=32,
            mouse_hidden=32,
            rope_dims=(4, 6, 6),
        ),
        ClipConfig(dim=16, layers=3, heads=2, mlp_dim=64, image_size=28, patch=14),
    ),
    # The released size (configs/distilled_model/*/config.json): Wan2.1-T2V-1.3B's blocks (dim 1536, 30 layers,
    # 12 heads, FFN 8960), 352x640 video (44x80 latents, 880 tokens per latent frame), 25 fps, action modules
    # in blocks 0-14, CLIP ViT-H/14 (257 tokens x 1280).
    "1.3b": (
        _wan(
            WAN_CONFIGS["1.3b"],
            "1.3b",
            text_len=257,
            text_dim=1280,
            height=352,
            width=640,
            fps=25.0,
        ),
        ActionConfig(keyboard_dim=4, mouse=True, layers=tuple(range(15))),
        ClipConfig(),
    ),
}

CONFIGS = tuple(SIZES)


def matrix_config(size: str, variant: str | Variant, *, window: int | None = None) -> MatrixGameConfig:
    """``size`` (``tiny``, ``1.3b``) with ``variant``'s action space, context and schedule.

    The context is the reference's: no sink; ``local_attn_size`` frames, the block's own 3 included,
    so the window holds ``local_attn_size - 3`` committed frames (``window=`` overrides it).
    """
    if size not in SIZES:
        raise ValueError(f"unknown matrix-game-2 config {size!r}; known: {list(CONFIGS)}.")
    chosen = variant if isinstance(variant, Variant) else get_variant(variant)
    wan, action, clip = SIZES[size]
    block = 3
    past = chosen.local_attn_size - block if window is None else window
    if past <= 0:
        raise ValueError(f"the window must hold at least one committed latent frame; got {past}.")
    wan = replace(
        wan,
        block_frames=block,
        sink_frames=0,
        window_frames=past,
        denoising_steps=chosen.denoising_steps,
        warp=True,
        shift=5.0,
        sampler="renoise",
        context_timestep=0.0,
        family="matrix-game-2",
    )
    action = replace(action, keyboard_dim=chosen.keyboard_dim, mouse=chosen.mouse)
    return MatrixGameConfig(name=size, wan=wan, action=action, clip=clip, variant=chosen.name)
