"""``matrix-game-2`` loads the files as published (tiny sizes, random weights written by the test).

Skywork/Matrix-Game-2.0's download (the three distilled variants, ``Wan2.1_VAE.pth``, Wan's OpenCLIP
file) and FastVideo's ``Matrix-Game-2.0-*-Distilled-Diffusers`` folders, both written by
``tests/matrix_files.py`` in the authors' own names; the loaded model must hold the file's tensors key by
key and compute what the independent reference computes on the file's original names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import matrix_files  # noqa: E402
from matrix_drive import reference, rollout_against_reference  # noqa: E402
from matrix_reference import original_name, wan_clip_features  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models.matrixgame.adapter import MatrixGameModel  # noqa: E402
from worldserve.models.wan.statedict import WeightsError, read_tensors  # noqa: E402

VARIANTS = ("universal", "gta-drive", "templerun")


@pytest.fixture(scope="module")
def skywork(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    root = tmp_path_factory.mktemp("skywork") / "Matrix-Game-2.0"
    root.mkdir()
    return root, matrix_files.skywork_download(root)


def held_tensors(model: MatrixGameModel) -> dict[str, object]:
    return {original_name(k): v for k, v in model.loaded.transformer.state_dict().items()}


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_a_skywork_download_loads_each_variant_key_by_key_and_computes_what_the_reference_does(
    skywork: tuple[Path, dict[str, object]], variant: str
) -> None:
    root, made = skywork
    model = MatrixGameModel(weights=str(root), variant=variant)
    assert model.variant.name == variant
    folder, file, local = matrix_files.SKYWORK[variant]
    assert model.config.wan.window_frames == local - 3  # the context of the config.json beside the weights
    expected = made["weights"][variant]  # type: ignore[index]
    held = held_tensors(model)
    assert sorted(held) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name
    assert model.loaded.sources["transformer"] == root / folder / file
    assert model.loaded.layouts == {"transformer": "original", "vae": "original", "image_encoder": "wan"}
    checked = rollout_against_reference(model.forward, reference(model.forward, expected), blocks=3)
    assert checked == 3 * len(model.config.wan.denoising_steps)
    assert "base_distill" in MatrixGameModel(weights=str(root)).spec.description  # the universal one by default


@torch.no_grad()
def test_a_fastvideo_diffusers_folder_holds_the_same_network(
    skywork: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    root, made = skywork
    weights = made["weights"]["gta-drive"]  # type: ignore[index]
    folder = matrix_files.fastvideo_download(tmp_path, "gta-drive", weights, made["vae"], made["clip"])
    model = MatrixGameModel(weights=str(folder))
    assert model.variant.name == "gta-drive"  # from the shapes: keyboard width 2 and a mouse branch
    assert model.loaded.layouts == {"transformer": "diffusers", "vae": "diffusers", "image_encoder": "transformers"}
    held = held_tensors(model)
    for name, tensor in weights.items():
        assert torch.equal(held[name], tensor), name
    original = MatrixGameModel(weights=str(root), variant="gta-drive")
    for part in ("vae", "image_encoder"):
        ours = getattr(model.loaded, part).state_dict()
        theirs = getattr(original.loaded, part).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    rollout_against_reference(model.forward, reference(model.forward, weights), blocks=2)
    # FastVideo's own module names (its local converter's output) load to the same tensors.
    from safetensors.torch import save_file

    internal = tmp_path / "internal.safetensors"
    save_file(matrix_files.fastvideo_internal_names(weights), str(internal))
    assert any(".ffn.fc_in." in k for k in read_tensors(internal))
    again = MatrixGameModel(checkpoint=str(internal), vae="random", image_encoder="random")
    held = held_tensors(again)
    for name, tensor in weights.items():
        assert torch.equal(held[name], tensor), name


@torch.no_grad()
def test_the_image_encoder_in_both_layouts_computes_wans_clip_features(
    skywork: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    root, made = skywork
    wan_file = root / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    sd = read_tensors(wan_file, unwrap=False)
    pixels = torch.rand(1, 3, 48, 80, generator=torch.Generator().manual_seed(1)) * 2 - 1
    expected = wan_clip_features(sd, pixels, matrix_files.CLIP["heads"], matrix_files.CLIP["image"])
    folder = matrix_files.fastvideo_download(
        tmp_path,
        "universal",
        made["weights"]["universal"],
        made["vae"],
        made["clip"],  # type: ignore[index]
    )
    for weights in (root, folder):
        model = MatrixGameModel(weights=str(weights))
        features = model.encoder(pixels)
        assert features.shape == (1, 5, 16)
        assert (features - expected).abs().max().item() <= 1e-5


def test_the_variant_is_read_from_the_shapes_and_a_wrong_one_is_refused(
    skywork: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    root, _ = skywork
    for variant in VARIANTS:
        folder, file, _ = matrix_files.SKYWORK[variant]
        model = MatrixGameModel(checkpoint=str(root / folder / file), vae="random", image_encoder="random")
        assert model.variant.name == variant
        assert [c.track for c in model.spec.controls] == (["keys", "mouse"] if variant != "templerun" else ["keys"])
    universal = root / "base_distilled_model" / "base_distill.safetensors"
    with pytest.raises(
        WeightsError,
        match=r"templerun was asked for.*universal variant's \(keyboard width 4, "
        r"blocks\.0\.action_model\.keyboard_embed\.0\.weight",
    ):
        MatrixGameModel(checkpoint=str(universal), variant="templerun", vae="random", image_encoder="random")
    from safetensors.torch import save_file

    odd = matrix_files.random_transformer("universal")
    odd["blocks.0.action_model.keyboard_embed.0.weight"] = torch.zeros(8, 5)
    save_file({f"model.{k}": v for k, v in odd.items()}, str(tmp_path / "odd.safetensors"))
    with pytest.raises(
        WeightsError,
        match=r"keyboard width 5 \(blocks\.0\.action_model\.keyboard_embed\.0\.weight\) "
        r"\+ mouse is none of the released variants",
    ):
        MatrixGameModel(checkpoint=str(tmp_path / "odd.safetensors"), vae="random", image_encoder="random")


def test_errors_name_the_users_keys_and_the_missing_parts(
    skywork: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    root, made = skywork
    weights = dict(made["weights"]["universal"])  # type: ignore[call-overload]
    del weights["blocks.0.action_model.t_qkv.weight"]
    weights["blocks.1.ffn.0.weight"] = torch.zeros(48, 32)
    save_file({f"model.{k}": v for k, v in weights.items()}, str(tmp_path / "base_distill.safetensors"))
    with pytest.raises(WeightsError) as error:
        MatrixGameModel(checkpoint=str(tmp_path / "base_distill.safetensors"), vae="random", image_encoder="random")
    message = str(error.value)
    assert "missing (1): blocks.0.action_model.t_qkv.weight (96, 32)" in message
    assert "blocks.1.ffn.0.weight: expected (64, 32), found (48, 32)" in message
    checkpoint = str(root / "base_distilled_model" / "base_distill.safetensors")
    with pytest.raises(WeightsError, match=r"needs its VAE: vae=PATH \(Wan2\.1_VAE\.pth"):
        MatrixGameModel(checkpoint=checkpoint)
    with pytest.raises(WeightsError, match="needs its image encoder: image_encoder=PATH"):
        MatrixGameModel(checkpoint=checkpoint, vae=str(root / "Wan2.1_VAE.pth"))
    clip = read_tensors(root / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth", unwrap=False)
    del clip["visual.transformer.1.attn.to_qkv.weight"]
    torch.save(clip, tmp_path / "clip.pth")
    with pytest.raises(WeightsError, match=r"missing \(3\): visual\.transformer\.1\.attn\.to_qkv\.weight"):
        MatrixGameModel(
            checkpoint=checkpoint, vae=str(root / "Wan2.1_VAE.pth"), image_encoder=str(tmp_path / "clip.pth")
        )
    model = MatrixGameModel(checkpoint=checkpoint, vae="random", image_encoder="random")
    assert "VAE: random weights (vae=random)" in model.spec.description
    assert "image encoder: random weights (image_encoder=random)" in model.spec.description


def test_inspect_names_the_variant_the_missing_parts_and_the_command(
    skywork: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    from worldserve.tools.inspect import format_inspection, inspect_path

    root, made = skywork
    whole = inspect_path(root)
    assert (whole.model, whole.family, whole.config, whole.missing) == ("matrix-game-2", "universal", "tiny", [])
    assert any("gta_distilled_model/gta_keyboard2dim.safetensors" in note for note in whole.notes)
    file = root / "templerun_distilled_model" / "templerun_7dim_onlykey.safetensors"
    alone = inspect_path(file)
    assert (alone.family, alone.missing) == ("templerun", ["vae", "image_encoder"])
    text = format_inspection(alone)
    assert "variant templerun (from the shapes: keyboard width 7, no mouse branch)" in text
    assert f"--model matrix-game-2 --model-option checkpoint={file} --model-option vae=random" in text
    assert "--model-option image_encoder=random" in text
    import torch

    assert ("device=cuda" in alone.command) == torch.cuda.is_available()  # the GPU's line only where it runs
    folder = matrix_files.fastvideo_download(
        tmp_path,
        "gta-drive",
        made["weights"]["gta-drive"],
        made["vae"],
        made["clip"],  # type: ignore[index]
    )
    diffusers = inspect_path(folder)
    assert (diffusers.family, diffusers.missing, diffusers.parts["transformer"].layout) == (
        "gta-drive",
        [],
        "Diffusers (FastVideo)",
    )
    assert diffusers.memory[0][0] == 1  # GTA's window: local_attn_size 4 = the block's 3 + 1
