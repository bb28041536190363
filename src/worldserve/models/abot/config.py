"""Sizes of ``abot-world``: the Wan2.2-TI2V-5B transformer made block-causal, and what ABot-World adds.

Owns: :class:`ABotConfig` (a :class:`~worldserve.models.wan.config.WanCausalConfig` for the
transformer, the VAE, the block and the window, plus the reference slots, the keys and the relative
RoPE's bounds) and the named configurations :data:`CONFIGS`: ``tiny`` (a CPU runs it in seconds) and
``5b``, as the published ``ABot-World-0-5B-LF`` is set up. Its numbers, each from its source:

- the transformer: Wan2.2-TI2V-5B's (``Wan-Video/Wan2.2`` ``wan/configs/wan_ti2v_5B.py``): width
  3072 (24 heads x 128), FFN 14336, 30 layers, 48 latent channels in and out, patches (1, 2, 2),
  256-wide timestep features, 512 text tokens of umT5-XXL (4096 wide);
- the VAE: Wan2.2's (16x spatial: base width 160, decoder 256, residual blocks, 2x2 pixel patches)
  and its latent statistics (``wan/modules/vae2_2.py`` in both repositories);
- the stream (``configs/long_forcing_dmd.yaml``): 704x1280 video (latents 44x80), blocks of 3
  latent frames, ``local_attn_size`` 21 (the block and an 18-frame window, no sink), the steps
  [1000, 750, 500, 250] warped through the shift-5 table, context noise 0; 5 reference slots at
  512x512; the control adapter's downscale 16; 16 fps (the README).

Must not know: torch, the model's weights, sessions.
"""

from __future__ import annotations

from dataclasses import dataclass

from worldserve.models.wan.config import WanCausalConfig

__all__ = ["CONFIGS", "WAN22_LATENTS_MEAN", "WAN22_LATENTS_STD", "ABotConfig", "get_config"]

#: Wan2.2's VAE latent statistics, per channel (``wan/modules/vae2_2.py``).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ABotConfig:
    """One size of ``abot-world``: ``wan`` for what it shares with the Wan families, and its own parts."""

    wan: WanCausalConfig
    #: Reference images every query attends to (``ref_num_slots``), each encoded at this square size.
    ref_slots: int = 5
    ref_resolution: int = 512
    #: The keys' action bits (W A S D I J K L), each repeated in this many adapter input channels.
    keys: int = 8
    key_repeat: int = 4
    adapter_downscale: int = 16
    #: The relative RoPE's bounds (``REL_ROPE_REBASE_MAX_POS`` and the rotary table's length).
    rope_limit: int = 256
    rope_table: int = 1024

    def __post_init__(self) -> None:
        wan = self.wan
        if wan.sink_frames:
            raise ValueError("abot-world keeps no sink frames (the path its relative RoPE runs has none).")
        if self.ref_resolution % (wan.vae_spatial * wan.patch[1]):
            raise ValueError(f"ref_resolution must be a multiple of {wan.vae_spatial * wan.patch[1]}.")
        pixels = self.adapter_downscale * wan.patch[1]
        if wan.height % pixels or wan.width % pixels:
            raise ValueError(f"height/width must be multiples of {pixels} (the control adapter's patch).")

    @property
    def ref_grid(self) -> tuple[int, int]:
        """A reference slot's patches along height and width."""
        side = self.ref_resolution // self.wan.vae_spatial // self.wan.patch[1]
        return side, side

    @property
    def ref_tokens_per_slot(self) -> int:
        return self.ref_grid[0] * self.ref_grid[1]

    @property
    def ref_tokens(self) -> int:
        return self.ref_slots * self.ref_tokens_per_slot

    @property
    def local_frames(self) -> int:
        """Latent frames a query sees (``local_attn_size``): its block and the window."""
        return self.wan.block_frames + self.wan.window_frames


CONFIGS: dict[str, ABotConfig] = {
    # Two layers, a 4x4 patch grid of 12 latent channels (Wan2.2's VAE at tiny widths), two 2x2-patch
    # reference slots: the whole path on a CPU in seconds.
    "tiny": ABotConfig(
        WanCausalConfig(
            name="abot-tiny",
            num_layers=2,
            num_heads=2,
            head_dim=12,
            ffn_dim=48,
            text_dim=16,
            freq_dim=16,
            latent_channels=12,
            text_len=8,
            vae_base_dim=8,
            vae_decoder_base_dim=16,
            vae_residual=True,
            vae_patch=2,
            vae_latents_mean=tuple(0.1 * i for i in range(12)),
            vae_latents_std=tuple(1.0 + 0.05 * i for i in range(12)),
            height=128,
            width=128,
            fps=16.0,
            block_frames=3,
            sink_frames=0,
            window_frames=3,
            family="abot-world",
        ),
        ref_slots=2,
        ref_resolution=64,
        adapter_downscale=16,
        rope_limit=20,
    ),
    "5b": ABotConfig(
        WanCausalConfig(
            name="abot-5b",
            num_layers=30,
            num_heads=24,
            head_dim=128,
            ffn_dim=14336,
            text_dim=4096,
            freq_dim=256,
            latent_channels=48,
            text_len=512,
            vae_base_dim=160,
            vae_decoder_base_dim=256,
            vae_residual=True,
            vae_patch=2,
            vae_latents_mean=WAN22_LATENTS_MEAN,
            vae_latents_std=WAN22_LATENTS_STD,
            height=704,
            width=1280,
            fps=16.0,
            block_frames=3,
            sink_frames=0,
            window_frames=18,
            family="abot-world",
        ),
    ),
}


def get_config(name: str) -> ABotConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown abot-world config {name!r}; known: {sorted(CONFIGS)}.") from None
