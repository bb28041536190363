"""Matrix-Game 2.0's transformer as published -> the model; the variant and size read from its shapes.

Owns: :func:`original_layout` (every parameter of the reference's ``CausalWanModel`` by its
original name: ``patch_embedding``, ``time_embedding.0/2``, ``time_projection.1``,
``img_emb.proj.0/1/3/4``, ``blocks.N.self_attn.*``, ``blocks.N.cross_attn.*``, ``blocks.N.norm3``,
``blocks.N.ffn.0/2``, ``blocks.N.modulation``, ``blocks.N.action_model.*``, ``head.head``,
``head.modulation``; Skywork saves it with a ``model.`` prefix), :func:`read_matrix_transformer`
(a checkpoint -> the shared :class:`~worldserve.models.wan.checkpoint.TransformerState`: in the
original layout converted key by key by
diffusers' own ``convert_wan_transformer_to_diffusers``, which maps ``img_emb`` to the image
embedder and leaves ``action_model`` as it is; or in the Diffusers layout of FastVideo's folders,
:func:`model_key` also taking ``patch_embedding.proj`` and FastVideo's own module names, ``to_q``,
``ffn.fc_in``, ``time_modulation``, ...), :func:`shape_facts` and :func:`detect` (the variant
from the keyboard's width and whether there is a mouse branch: 4 + mouse universal, 2 + mouse GTA,
7 without Temple Run; the size from the width; the blocks that carry action modules; the context
from the ``local_attn_size`` of a ``config.json`` beside the weights), and :func:`load_published`
(``weights=DIR`` / ``checkpoint=`` ... -> a :class:`LoadedMatrix`, every part loaded strictly;
errors name the part, the file, the user's key and both shapes: :func:`loading`). Must not know:
sessions, the sampler, caches.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from worldserve.models.matrixgame.clipweights import load_image_encoder_weights
from worldserve.models.matrixgame.config import (
    SIZES,
    VARIANTS,
    MatrixGameConfig,
    Variant,
    get_variant,
    matrix_config,
)
from worldserve.models.matrixgame.files import PART_NAMES, PUBLISHED, MatrixParts, expected, find_matrix_parts
from worldserve.models.matrixgame.weights import LoadedMatrix, MatrixWeightOptions, build_random
from worldserve.models.wan.checkpoint import (
    TransformerState,
    config_beside,
    load_renamed,
    transformer_state,
)
from worldserve.models.wan.checkpoint import original_layout as wan_layout
from worldserve.models.wan.statedict import WeightsError, part_errors, read_tensors, weights_digest
from worldserve.models.wan.vaeweights import load_vae_weights

__all__ = [
    "ShapeFacts",
    "detect",
    "load_parts",
    "load_published",
    "loading",
    "model_key",
    "original_layout",
    "read_matrix_transformer",
    "shape_facts",
]

_BLOCK = re.compile(r"blocks\.(\d+)\.")
#: FastVideo's own module names (what its ``param_names_mapping`` turns the Diffusers names into, and what
#: its local converter writes) -> the Diffusers layout's.
_FASTVIDEO_NAMES = (
    (re.compile(r"^patch_embedding\.proj\."), "patch_embedding."),
    (re.compile(r"^condition_embedder\.time_embedder\.mlp\.fc_in\."), "condition_embedder.time_embedder.linear_1."),
    (re.compile(r"^condition_embedder\.time_embedder\.mlp\.fc_out\."), "condition_embedder.time_embedder.linear_2."),
    (re.compile(r"^condition_embedder\.time_modulation\.linear\."), "condition_embedder.time_proj."),
    (
        re.compile(r"^condition_embedder\.image_embedder\.ff\.fc_in\."),
        "condition_embedder.image_embedder.ff.net.0.proj.",
    ),
    (re.compile(r"^condition_embedder\.image_embedder\.ff\.fc_out\."), "condition_embedder.image_embedder.ff.net.2."),
    (re.compile(r"^(blocks\.\d+)\.to_(q|k|v)\."), r"\1.attn1.to_\2."),
    (re.compile(r"^(blocks\.\d+)\.to_out\."), r"\1.attn1.to_out.0."),
    (re.compile(r"^(blocks\.\d+)\.norm_(q|k)\."), r"\1.attn1.norm_\2."),
    (re.compile(r"^(blocks\.\d+)\.attn2\.to_out\.(?!0\.)"), r"\1.attn2.to_out.0."),
    (re.compile(r"^(blocks\.\d+)\.ffn\.fc_in\."), r"\1.ffn.net.0.proj."),
    (re.compile(r"^(blocks\.\d+)\.ffn\.fc_out\."), r"\1.ffn.net.2."),
    (re.compile(r"^(blocks\.\d+)\.self_attn_residual_norm\.norm\."), r"\1.norm2."),
)
_KEYBOARD = re.compile(r"blocks\.(\d+)\.action_model\.keyboard_embed\.0\.weight")


def original_layout(config: MatrixGameConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the reference's ``CausalWanModel`` of ``config`` by its original name."""
    wan, a = config.wan, config.action
    d, image = wan.dim, config.clip.dim
    shapes = wan_layout(wan, in_channels=config.in_channels, text=False)
    shapes.update({
        "img_emb.proj.0.weight": (image,),
        "img_emb.proj.0.bias": (image,),
        "img_emb.proj.1.weight": (image, image),
        "img_emb.proj.1.bias": (image,),
        "img_emb.proj.3.weight": (d, image),
        "img_emb.proj.3.bias": (d,),
        "img_emb.proj.4.weight": (d,),
        "img_emb.proj.4.bias": (d,),
    })  # fmt: skip
    span = a.window_frames
    for i in a.layers:  # the blocks with an action module
        p = f"blocks.{i}.action_model."
        e, k, head = a.keyboard_embed_dim, a.keyboard_hidden, a.head_dim
        shapes[p + "keyboard_embed.0.weight"] = (e, a.keyboard_dim)
        shapes[p + "keyboard_embed.0.bias"] = (e,)
        shapes[p + "keyboard_embed.2.weight"] = (e, e)
        shapes[p + "keyboard_embed.2.bias"] = (e,)
        if a.mouse:
            m = a.mouse_hidden
            shapes[p + "mouse_mlp.0.weight"] = (m, a.mouse_dim * span + d)
            shapes[p + "mouse_mlp.0.bias"] = (m,)
            shapes[p + "mouse_mlp.2.weight"] = (m, m)
            shapes[p + "mouse_mlp.2.bias"] = (m,)
            shapes[p + "mouse_mlp.3.weight"] = (m,)
            shapes[p + "mouse_mlp.3.bias"] = (m,)
            shapes[p + "t_qkv.weight"] = (3 * m, m)
            shapes[p + "img_attn_q_norm.weight"] = (head,)
            shapes[p + "img_attn_k_norm.weight"] = (head,)
            shapes[p + "proj_mouse.weight"] = (d, m)
        shapes[p + "key_attn_q_norm.weight"] = (head,)
        shapes[p + "key_attn_k_norm.weight"] = (head,)
        shapes[p + "mouse_attn_q.weight"] = (k, d)
        shapes[p + "keyboard_attn_kv.weight"] = (2 * k, e * span)
        shapes[p + "proj_keyboard.weight"] = (d, k)
    return shapes


