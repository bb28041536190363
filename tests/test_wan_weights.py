"""wan-causal loads the files the Wan2.1 family publishes, as published (tiny config, CPU, random weights).

Every layout is written by the test (``wan_files``) in the authors' names: the original
transformer keys (Self-Forcing's torch file, flat safetensors), a Diffusers snapshot, Wan's
``Wan2.1_VAE.pth`` and ``models_t5_umt5-xxl-enc-bf16.pth`` layouts with a tokenizer folder.
Each loads key by key, and computes what the authors' model computes: the transformer against
an independent reference of Wan's forward on the original names, the VAE against the diffusers
model it was made from, the text encoder against Wan's T5 forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import wan_files  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from wan_reference import wan_t5_forward, wan_transformer_forward  # noqa: E402
from worldserve.models import load_model  # noqa: E402
from worldserve.models.wan.config import CONFIGS, get_config  # noqa: E402
from worldserve.models.wan.statedict import WeightsError  # noqa: E402

TOL = 1e-5
TINY = get_config("tiny")


def _block(config: object, seed: int = 0) -> tuple[object, object, object]:
    generator = torch.Generator().manual_seed(seed)
    c = config
    x = torch.randn(1, c.latent_channels, c.block_frames, c.latent_height, c.latent_width, generator=generator)
    t = torch.tensor([700.0])
    context = torch.randn(1, c.text_len, c.text_dim, generator=generator)
    return x, t, context


def _library_forward(model: object, x: object, t: object, context: object) -> object:
    """The loaded diffusers transformer's own dense forward over one block (full attention inside a block)."""
    transformer = model.forward.transformer
    frames = x.shape[2]
    with torch.no_grad():
        return transformer(x, t.expand(1, frames), context, enable_diffusion_forcing=True, return_dict=False)[0]


def test_the_layouts_the_loaders_know_are_the_published_ones() -> None:
    from worldserve.models.wan.build import build_transformer, build_vae
    from worldserve.models.wan.checkpoint import original_layout
    from worldserve.models.wan.vaeweights import original_vae_layout

    for name in ("tiny", "1.3b", "14b"):
        config = CONFIGS[name]
        assert original_layout(config) == wan_files.original_transformer_shapes(config)
        with torch.device("meta"):
            transformer, vae = build_transformer(config), build_vae(config)
        assert len(original_layout(config)) == len(transformer.state_dict())
        assert len(original_vae_layout(config)) == len(vae.state_dict()) == 194  # Wan2.1_VAE.pth has 194 keys
    counts = {n: sum(torch.Size(s).numel() for s in original_layout(CONFIGS[n]).values()) for n in ("1.3b", "14b")}
    assert counts == {"1.3b": 1_418_996_800, "14b": 14_288_491_584}  # Wan2.1-T2V-1.3B and -14B as released


def test_a_self_forcing_download_loads_by_published_names_and_computes_wans_forward(tmp_path: Path) -> None:
    made = wan_files.self_forcing_download(tmp_path, TINY)
    model = load_model("wan-causal", weights=str(tmp_path), threads=1)
    parts = model.weights.parts
    assert parts.transformer == tmp_path / "checkpoints" / "self_forcing_dmd.pt"  # not the base Wan transformer
    assert parts.vae.name == "Wan2.1_VAE.pth"
    assert parts.text_encoder.name == "models_t5_umt5-xxl-enc-bf16.pth"
    assert parts.tokenizer == tmp_path / "wan_models" / "Wan2.1-T2V-1.3B" / "google" / "umt5-xxl"
    assert model.config.name == "tiny"  # named by the checkpoint's shapes
    assert "text: UMT5" in model.spec.description
    assert "VAE: random" not in model.spec.description
    # Key by key: every original key landed on its parameter (the EMA weights, Self-Forcing's --use_ema).
    params = dict(model.forward.transformer.named_parameters())
    weights = made["weights"]
    assert len(params) == len(weights)
    assert torch.equal(params["blocks.1.norm2.weight"], weights["blocks.1.norm3.weight"])
    assert torch.equal(params["blocks.0.ffn.net.0.proj.weight"], weights["blocks.0.ffn.0.weight"])
    assert torch.equal(params["scale_shift_table"], weights["head.modulation"])
    # Forward: the loaded model computes what Wan's own forward computes on the original names.
    x, t, context = _block(TINY)
    reference = wan_transformer_forward(weights, TINY.num_heads, x, t, context)
    assert (reference - _library_forward(model, x, t, context)).abs().max().item() <= TOL
    plain = load_model("wan-causal", weights=str(tmp_path), ema=0, threads=1)  # LongLive's use_ema: false
    assert torch.equal(
        dict(plain.forward.transformer.named_parameters())["patch_embedding.weight"],
        weights["patch_embedding.weight"] * 0.5,
    )
    base = load_model("wan-causal", weights=str(tmp_path), family="wan", threads=1)
    assert base.weights.parts.transformer == tmp_path / "wan_models" / "Wan2.1-T2V-1.3B"
    assert torch.equal(
        dict(base.forward.transformer.named_parameters())["patch_embedding.weight"],
        made["base"]["patch_embedding.weight"],
    )


