"""Tiny weight files in each layout the Wan2.1 family publishes, written for tests (random weights).

Names are written here, not taken from the loaders: the transformer's original names
(``wan/modules/model.py``), Wan's T5 names (``wan/modules/t5.py``, mapped from transformers'
``UMT5EncoderModel``), and the folder layouts of the authors' downloads (Self-Forcing's
``checkpoints/self_forcing_dmd.pt`` + ``wan_models/Wan2.1-T2V-1.3B/``; a Diffusers snapshot's
``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One compute thread: these shapes are tiny, and on a shared small machine more threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def draw_noise(generators: list[torch.Generator], shape: tuple[int, ...], device: torch.device) -> Tensor:
    """One standard-normal draw of ``shape`` per generator, stacked ``[B, *shape]`` (hand-driven rollouts)."""
    return torch.stack([torch.randn(shape, generator=g, device=device) for g in generators])


WORDS = ["snowy", "peaks", "desert", "dunes", "islands", "a", "cat", "city", "night"]


def original_transformer_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """A Wan2.1 transformer's original parameter names and shapes (as Self-Forcing/CausVid save them)."""
    d, f, c = config.dim, config.ffn_dim, config.latent_channels
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (d, c, 1, 2, 2),
        "patch_embedding.bias": (d,),
        "text_embedding.0.weight": (d, config.text_dim),
        "text_embedding.0.bias": (d,),
        "text_embedding.2.weight": (d, d),
        "text_embedding.2.bias": (d,),
        "time_embedding.0.weight": (d, config.freq_dim),
        "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d),
        "time_embedding.2.bias": (d,),
        "time_projection.1.weight": (6 * d, d),
        "time_projection.1.bias": (6 * d,),
        "head.modulation": (1, 2, d),
        "head.head.weight": (4 * c, d),
        "head.head.bias": (4 * c,),
    }
    for i in range(config.num_layers):
        shapes.update(original_block_shapes(i, d, f))
    return shapes


def original_block_shapes(i: int, d: int, f: int) -> dict[str, tuple[int, ...]]:
    """Block ``i`` of a Wan2.1 transformer (width ``d``, FFN ``f``) by its original names (``wan/modules/model.py``)."""
    shapes: dict[str, tuple[int, ...]] = {f"blocks.{i}.modulation": (1, 6, d)}
    for attn in ("self_attn", "cross_attn"):
        for proj in "qkvo":
            shapes[f"blocks.{i}.{attn}.{proj}.weight"] = (d, d)
            shapes[f"blocks.{i}.{attn}.{proj}.bias"] = (d,)
        shapes[f"blocks.{i}.{attn}.norm_q.weight"] = (d,)
        shapes[f"blocks.{i}.{attn}.norm_k.weight"] = (d,)
    shapes[f"blocks.{i}.norm3.weight"] = (d,)
    shapes[f"blocks.{i}.norm3.bias"] = (d,)
    shapes[f"blocks.{i}.ffn.0.weight"] = (f, d)
    shapes[f"blocks.{i}.ffn.0.bias"] = (f,)
    shapes[f"blocks.{i}.ffn.2.weight"] = (d, f)
    shapes[f"blocks.{i}.ffn.2.bias"] = (d,)
    return shapes


def random_transformer(config: Any, seed: int = 9) -> dict[str, Tensor]:
    """Original-named random weights; modulation tables small so the forward stays well scaled."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in original_transformer_shapes(config).items():
        scale = 0.1 if name.endswith("modulation") else 1.0 / max(1, shape[-1]) ** 0.5
        out[name] = torch.randn(shape, generator=generator) * scale
    return out


def save_self_forcing(path: Path, weights: dict[str, Tensor]) -> None:
    """Self-Forcing's layout: ``{"generator": ..., "generator_ema": ...}``, keys under ``model.``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "generator": {f"model.{k}": v * 0.5 for k, v in weights.items()},
            "generator_ema": {f"model.{k}": v for k, v in weights.items()},
        },
        path,
    )


def tokenizer_folder(path: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def tiny_umt5(text_dim: int, seed: int = 0) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=len(WORDS) + 3, d_model=text_dim, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0
    )
    return UMT5EncoderModel(config).eval()