def read_matrix_transformer(path: str | Path) -> TransformerState:
    """A transformer checkpoint file (``model.``-prefixed or not), or a Diffusers ``transformer/`` folder."""
    path = Path(path)
    state = transformer_state(read_tensors(path), str(path), model_key=model_key)
    state.file_config = config_beside(path, file_too=True)  # the reference's distilled_model/*/config.json
    return state


def model_key(key: str) -> str:
    """A Diffusers-layout key as the model names it: FastVideo's own names (``to_q``, ``ffn.fc_in``,
    ``patch_embedding.proj``, ...) mapped back; the Diffusers names as they are."""
    for pattern, replacement in _FASTVIDEO_NAMES:
        if pattern.search(key):
            return pattern.sub(replacement, key, count=1)
    return key


@dataclass(frozen=True, slots=True)
class ShapeFacts:
    """What a transformer's shapes say (names in the Diffusers layout)."""

    dim: int
    in_channels: int
    layers: int
    keyboard_dim: int | None
    mouse: bool
    action_layers: tuple[int, ...]
    #: The key the keyboard width was read from, as the user's file names it.
    keyboard_key: str | None


def shape_facts(shapes: Mapping[str, tuple[int, ...]], user_name: Mapping[str, str] | None = None) -> ShapeFacts:
    """Width, input channels, layers, the keyboard's width, the mouse branch and the action blocks."""
    names = user_name or {}
    patch = shapes.get("patch_embedding.weight")
    if patch is None or len(patch) != 5:
        raise WeightsError(
            "not a Matrix-Game 2.0 transformer: no patch_embedding.weight of 5 dimensions "
            f"(keys start: {sorted(names.get(k, k) for k in shapes)[:6]})"
        )
    keyboard = sorted((int(m.group(1)), k) for k in shapes if (m := _KEYBOARD.fullmatch(k)))
    action_layers = tuple(sorted({int(m.group(1)) for k in shapes if ".action_model." in k and (m := _BLOCK.match(k))}))
    return ShapeFacts(
        dim=int(patch[0]),
        in_channels=int(patch[1]),
        layers=len({int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))}),
        keyboard_dim=int(shapes[keyboard[0][1]][1]) if keyboard else None,
        mouse=any(".action_model.t_qkv." in k or ".action_model.mouse_mlp." in k for k in shapes),
        action_layers=action_layers,
        keyboard_key=names.get(keyboard[0][1], keyboard[0][1]) if keyboard else None,
    )