def test_the_vae_in_wans_original_layout_decodes_as_the_diffusers_model_it_was_made_from(tmp_path: Path) -> None:
    from worldserve.models.wan.build import build_vae
    from worldserve.models.wan.vaeweights import load_vae_weights

    vae = wan_files.tiny_vae(TINY)
    original = wan_files.vae_to_original(vae, TINY)
    torch.save(original, tmp_path / "Wan2.1_VAE.pth")
    loaded = build_vae(TINY).eval()
    assert load_vae_weights(tmp_path / "Wan2.1_VAE.pth", loaded, TINY) == "original"
    for name, tensor in vae.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    latents = torch.randn(1, TINY.latent_channels, 3, TINY.latent_height, TINY.latent_width)
    with torch.no_grad():
        assert (loaded.decode(latents).sample - vae.decode(latents).sample).abs().max().item() <= TOL
    vae.save_pretrained(tmp_path / "vae")  # a Diffusers vae/ folder
    folder = build_vae(TINY).eval()
    assert load_vae_weights(tmp_path / "vae", folder, TINY) == "diffusers"
    with torch.no_grad():
        assert (folder.decode(latents).sample - vae.decode(latents).sample).abs().max().item() <= TOL
    # The user's own key, the file and the shapes in every error.
    del original["decoder.head.0.gamma"]
    torch.save(original, tmp_path / "broken.pth")
    with pytest.raises(
        WeightsError,
        match=r"broken.pth: the file \(original layout\) has 193 keys.*"
        r"missing \(1\): decoder.head.0.gamma \(8, 1, 1, 1\)",
    ):
        load_vae_weights(tmp_path / "broken.pth", build_vae(TINY), TINY)


def test_the_text_encoder_loads_from_wans_pth_and_from_a_diffusers_pair(tmp_path: Path) -> None:
    from worldserve.models.wan.t5 import load_text_encoder, load_tokenizer, umt5_names
    from worldserve.models.wan.text import PromptEmbedder

    encoder = wan_files.tiny_umt5(TINY.text_dim)
    wan_names = wan_files.umt5_to_wan(encoder)
    torch.save(wan_names, tmp_path / "models_t5_umt5-xxl-enc-bf16.pth")
    tokenizer = wan_files.tokenizer_folder(tmp_path / "tokenizer")
    loaded = load_text_encoder(tmp_path / "models_t5_umt5-xxl-enc-bf16.pth", torch.float32)
    hf = loaded.state_dict()
    for original, name in umt5_names(2).items():  # key by key
        assert torch.equal(hf[name], wan_names[original]), original
    ids = torch.tensor([[3, 4, 5, 1, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]])
    with torch.no_grad():
        got = loaded(ids, mask).last_hidden_state
        reference = wan_t5_forward(wan_names, ids, mask)  # Wan's own T5 forward on its own names
        library = encoder(ids, mask).last_hidden_state
    assert (got - reference)[mask.bool()].abs().max().item() <= TOL
    assert (got - library).abs().max().item() <= TOL
    embedder = PromptEmbedder(
        TINY.text_len, TINY.text_dim, torch.device("cpu"), torch.float32, loaded, load_tokenizer(tmp_path / "tokenizer")
    )
    embedding = embedder(["  snowy   peaks &amp; desert "])[0]  # Wan's whitespace cleaning; html entities unescaped
    expected_ids = tokenizer(["snowy peaks & desert"], padding="max_length", max_length=8).input_ids[0]
    with torch.no_grad():
        expected = loaded(
            torch.tensor([expected_ids]), torch.tensor([[int(i != 0) for i in expected_ids]])
        ).last_hidden_state[0]
    real = [i for i, token in enumerate(expected_ids) if token != 0]
    assert torch.allclose(embedding[real], expected[real], atol=TOL)
    assert not embedding[len(real) :].any()  # padding positions are zero, as Wan zeroes them
    # A Diffusers text_encoder/ folder.
    encoder.save_pretrained(tmp_path / "text_encoder")
    folder = load_text_encoder(tmp_path / "text_encoder", torch.float32)
    with torch.no_grad():
        assert (folder(ids, mask).last_hidden_state - library).abs().max().item() <= TOL
    with pytest.raises(WeightsError, match="nonexistent: no such file or folder"):
        load_text_encoder(tmp_path / "nonexistent", torch.float32)
    broken = dict(wan_names)
    broken["blocks.1.ffn.fc1.weight"] = torch.zeros(31, 16)
    torch.save(broken, tmp_path / "broken.pth")
    with pytest.raises(
        WeightsError, match=r"broken.pth.*blocks.1.ffn.fc1.weight: expected \(32, 16\), found \(31, 16\)"
    ):
        load_text_encoder(tmp_path / "broken.pth", torch.float32)


