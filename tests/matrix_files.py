"""Tiny Matrix-Game 2.0 downloads in each published layout, written for tests (random weights).

Names and shapes are written here, not taken from the loaders: the transformer's original names
(Matrix-Game-2 ``wan/modules/causal_model.py`` and ``action_module.py``; Skywork saves them under
``model.``), its Diffusers names (via ``matrix_reference.original_name``'s table, inverted), Wan's
OpenCLIP names (``wan/modules/clip.py``: ``visual.*``, with a text tower the loader must ignore)
and the transformers ``CLIPVisionModel`` names under ``vision_model.`` as a saved ``image_encoder/``
folder holds them; the folder layouts of Skywork/Matrix-Game-2.0 (``base_distilled_model/``,
``gta_distilled_model/``, ``templerun_distilled_model/`` each with its ``config.json``,
``Wan2.1_VAE.pth``, the OpenCLIP file) and of FastVideo's ``Matrix-Game-2.0-*-Distilled-Diffusers``
(``transformer/``, ``vae/``, ``image_encoder/``, ``model_index.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from matrix_reference import original_name
from wan_files import original_block_shapes, tiny_vae, vae_to_original

#: The tiny Matrix-Game: 2 Wan blocks of 2 heads x 16, FFN 64, an action module in block 0 (2 heads x 16,
#: keyboard embedding 8), 4 latent channels, 5 CLIP tokens of width 16 (3 layers of 2 heads, MLP 64, 28 px, patch 14).
TINY = {"dim": 32, "ffn": 64, "layers": 2, "heads": 2, "freq": 16, "channels": 4, "image": 16, "action": (0,)}
CLIP = {"dim": 16, "layers": 3, "heads": 2, "mlp": 64, "image": 28, "patch": 14}
KEYBOARD = {"universal": (4, True), "gta-drive": (2, True), "templerun": (7, False)}
SKYWORK = {
    "universal": ("base_distilled_model", "base_distill.safetensors", 6),
    "gta-drive": ("gta_distilled_model", "gta_keyboard2dim.safetensors", 4),
    "templerun": ("templerun_distilled_model", "templerun_7dim_onlykey.safetensors", 6),
}
FASTVIDEO = {
    "universal": "Matrix-Game-2.0-Base-Distilled-Diffusers",
    "gta-drive": "Matrix-Game-2.0-GTA-Distilled-Diffusers",
    "templerun": "Matrix-Game-2.0-TempleRun-Distilled-Diffusers",
}


def original_shapes(variant: str) -> dict[str, tuple[int, ...]]:
    """The tiny transformer's parameters by the reference's names."""
    d, f, c, image = TINY["dim"], TINY["ffn"], TINY["channels"], TINY["image"]
    keyboard, mouse = KEYBOARD[variant]
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (d, 2 * c + 4, 1, 2, 2),
        "patch_embedding.bias": (d,),
        "time_embedding.0.weight": (d, TINY["freq"]),
        "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d),
        "time_embedding.2.bias": (d,),
        "time_projection.1.weight": (6 * d, d),
        "time_projection.1.bias": (6 * d,),
        "img_emb.proj.0.weight": (image,),
        "img_emb.proj.0.bias": (image,),
        "img_emb.proj.1.weight": (image, image),
        "img_emb.proj.1.bias": (image,),
        "img_emb.proj.3.weight": (d, image),
        "img_emb.proj.3.bias": (d,),
        "img_emb.proj.4.weight": (d,),
        "img_emb.proj.4.bias": (d,),
        "head.modulation": (1, 2, d),
        "head.head.weight": (4 * c, d),
        "head.head.bias": (4 * c,),
    }
    for i in range(TINY["layers"]):
        shapes.update(original_block_shapes(i, d, f))  # the Wan2.1 block the reference's blocks extend
        if i not in TINY["action"]:
            continue
        a = f"blocks.{i}.action_model"
        shapes.update(
            {
                f"{a}.keyboard_embed.0.weight": (8, keyboard),
                f"{a}.keyboard_embed.0.bias": (8,),
                f"{a}.keyboard_embed.2.weight": (8, 8),
                f"{a}.keyboard_embed.2.bias": (8,),
                f"{a}.key_attn_q_norm.weight": (16,),
                f"{a}.key_attn_k_norm.weight": (16,),
                f"{a}.mouse_attn_q.weight": (32, d),
                f"{a}.keyboard_attn_kv.weight": (64, 8 * 12),
                f"{a}.proj_keyboard.weight": (d, 32),
            }
        )
        if mouse:
            shapes.update(
                {
                    f"{a}.mouse_mlp.0.weight": (32, 2 * 12 + d),
                    f"{a}.mouse_mlp.0.bias": (32,),
                    f"{a}.mouse_mlp.2.weight": (32, 32),
                    f"{a}.mouse_mlp.2.bias": (32,),
                    f"{a}.mouse_mlp.3.weight": (32,),
                    f"{a}.mouse_mlp.3.bias": (32,),
                    f"{a}.t_qkv.weight": (96, 32),
                    f"{a}.img_attn_q_norm.weight": (16,),
                    f"{a}.img_attn_k_norm.weight": (16,),
                    f"{a}.proj_mouse.weight": (d, 32),
                }
            )
    return shapes


def random_transformer(variant: str, seed: int = 9) -> dict[str, Tensor]:
    """Original-named random weights (every norm weight random too); modulation tables small."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in original_shapes(variant).items():
        if name.endswith("modulation"):
            out[name] = torch.randn(shape, generator=generator) * 0.1
        elif len(shape) == 1 and ("norm" in name or name.startswith("img_emb.proj.0") or ".mouse_mlp.3." in name):
            out[name] = 1.0 + 0.2 * torch.randn(shape, generator=generator)
        else:
            out[name] = torch.randn(shape, generator=generator) / max(1, shape[-1]) ** 0.5
    return out