def variant_of(facts: ShapeFacts, where: str) -> Variant:
    """The released variant these shapes are (keyboard width 4/2/7, mouse or not), else an error saying so."""
    for variant in VARIANTS.values():
        if variant.keyboard_dim == facts.keyboard_dim and variant.mouse == facts.mouse:
            return variant
    released = "; ".join(
        f"{v.name}: keyboard {v.keyboard_dim}{' + mouse' if v.mouse else ', no mouse'}" for v in VARIANTS.values()
    )
    if facts.keyboard_dim is None:
        found = "no action modules (no blocks.N.action_model.keyboard_embed.0.weight)"
    else:
        found = (
            f"keyboard width {facts.keyboard_dim} ({facts.keyboard_key}){' + mouse' if facts.mouse else ', no mouse'}"
        )
    raise WeightsError(
        f"a Matrix-Game 2.0 transformer with {found} is none of the released variants ({released})", path=where
    )


def detect(
    state: TransformerState, asked_variant: str | None, asked_size: str | None, window: int | None
) -> MatrixGameConfig:
    """The configuration the checkpoint's shapes name (size, variant, action blocks; context from its config.json)."""
    shapes = {k: tuple(v.shape) for k, v in state.tensors.items()}
    facts = shape_facts(shapes, state.user_names)
    variant = variant_of(facts, state.source)
    if asked_variant is not None and get_variant(asked_variant).name != variant.name:
        raise WeightsError(
            f"variant={asked_variant} was asked for, but the checkpoint's shapes are the "
            f"{variant.name} variant's (keyboard width {facts.keyboard_dim}, {facts.keyboard_key}; "
            f"{'a' if facts.mouse else 'no'} mouse branch)",
            path=state.source,
        )
    sizes = [name for name, (wan, _, _) in SIZES.items() if wan.dim == facts.dim]
    size = asked_size or (sizes[0] if sizes else None)
    if size is None:
        known = ", ".join(f"{name}: dim {wan.dim}" for name, (wan, _, _) in SIZES.items())
        raise WeightsError(f"a transformer of width {facts.dim} matches no known config ({known})", path=state.source)
    local = state.file_config.get("local_attn_size") if state.file_config else None
    if window is None and isinstance(local, int) and local > 3:
        window = local - 3  # the file's context: local_attn_size frames, the block's own 3 included
    config = matrix_config(size, variant, window=window)
    if facts.action_layers and facts.action_layers != config.action.layers:
        config = replace(config, action=replace(config.action, layers=facts.action_layers))
    return config