def test_a_diffusers_snapshot_loads_every_part_and_the_transformer_computes_the_library_forward(tmp_path: Path) -> None:
    made = wan_files.diffusers_snapshot(tmp_path, TINY)
    model = load_model("wan-causal", weights=str(tmp_path), threads=1)
    parts = model.weights.parts
    assert (parts.transformer, parts.vae, parts.text_encoder, parts.tokenizer) == tuple(
        tmp_path / n for n in ("transformer", "vae", "text_encoder", "tokenizer")
    )
    assert model.weights.config.name == "tiny"
    theirs = made["transformer"].state_dict()
    for name, tensor in model.forward.transformer.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    x, t, context = _block(TINY, seed=2)
    with torch.no_grad():
        library = made["transformer"](x, t, context, return_dict=False)[0]  # WanTransformer3DModel itself
    assert (library - _library_forward(model, x, t, context)).abs().max().item() <= TOL


def test_errors_name_the_users_key_the_file_the_part_and_the_shapes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    made = wan_files.self_forcing_download(tmp_path / "sf", TINY)
    weights = made["weights"]
    wan = tmp_path / "sf" / "wan_models" / "Wan2.1-T2V-1.3B"
    parts = {"vae": str(wan / "Wan2.1_VAE.pth"), "text": "hashed"}
    cases = [
        ({k: v for k, v in weights.items() if k != "head.modulation"}, r"missing \(1\): head.modulation \(1, 2, 32\)"),
        (
            {**weights, "blocks.0.ffn.0.weight": torch.zeros(65, 32)},
            r"wrong shape \(1\): blocks.0.ffn.0.weight: expected \(64, 32\), found \(65, 32\)",
        ),
        (
            {**weights, "blocks.0.self_attn.extra.weight": torch.zeros(2)},
            r"not in the model \(1\): blocks.0.self_attn.extra.weight \(2\)",
        ),
    ]
    for index, (broken, message) in enumerate(cases):
        path = tmp_path / f"broken{index}.safetensors"
        save_file(broken, str(path))
        with pytest.raises(
            WeightsError,
            match=rf"^transformer \S+broken{index}.safetensors: the file \(original layout, config tiny\).*{message}",
        ):
            load_model("wan-causal", checkpoint=str(path), **parts)
    checkpoint = str(tmp_path / "sf" / "checkpoints" / "self_forcing_dmd.pt")
    with pytest.raises(WeightsError, match=r"needs its text encoder.*text=hashed"):
        load_model("wan-causal", checkpoint=checkpoint, vae=parts["vae"])
    with pytest.raises(WeightsError, match=r"needs its VAE.*vae=random"):
        load_model("wan-causal", checkpoint=checkpoint, text="hashed")
    with pytest.raises(WeightsError, match=r"^text encoder \S+nonexistent: no such file or folder"):
        load_model(
            "wan-causal",
            checkpoint=checkpoint,
            vae=parts["vae"],
            text_encoder=str(tmp_path / "nonexistent"),
            tokenizer=str(tmp_path),
        )
    with pytest.raises(
        WeightsError,
        match=r"^transformer \S+Wan2.1_VAE.pth: not a Wan2.1 transformer checkpoint: it lacks 'patch_embedding.weight'",
    ):
        load_model("wan-causal", checkpoint=str(wan / "Wan2.1_VAE.pth"), **parts)  # a VAE given as the transformer
    stand_ins = load_model("wan-causal", checkpoint=checkpoint, text="hashed", vae="random", threads=1)
    assert "hashed-word stand-in" in stand_ins.spec.description
    assert "VAE: random weights" in stand_ins.spec.description