def diffusers_names(weights: dict[str, Tensor], *, patch_proj: bool = False) -> dict[str, Tensor]:
    """The same weights under the Diffusers layout's names (``patch_embedding.proj`` as FastVideo may name it)."""
    names = {}
    for name in _diffusers_candidates(weights):
        names[original_name(name)] = name
    out = {}
    for original, tensor in weights.items():
        name = names[original]
        if patch_proj and name.startswith("patch_embedding."):
            name = name.replace("patch_embedding.", "patch_embedding.proj.")
        out[name] = tensor
    return out


def _diffusers_candidates(weights: dict[str, Tensor]) -> list[str]:
    """Every Diffusers-layout name the tiny transformer has (so the inverse of ``original_name`` is a lookup)."""
    top = [
        "scale_shift_table",
        "patch_embedding.weight",
        "patch_embedding.bias",
        "proj_out.weight",
        "proj_out.bias",
        *(f"condition_embedder.time_embedder.linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")),
        *(f"condition_embedder.time_proj.{p}" for p in ("weight", "bias")),
        *(
            f"condition_embedder.image_embedder.{m}.{p}"
            for m in ("norm1", "ff.net.0.proj", "ff.net.2", "norm2")
            for p in ("weight", "bias")
        ),
    ]
    blocks = []
    for i in range(TINY["layers"]):
        blocks.append(f"blocks.{i}.scale_shift_table")
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                blocks += [f"blocks.{i}.{attn}.{proj}.weight", f"blocks.{i}.{attn}.{proj}.bias"]
            blocks += [f"blocks.{i}.{attn}.norm_q.weight", f"blocks.{i}.{attn}.norm_k.weight"]
        blocks += [f"blocks.{i}.norm2.weight", f"blocks.{i}.norm2.bias"]
        blocks += [f"blocks.{i}.ffn.net.{m}.{p}" for m in ("0.proj", "2") for p in ("weight", "bias")]
    actions = [k for k in weights if ".action_model." in k]
    return top + blocks + actions


def tiny_clip(seed: int = 2) -> Any:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=CLIP["dim"],
        intermediate_size=CLIP["mlp"],
        num_hidden_layers=CLIP["layers"],
        num_attention_heads=CLIP["heads"],
        image_size=CLIP["image"],
        patch_size=CLIP["patch"],
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )
    model = CLIPVisionModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def clip_transformers_names(model: Any) -> dict[str, Tensor]:
    """The encoder's weights as a transformers ``image_encoder/`` folder saves them: under ``vision_model.``."""
    return {
        ("vision_model." + k.removeprefix("vision_model.")): v.clone()
        for k, v in model.state_dict().items()
        if not k.endswith("position_ids")
    }


def clip_to_wan(model: Any) -> dict[str, Tensor]:
    """The encoder's weights under Wan's OpenCLIP names (``wan/modules/clip.py``), with a text tower beside."""
    sd = {k.removeprefix("vision_model."): v for k, v in model.state_dict().items()}
    d = CLIP["dim"]
    out = {
        "visual.cls_embedding": sd["embeddings.class_embedding"].view(1, 1, d),
        "visual.pos_embedding": sd["embeddings.position_embedding.weight"][None],
        "visual.patch_embedding.weight": sd["embeddings.patch_embedding.weight"],
        "visual.pre_norm.weight": sd["pre_layrnorm.weight"],
        "visual.pre_norm.bias": sd["pre_layrnorm.bias"],
        "visual.post_norm.weight": sd["post_layernorm.weight"],
        "visual.post_norm.bias": sd["post_layernorm.bias"],
        "visual.head": torch.randn(d, 8),
        "textual.token_embedding.weight": torch.randn(10, 8),
        "log_scale": torch.tensor(4.6),
    }
    for i in range(CLIP["layers"]):
        src, dst = f"encoder.layers.{i}", f"visual.transformer.{i}"
        for p in ("weight", "bias"):
            out[f"{dst}.attn.to_qkv.{p}"] = torch.cat([sd[f"{src}.self_attn.{x}_proj.{p}"] for x in "qkv"])
            out[f"{dst}.attn.proj.{p}"] = sd[f"{src}.self_attn.out_proj.{p}"]
            out[f"{dst}.norm1.{p}"] = sd[f"{src}.layer_norm1.{p}"]
            out[f"{dst}.norm2.{p}"] = sd[f"{src}.layer_norm2.{p}"]
            out[f"{dst}.mlp.0.{p}"] = sd[f"{src}.mlp.fc1.{p}"]
            out[f"{dst}.mlp.2.{p}"] = sd[f"{src}.mlp.fc2.{p}"]
    return {k: v.clone() for k, v in out.items()}