def loading(part: str, path: Path) -> AbstractContextManager[None]:
    """Errors inside name ``part`` (``transformer``, ``vae``, ``image_encoder``), its file ``path`` and what
    matrix-game-2 expects there."""
    return part_errors(PART_NAMES[part], path, expected(part))


def _resolve(options: MatrixWeightOptions) -> MatrixParts:
    parts = find_matrix_parts(options.weights, options.variant) if options.weights is not None else MatrixParts()
    for part in ("checkpoint", "vae", "image_encoder"):
        value = getattr(options, part)
        if value is None or value == "random":
            continue
        setattr(parts, "transformer" if part == "checkpoint" else part, Path(value))
    if options.vae == "random":
        parts.vae = None
    if options.image_encoder == "random":
        parts.image_encoder = None
    if parts.transformer is None:
        names = ", ".join(name for name, (part, _) in PUBLISHED.items() if part == "transformer")
        raise WeightsError(
            f"weights={options.weights}: no Matrix-Game 2.0 transformer under it by a published name ({names}); "
            "pass checkpoint=PATH."
        )
    return parts


def load_published(options: MatrixWeightOptions, device: torch.device, seed: int) -> LoadedMatrix:
    """The published parts (``weights=DIR`` and/or per-part paths), built and loaded strictly."""
    parts = _resolve(options)
    assert parts.transformer is not None
    with loading("transformer", parts.transformer):
        state = read_matrix_transformer(parts.transformer)
        config = detect(state, options.variant, options.config, options.window)
    variant = get_variant(config.variant)
    if parts.vae is None and options.vae != "random":
        raise WeightsError(
            f"{parts.transformer}: a trained checkpoint needs its VAE: vae=PATH (Wan2.1_VAE.pth, or a Diffusers vae/ "
            "folder), or weights=DIR holding it; vae=random decodes with random weights instead."
        )
    if parts.image_encoder is None and options.image_encoder != "random":
        raise WeightsError(
            f"{parts.transformer}: a trained checkpoint needs its image encoder: image_encoder=PATH "
            "(models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth, or a Diffusers image_encoder/ folder), or "
            "weights=DIR holding it; image_encoder=random runs it on random image features instead."
        )
    transformer, vae, encoder = build_random(config, device, seed)
    with loading("transformer", parts.transformer):
        load_renamed(  # a key the file lacks is named as the reference names it
            transformer,
            state.tensors,
            state.user_names,
            original=original_layout(config) if state.layout == "original" else None,
            where=state.source,
            part=f"the file ({state.layout} layout, config {config.name}, {variant.name})",
        )
    loaded = LoadedMatrix(
        config=config,
        variant=variant,
        transformer=transformer,
        vae=vae,
        image_encoder=encoder,
        dummy=False,
        version=f"{config.name}:{variant.name}:sha256:{weights_digest(parts.transformer)}",
        sources={"transformer": parts.transformer},
        layouts={"transformer": state.layout},
    )
    given = {p: path for p in ("vae", "image_encoder") if (path := getattr(parts, p)) is not None}
    load_parts(loaded, given)
    return loaded


def load_parts(loaded: LoadedMatrix, given: Mapping[str, Path]) -> None:
    """Load the VAE and image encoder files ``given`` (part -> path) into ``loaded``'s modules, strictly."""
    config = loaded.config
    for part, path in given.items():
        with loading(part, path):
            if part == "vae":
                loaded.layouts[part] = load_vae_weights(path, loaded.vae, config.wan)
            else:
                loaded.layouts[part] = load_image_encoder_weights(path, loaded.image_encoder, config.name)
        loaded.sources[part] = path