def test_a_longlive_lora_merges_into_the_base_weights(tmp_path: Path) -> None:
    weights = wan_files.random_transformer(TINY)
    torch.save({"generator": {f"model.{k}": v for k, v in weights.items()}}, tmp_path / "longlive_base.pt")
    generator = torch.Generator().manual_seed(4)
    lora = {}
    for layer in ("blocks.0.self_attn.q", "blocks.1.ffn.0"):
        out_dim, in_dim = weights[f"{layer}.weight"].shape
        lora[f"base_model.model.{layer}.lora_A.weight"] = torch.randn(4, in_dim, generator=generator)
        lora[f"base_model.model.{layer}.lora_B.weight"] = torch.randn(out_dim, 4, generator=generator)
    torch.save({"generator_lora": lora}, tmp_path / "lora.pt")
    model = load_model("wan-causal", weights=str(tmp_path), text="hashed", vae="random", threads=1)
    assert model.weights.parts.lora == tmp_path / "lora.pt"
    params = dict(model.forward.transformer.named_parameters())
    a, b = (
        lora["base_model.model.blocks.0.self_attn.q.lora_A.weight"],
        lora["base_model.model.blocks.0.self_attn.q.lora_B.weight"],
    )
    assert torch.allclose(
        params["blocks.0.attn1.to_q.weight"], weights["blocks.0.self_attn.q.weight"] + b @ a, atol=1e-6
    )
    assert torch.equal(params["blocks.0.attn1.to_k.weight"], weights["blocks.0.self_attn.k.weight"])  # not adapted
    assert "lora:" in model.spec.version


def test_the_14b_sharded_layout_loads_through_its_index(tmp_path: Path) -> None:
    """Wan-AI/Wan2.1-T2V-14B ships its transformer as diffusion_pytorch_model-0000N-of-0000M.safetensors + index."""
    import json

    from safetensors.torch import save_file

    weights = wan_files.random_transformer(TINY)
    names = sorted(weights)
    shards = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
        "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model("wan-causal", weights=str(tmp_path), text="hashed", vae="random", threads=1)
    assert model.weights.parts.transformer == tmp_path
    assert model.family.name == "wan"
    params = dict(model.forward.transformer.named_parameters())
    assert torch.equal(params["blocks.0.ffn.net.2.weight"], weights["blocks.0.ffn.2.weight"])


def test_a_folder_with_two_candidates_for_a_part_lists_them_and_the_family_decides_between_checkpoints(
    tmp_path: Path,
) -> None:
    from worldserve.models.wancausal.files import find_parts

    for name in ("sf/self_forcing_dmd.pt", "causvid/model.pt", "a/Wan2.1_VAE.pth", "Wan2.1_VAE.pth"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")  # names only: finding reads no file
    both = r"several transformer checkpoints \(causvid/model.pt, sf/self_forcing_dmd.pt\); pass checkpoint=PATH or"
    with pytest.raises(ValueError, match=both):
        find_parts(tmp_path)
    with pytest.raises(ValueError, match=r"several vae candidates \(Wan2.1_VAE.pth, a/Wan2.1_VAE.pth\); pass vae=PATH"):
        find_parts(tmp_path, family="causvid")
    (tmp_path / "a" / "Wan2.1_VAE.pth").unlink()
    parts = find_parts(tmp_path, family="causvid")
    assert (parts.transformer, parts.family, parts.vae) == (
        tmp_path / "causvid" / "model.pt",
        "causvid",
        tmp_path / "Wan2.1_VAE.pth",
    )
    assert parts.missing() == ["text_encoder", "tokenizer"]