def skywork_download(root: Path, variants: tuple[str, ...] = ("universal", "gta-drive", "templerun")) -> dict[str, Any]:
    """Skywork/Matrix-Game-2.0 as downloaded: one folder per distilled variant, the VAE and OpenCLIP file."""
    from safetensors.torch import save_file

    from worldserve.models.wan.config import get_config

    weights = {}
    for index, variant in enumerate(variants):
        folder, file, local = SKYWORK[variant]
        (root / folder).mkdir(parents=True)
        weights[variant] = random_transformer(variant, seed=20 + index)
        save_file({f"model.{k}": v for k, v in weights[variant].items()}, str(root / folder / file))
        config = {"_class_name": "CausalWanModel", "dim": TINY["dim"], "local_attn_size": local, "sink_size": 0}
        (root / folder / "config.json").write_text(json.dumps(config))
    wan = get_config("tiny")
    vae = tiny_vae(wan)
    torch.save(vae_to_original(vae, wan), root / "Wan2.1_VAE.pth")
    clip = tiny_clip()
    torch.save(clip_to_wan(clip), root / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
    (root / "xlm-roberta-large").mkdir()
    return {"weights": weights, "vae": vae, "clip": clip}


def fastvideo_download(root: Path, variant: str, weights: dict[str, Tensor], vae: Any, clip: Any) -> Path:
    """A FastVideo ``Matrix-Game-2.0-*-Distilled-Diffusers`` folder holding the same weights."""
    from safetensors.torch import save_file

    folder = root / FASTVIDEO[variant]
    (folder / "transformer").mkdir(parents=True)
    save_file(
        diffusers_names(weights, patch_proj=True), str(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    )
    local = SKYWORK[variant][2]
    config = {"_class_name": "CausalMatrixGameWanModel", "hidden_size": TINY["dim"], "local_attn_size": local}
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    vae.save_pretrained(folder / "vae")
    (folder / "image_encoder").mkdir()
    save_file(clip_transformers_names(clip), str(folder / "image_encoder" / "model.safetensors"))
    (folder / "image_encoder" / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "MatrixGameCausalDMDPipeline"}))
    return folder


#: The Diffusers names -> FastVideo's own module names (its ``param_names_mapping``'s targets), written here.
FASTVIDEO_INTERNAL = (
    ("patch_embedding.", "patch_embedding.proj."),
    ("condition_embedder.time_embedder.linear_1.", "condition_embedder.time_embedder.mlp.fc_in."),
    ("condition_embedder.time_embedder.linear_2.", "condition_embedder.time_embedder.mlp.fc_out."),
    ("condition_embedder.time_proj.", "condition_embedder.time_modulation.linear."),
    ("condition_embedder.image_embedder.ff.net.0.proj.", "condition_embedder.image_embedder.ff.fc_in."),
    ("condition_embedder.image_embedder.ff.net.2.", "condition_embedder.image_embedder.ff.fc_out."),
)
BLOCK_INTERNAL = (
    ("attn1.to_out.0.", "to_out."),
    ("attn1.to_", "to_"),
    ("attn1.norm_", "norm_"),
    ("attn2.to_out.0.", "attn2.to_out."),
    ("ffn.net.0.proj.", "ffn.fc_in."),
    ("ffn.net.2.", "ffn.fc_out."),
    ("norm2.", "self_attn_residual_norm.norm."),
)


def fastvideo_internal_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The weights under FastVideo's own module names (what its local converter writes)."""
    out = {}
    for name, tensor in diffusers_names(weights).items():
        if name.startswith("blocks.") and ".action_model." not in name:
            head, index, rest = name.split(".", 2)
            for old, new in BLOCK_INTERNAL:
                if rest.startswith(old):
                    rest = new + rest[len(old) :]
                    break
            name = f"{head}.{index}.{rest}"
        else:
            for old, new in FASTVIDEO_INTERNAL:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
        out[name] = tensor
    return out
