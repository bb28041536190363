"""Sizes of the block-causal Wan model family, and the arithmetic they imply.

Owns: :class:`WanCausalConfig` (transformer, VAE, latent grid, AR block, KV window,
sampler schedule), the named configurations :data:`CONFIGS` (``tiny`` for tests on a CPU,
``1.3b`` for Wan2.1-T2V-1.3B, ``14b`` for Wan2.1-T2V-14B) and the per-session byte and FLOP counts the spec and the
docs quote. Must not know: torch, diffusers, sessions, the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

__all__ = ["CONFIGS", "WanCausalConfig", "get_config"]


@dataclass(frozen=True, slots=True)
class WanCausalConfig:
    """One size of the model. Frame counts are *latent* frames unless named ``video``."""

    name: str
    # Transformer (diffusers ``SkyReelsV2Transformer3DModel`` arguments).
    num_layers: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    text_dim: int
    freq_dim: int
    latent_channels: int
    patch: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    # Text conditioning: tokens per prompt (UMT5 pads to this length).
    text_len: int = 512
    # VAE (diffusers ``AutoencoderKLWan`` arguments).
    vae_base_dim: int = 96
    vae_dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    vae_res_blocks: int = 2
    vae_latents_mean: tuple[float, ...] | None = None
    vae_latents_std: tuple[float, ...] | None = None
    #: Wan2.2's VAE (``AutoencoderKLWan`` with ``is_residual``): a wider decoder than encoder
    #: (``decoder_base_dim``; None: ``vae_base_dim``), residual up/down blocks, and pixels taken in
    #: ``vae_patch`` x ``vae_patch`` patches (``patch_size``: 2, so 16x spatial with 48 latent
    #: channels). Wan2.1's VAE: None, False, 1 (8x spatial).
    vae_decoder_base_dim: int | None = None
    vae_residual: bool = False
    vae_patch: int = 1
    # Video and the AR block.
    height: int = 480
    width: int = 832
    fps: float = 16.0
    block_frames: int = 3
    #: KV cache: the first ``sink_frames`` latent frames (the primed start block) stay;
    #: after them a sliding window of the ``window_frames`` most recent latent frames.
    sink_frames: int = 3
    window_frames: int = 9
    # Sampler: the denoising step list as a family's released config writes it (on the
    # 1000-step grid), whether it is warped through the shifted table, the flow shift, and the
    # update rule ("renoise": x0 re-noised with fresh noise, the distilled few-step samplers;
    # "euler": the flow-matching ODE step, for the undistilled base model).
    denoising_steps: tuple[float, ...] = (1000, 750, 500, 250)
    warp: bool = True
    shift: float = 5.0
    sampler: str = "renoise"
    #: The timestep the commit pass writes the cache at (Self-Forcing's context noise).
    context_timestep: float = 0.0
    #: The family whose inference settings these are (:mod:`~worldserve.models.wancausal.families`).
    family: str = "self-forcing"
    #: Action conditioning: per-latent-frame features (vx, vy, |v|, moving).
    action_dim: int = 4

    def __post_init__(self) -> None:
        spatial = self.vae_spatial
        if self.height % (spatial * self.patch[1]) or self.width % (spatial * self.patch[2]):
            raise ValueError(
                f"height/width must be multiples of {spatial * self.patch[1]}; got {self.height}x{self.width}."
            )
        if self.block_frames <= 0 or self.sink_frames < 0 or self.window_frames <= 0:
            raise ValueError("block_frames and window_frames must be positive, sink_frames non-negative.")
        if self.sink_frames > self.block_frames:
            raise ValueError("sink_frames must fit in the primed start block (at most block_frames).")
        if self.sampler not in ("renoise", "euler"):
            raise ValueError(f"sampler must be 'renoise' or 'euler'; got {self.sampler!r}.")
        if not self.denoising_steps:
            raise ValueError("denoising_steps must name at least one step.")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def vae_spatial(self) -> int:
        """Pixels per latent along height and width: 8 (Wan2.1's VAE), 16 (Wan2.2's, 2x2 patches)."""
        return 8 * self.vae_patch

    @property
    def latent_height(self) -> int:
        return self.height // self.vae_spatial

    @property
    def latent_width(self) -> int:
        return self.width // self.vae_spatial

    @property
    def tokens_per_frame(self) -> int:
        return (self.latent_height // self.patch[1]) * (self.latent_width // self.patch[2])

    @property
    def video_frames_per_block(self) -> int:
        """Video frames one block of latent frames decodes to (4 per latent frame after the first)."""
        return 4 * self.block_frames

    @property
    def cache_frames(self) -> int:
        """Latent frames of K/V a session holds: the current block's scratch, the sink, the window."""
        return self.block_frames + self.sink_frames + self.window_frames

    def kv_bytes_per_frame(self, dtype_bytes: int) -> int:
        """K and V of one latent frame across every layer."""
        return 2 * self.num_layers * self.tokens_per_frame * self.dim * dtype_bytes

    def kv_bytes(self, dtype_bytes: int) -> int:
        return self.cache_frames * self.kv_bytes_per_frame(dtype_bytes)

    def forward_flops(self, query_frames: int, key_frames: int) -> int:
        """Multiply-adds x2 of one transformer forward over ``query_frames`` attending to ``key_frames``."""
        lq = query_frames * self.tokens_per_frame
        lk = key_frames * self.tokens_per_frame
        d = self.dim
        per_layer = (
            2 * lq * d * (4 * d)  # q, k, v, out projections
            + 2 * 2 * lq * lk * d  # scores and weighted values
            + 2 * lq * d * (2 * d)
            + 2 * self.text_len * d * (2 * d)  # cross-attn q/out; text k/v
            + 2 * 2 * lq * self.text_len * d  # cross-attn scores and values
            + 2 * lq * d * self.ffn_dim * 2  # FFN up and down
        )
        return self.num_layers * per_layer

    def block_flops(self) -> int:
        """Transformer FLOPs of one AR block at the full window: every denoising step plus the commit pass."""
        keys = self.cache_frames
        return (len(self.denoising_steps) + 1) * self.forward_flops(self.block_frames, keys)

    def vae_decode_flops(self, latent_frames: int | None = None) -> int:
        """FLOPs of the streaming VAE decode of ``latent_frames`` (a block by default), after the first.

        Every convolution of the decoder (``2 * C_in * C_out * kernel volume`` per output
        element) and the middle block's spatial attention, at the resolution and frame count it
        runs at: the first two levels double the frames (4 video frames per latent frame),
        every level but the last doubles height and width. Counted for Wan2.1's VAE: Wan2.2's
        (residual blocks, a wider decoder, patches) is refused rather than miscounted.
        """
        if self.vae_residual or self.vae_patch != 1 or self.vae_decoder_base_dim is not None:
            raise ValueError("vae_decode_flops counts Wan2.1's VAE decoder; this configuration has Wan2.2's.")
        frames = latent_frames if latent_frames is not None else self.block_frames
        h, w = self.latent_height, self.latent_width
        z, base, mult, res = self.latent_channels, self.vae_base_dim, self.vae_dim_mult, self.vae_res_blocks
        dims = [base * u for u in (mult[-1], *mult[::-1])]
        temporal = (True, True, False)[: len(mult) - 1]

        def conv(c_in: int, c_out: int, kernel: int, t: int, hh: int, ww: int) -> int:
            return 2 * c_in * c_out * kernel * t * hh * ww

        def residual(c_in: int, c_out: int, t: int, hh: int, ww: int) -> int:
            shortcut = conv(c_in, c_out, 1, t, hh, ww) if c_in != c_out else 0
            return conv(c_in, c_out, 27, t, hh, ww) + conv(c_out, c_out, 27, t, hh, ww) + shortcut

        t = frames
        total = conv(z, z, 1, t, h, w) + conv(z, dims[0], 27, t, h, w)  # post_quant_conv, conv_in
        d0 = dims[0]
        tokens = h * w
        attention = conv(d0, 3 * d0, 1, t, h, w) + conv(d0, d0, 1, t, h, w) + 2 * 2 * tokens * tokens * d0 * t
        total += 2 * residual(d0, d0, t, h, w) + attention
        for level, (in_dim, out_dim) in enumerate(pairwise(dims)):
            if level in (1, 2, 3):
                in_dim //= 2
            for _ in range(res + 1):
                total += residual(in_dim, out_dim, t, h, w)
                in_dim = out_dim
            if level != len(mult) - 1:
                if temporal[level]:
                    total += conv(out_dim, 2 * out_dim, 3, t, h, w)  # time_conv, then twice the frames
                    t *= 2
                h, w = 2 * h, 2 * w
                total += conv(out_dim, out_dim // 2, 9, t, h, w)  # nearest upsample, then a 3x3 conv
        return total + conv(dims[-1], 3, 27, t, h, w)

    def table(self) -> tuple[list[float], list[float]]:
        """The shifted 1000-entry grid every family samples on: (timesteps, sigmas).

        As ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True).set_timesteps(1000)``
        builds it in Self-Forcing/CausVid/LongLive/Krea (``utils/scheduler.py``): sigma
        ``s = 1 - i/1000`` for i in 0..999, shifted ``shift*s / (1 + (shift-1)*s)``, timestep
        ``1000 * sigma`` (here in float64).
        """
        sigmas = []
        for i in range(1000):
            s = 1.0 - i / 1000.0
            sigmas.append(self.shift * s / (1.0 + (self.shift - 1.0) * s))
        return [1000.0 * sigma for sigma in sigmas], sigmas

    def sigma_at(self, timestep: float) -> float:
        """The table's sigma at the grid timestep nearest ``timestep`` (the authors' ``argmin`` lookup)."""
        timesteps, sigmas = self.table()
        index = min(range(len(timesteps)), key=lambda i: abs(timesteps[i] - timestep))
        return sigmas[index]

    def schedule(self) -> tuple[tuple[float, float], ...]:
        """(timestep fed to the network, sigma) per denoising step.

        Warped (``warp_denoising_step: true``): step ``k`` is the table's entry ``1000 - k``
        (entry 1000 is timestep 0). Unwarped: the step is the timestep itself. Either way the
        sigma is the table's at the nearest grid timestep, as the authors convert flow to x0.
        """
        timesteps, _ = self.table()
        padded = [*timesteps, 0.0]
        out = []
        for step in self.denoising_steps:
            t = padded[1000 - round(step)] if self.warp else float(step)
            out.append((t, self.sigma_at(t)))
        return tuple(out)

    def sigmas(self) -> tuple[float, ...]:
        return tuple(sigma for _, sigma in self.schedule())

    def with_window(self, window_frames: int) -> WanCausalConfig:
        return replace(self, window_frames=window_frames)


CONFIGS: dict[str, WanCausalConfig] = {
    # A few layers, small width, an 8x8 latent grid (16 tokens per frame), a 4-channel tiny VAE:
    # the whole path runs on a CPU in seconds.
    "tiny": WanCausalConfig(
        name="tiny",
        num_layers=2,
        num_heads=2,
        head_dim=16,
        ffn_dim=64,
        text_dim=16,
        freq_dim=16,
        latent_channels=4,
        text_len=8,
        vae_base_dim=8,
        vae_latents_mean=(0.0, 0.0, 0.0, 0.0),
        vae_latents_std=(1.0, 1.0, 1.0, 1.0),
        height=64,
        width=64,
        window_frames=6,
    ),
    # Wan2.1-T2V-1.3B made block-causal (Self-Forcing): 30 layers, 12 heads x 128, FFN 8960,
    # 832x480 -> 60x104 latents -> 1560 tokens per latent frame; 3 latent frames = 12 video
    # frames per block at 16 fps; 4 denoising steps.
    "1.3b": WanCausalConfig(
        name="1.3b",
        num_layers=30,
        num_heads=12,
        head_dim=128,
        ffn_dim=8960,
        text_dim=4096,
        freq_dim=256,
        latent_channels=16,
    ),
    # Wan2.1-T2V-14B (Krea Realtime 14B is this size): 40 layers, 40 heads x 128, FFN 13824
    # (Wan-Video/Wan2.1 wan/configs/wan_t2v_14B.py); the same VAE, text encoder and grid as 1.3b.
    "14b": WanCausalConfig(
        name="14b",
        num_layers=40,
        num_heads=40,
        head_dim=128,
        ffn_dim=13824,
        text_dim=4096,
        freq_dim=256,
        latent_channels=16,
    ),
}


def get_config(name: str) -> WanCausalConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown wan-causal config {name!r}; known: {sorted(CONFIGS)}.") from None