def umt5_to_wan(encoder: Any) -> dict[str, Tensor]:
    """A transformers UMT5 encoder's weights under Wan's T5 names (``models_t5_umt5-xxl-enc-bf16.pth``)."""
    sd = encoder.state_dict()
    out = {"token_embedding.weight": sd["shared.weight"], "norm.weight": sd["encoder.final_layer_norm.weight"]}
    for i in range(encoder.config.num_layers):
        a = f"encoder.block.{i}.layer.0"
        m = f"encoder.block.{i}.layer.1"
        out[f"blocks.{i}.norm1.weight"] = sd[f"{a}.layer_norm.weight"]
        for proj in "qkvo":
            out[f"blocks.{i}.attn.{proj}.weight"] = sd[f"{a}.SelfAttention.{proj}.weight"]
        out[f"blocks.{i}.pos_embedding.embedding.weight"] = sd[f"{a}.SelfAttention.relative_attention_bias.weight"]
        out[f"blocks.{i}.norm2.weight"] = sd[f"{m}.layer_norm.weight"]
        out[f"blocks.{i}.ffn.gate.0.weight"] = sd[f"{m}.DenseReluDense.wi_0.weight"]  # the GELU branch
        out[f"blocks.{i}.ffn.fc1.weight"] = sd[f"{m}.DenseReluDense.wi_1.weight"]  # the linear branch
        out[f"blocks.{i}.ffn.fc2.weight"] = sd[f"{m}.DenseReluDense.wo.weight"]
    return {k: v.clone() for k, v in out.items()}


def tiny_vae(config: Any, seed: int = 3) -> Any:
    from worldserve.models.wan.build import build_vae

    torch.manual_seed(seed)
    vae = build_vae(config).eval()
    with torch.no_grad():  # diffusers zero-initialises some convolutions: make every weight count
        for parameter in vae.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return vae


def vae_to_original(vae: Any, config: Any) -> dict[str, Tensor]:
    """A diffusers VAE's weights under Wan's original names (the layout of ``Wan2.1_VAE.pth``)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from worldserve.models.wan.vaeweights import original_vae_layout

    sd = vae.state_dict()
    out = {}
    for original in original_vae_layout(config):
        (name,) = convert_wan_vae_to_diffusers({original: None})
        out[original] = sd[name].clone()
    assert len(out) == len(sd)
    return out


def self_forcing_download(root: Path, config: Any, *, with_text: bool = True) -> dict[str, Any]:
    """A Self-Forcing user's folder: ``checkpoints/self_forcing_dmd.pt`` and ``wan_models/Wan2.1-T2V-1.3B/``.

    The Wan folder also holds the base transformer (original layout, safetensors) and its config.json,
    as Wan-AI/Wan2.1-T2V-1.3B does.
    """
    from safetensors.torch import save_file

    weights = random_transformer(config)
    save_self_forcing(root / "checkpoints" / "self_forcing_dmd.pt", weights)
    wan = root / "wan_models" / "Wan2.1-T2V-1.3B"
    wan.mkdir(parents=True)
    base = random_transformer(config, seed=99)
    save_file(base, str(wan / "diffusion_pytorch_model.safetensors"))
    wan_config = {"_class_name": "WanModel", "dim": config.dim, "num_heads": config.num_heads}
    (wan / "config.json").write_text(json.dumps(wan_config))
    vae = tiny_vae(config)
    torch.save(vae_to_original(vae, config), wan / "Wan2.1_VAE.pth")
    out: dict[str, Any] = {"weights": weights, "vae": vae, "base": base}
    if with_text:
        encoder = tiny_umt5(config.text_dim)
        torch.save(umt5_to_wan(encoder), wan / "models_t5_umt5-xxl-enc-bf16.pth")
        out["encoder"] = encoder
        out["tokenizer"] = tokenizer_folder(wan / "google" / "umt5-xxl")
    return out


def diffusers_snapshot(root: Path, config: Any) -> dict[str, Any]:
    """A Diffusers snapshot (as Wan-AI/Wan2.1-T2V-1.3B-Diffusers): transformer/, vae/, text_encoder/, tokenizer/."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(5)
    transformer = WanTransformer3DModel(
        patch_size=config.patch,
        num_attention_heads=config.num_heads,
        attention_head_dim=config.head_dim,
        in_channels=config.latent_channels,
        out_channels=config.latent_channels,
        text_dim=config.text_dim,
        freq_dim=config.freq_dim,
        ffn_dim=config.ffn_dim,
        num_layers=config.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=config.eps,
    ).eval()
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if "scale_shift_table" not in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    transformer.save_pretrained(root / "transformer")
    vae = tiny_vae(config)
    vae.save_pretrained(root / "vae")
    encoder = tiny_umt5(config.text_dim, seed=1)
    encoder.save_pretrained(root / "text_encoder")
    tokenizer = tokenizer_folder(root / "tokenizer")
    (root / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    return {"transformer": transformer, "vae": vae, "encoder": encoder, "tokenizer": tokenizer}
