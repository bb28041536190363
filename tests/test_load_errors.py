"""A part's file that does not load is named as that part: the part, the file, what is wrong, what was expected.

One table, per model (``wan-causal``, ``matrix-game-2``) and per part it loads (transformer, VAE,
text encoder, tokenizer, LoRA, image encoder), a broken file of each kind (not a torch or
safetensors file, cut off, other keys, a wrong shape, missing, a folder where a file goes, a
tokenizer folder that does not load), given through the part's own option (``vae=PATH``) and put
in a download at the part's published name (``weights=DIR``). Every error is one line that
starts with the part and the file and ends with what the loader expected (its published names,
written here). The downloads are the tiny ones of ``wan_files`` / ``matrix_files``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import matrix_files  # noqa: E402
import wan_files  # noqa: E402
from wan_files import one_thread  # noqa: E402, F401 (the autouse fixture)
from worldserve.models import load_model  # noqa: E402
from worldserve.models.wan.config import get_config  # noqa: E402
from worldserve.models.wan.statedict import WeightsError  # noqa: E402

TINY = get_config("tiny")
WAN = Path("wan_models") / "Wan2.1-T2V-1.3B"

#: part -> (its name in errors, the option that gives it, its file in the download, a key to give the wrong
#: shape, what the error says was expected: a published name of the part)
WAN_PARTS: dict[str, tuple[str, str, Path, str, str]] = {
    "transformer": (
        "transformer",
        "checkpoint",
        Path("checkpoints") / "self_forcing_dmd.pt",
        "model.blocks.0.ffn.0.weight",
        "a Wan2.1-family transformer checkpoint: self_forcing_dmd.pt",
    ),
    "vae": (
        "VAE",
        "vae",
        WAN / "Wan2.1_VAE.pth",
        "decoder.head.0.gamma",
        "Wan2.1's VAE: Wan2.1_VAE.pth or a folder vae/",
    ),
    "text_encoder": (
        "text encoder",
        "text_encoder",
        WAN / "models_t5_umt5-xxl-enc-bf16.pth",
        "blocks.1.ffn.fc1.weight",
        "models_t5_umt5-xxl-enc-bf16.pth or a folder text_encoder/",
    ),
    "lora": (
        "LoRA",
        "lora",
        Path("lora.pt"),
        "base_model.model.blocks.0.self_attn.q.lora_B.weight",
        "LongLive's peft LoRA",
    ),
}
MATRIX_PARTS: dict[str, tuple[str, str, Path, str, str]] = {
    "transformer": (
        "transformer",
        "checkpoint",
        Path("base_distilled_model") / "base_distill.safetensors",
        "model.blocks.1.ffn.0.weight",
        "a Matrix-Game 2.0 transformer: base_distill.safetensors",
    ),
    "vae": ("VAE", "vae", Path("Wan2.1_VAE.pth"), "decoder.head.0.gamma", "Wan2.1's VAE: Wan2.1_VAE.pth"),
    "image_encoder": (
        "image encoder",
        "image_encoder",
        Path("models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"),
        "visual.transformer.1.mlp.0.weight",
        "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth or a folder image_encoder/",
    ),
}


def _load_raw(path: Path) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    return dict(torch.load(path, weights_only=True))


def _save_raw(raw: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(raw, str(path))
    else:
        torch.save(raw, path)


def _reshaped(raw: dict[str, Any], key: str) -> bool:
    """``raw`` (and the training wrappers in it) with ``key`` one row longer; whether it was found."""
    found = False
    for name, value in raw.items():
        if isinstance(value, dict):
            found = _reshaped(value, key) or found
        elif name == key:
            raw[name] = torch.zeros(value.shape[0] + 1, *value.shape[1:])
            found = True
    return found


def garbage(path: Path, good: Path, key: str) -> str:
    path.unlink()
    path.write_bytes(b"this is no weight file at all\n" * 20)
    return "not a safetensors file" if path.suffix == ".safetensors" else "not a torch file"


def cut_off(path: Path, good: Path, key: str) -> str:
    data = good.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 2])
    return "cut off"


#: What each loader says of a file of other keys (``unrelated.weight`` alone), by the file's published name.
OTHER_KEYS = {
    "self_forcing_dmd.pt": "not a Wan2.1 transformer checkpoint: it lacks 'patch_embedding.weight'",
    "longlive_base.pt": "not a Wan2.1 transformer checkpoint: it lacks 'patch_embedding.weight'",
    "Wan2.1_VAE.pth": "missing (194): ",
    "models_t5_umt5-xxl-enc-bf16.pth": "it lacks 'token_embedding.weight': not Wan's T5 layout",
    "lora.pt": "key 'unrelated.weight' is not <layer>.lora_A.weight",
    "base_distill.safetensors": "not a Matrix-Game 2.0 transformer: no patch_embedding.weight",
    "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth": "missing (",
}


def other_keys(path: Path, good: Path, key: str) -> str:
    path.unlink()
    _save_raw({"unrelated.weight": torch.zeros(3, 2)}, path)
    return OTHER_KEYS[path.name]


def wrong_shape(path: Path, good: Path, key: str) -> str:
    raw = _load_raw(good)
    assert _reshaped(raw, key), key
    path.unlink()
    _save_raw(raw, path)
    return "does not fit" if path.name == "lora.pt" else "wrong shape (1): "


def missing(path: Path, good: Path, key: str) -> str:
    path.unlink()
    return "no such file or folder"


def empty_folder(path: Path, good: Path, key: str) -> str:
    path.unlink()
    path.mkdir()
    return "a folder without"


BREAKS: dict[str, Callable[[Path, Path, str], str]] = {
    "garbage": garbage,
    "cut-off": cut_off,
    "other-keys": other_keys,
    "wrong-shape": wrong_shape,
    "missing": missing,
    "folder": empty_folder,
}


@pytest.fixture(scope="module")
def wan_download(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wan")
    wan_files.self_forcing_download(root, TINY)
    generator = torch.Generator().manual_seed(4)
    weights = wan_files.random_transformer(TINY)
    lora = {}
    for layer in ("blocks.0.self_attn.q", "blocks.1.ffn.0"):
        out_dim, in_dim = weights[f"{layer}.weight"].shape
        lora[f"base_model.model.{layer}.lora_A.weight"] = torch.randn(4, in_dim, generator=generator)
        lora[f"base_model.model.{layer}.lora_B.weight"] = torch.randn(out_dim, 4, generator=generator)
    torch.save({"generator_lora": lora}, root / "lora.pt")
    return root


@pytest.fixture(scope="module")
def matrix_download(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("matrix") / "Matrix-Game-2.0"
    root.mkdir()
    matrix_files.skywork_download(root, variants=("universal",))
    return root


def _wan_options(root: Path, part: str, broken: Path) -> dict[str, str]:
    options = {
        "checkpoint": str(root / WAN_PARTS["transformer"][2]),
        "vae": str(root / WAN_PARTS["vae"][2]),
        "text_encoder": str(root / WAN_PARTS["text_encoder"][2]),
        "tokenizer": str(root / WAN / "google" / "umt5-xxl"),
    }
    options[WAN_PARTS[part][1] if part in WAN_PARTS else part] = str(broken)
    return options


def _assert_named(error: WeightsError, label: str, path: Path, said: str, expected: str) -> None:
    message = str(error)
    assert "\n" not in message, message
    assert message.startswith(f"{label} {path}: "), message
    assert said in message, message
    assert "; expected " in message, message
    assert expected in message.split("; expected ", 1)[1], message
    assert (error.part, error.source) == (label, path)


@pytest.mark.parametrize("kind", sorted(BREAKS))
@pytest.mark.parametrize("part", sorted(WAN_PARTS))
def test_wan_causal_names_the_part_of_a_broken_file_given_by_its_option(
    wan_download: Path, tmp_path: Path, part: str, kind: str
) -> None:
    root = tmp_path / "download"
    shutil.copytree(wan_download, root)
    label, _, file, key, expected = WAN_PARTS[part]
    said = BREAKS[kind](root / file, wan_download / file, key)
    with pytest.raises(WeightsError) as error:
        load_model("wan-causal", **_wan_options(root, part, root / file), threads=1)
    _assert_named(error.value, label, root / file, said, expected)


#: Through weights=DIR: the broken file at the part's published name (a folder: the Diffusers vae/ form,
#: empty). A missing file is a missing part there, said by the rule that the checkpoint needs it.
DIR_BREAKS = ("garbage", "cut-off", "other-keys", "wrong-shape")


@pytest.mark.parametrize(
    ("part", "kind"), [(part, kind) for part in sorted(WAN_PARTS) for kind in DIR_BREAKS] + [("vae", "folder")]
)
def test_wan_causal_names_the_part_of_a_broken_file_found_under_weights(
    wan_download: Path, tmp_path: Path, part: str, kind: str
) -> None:
    root = tmp_path / "download"
    shutil.copytree(wan_download, root)
    label, _, file, key, expected = WAN_PARTS[part]
    if part != "lora":
        (root / "lora.pt").unlink()  # LongLive's LoRA is found beside a LongLive checkpoint only
    else:
        (root / "checkpoints" / "self_forcing_dmd.pt").rename(root / "checkpoints" / "longlive_base.pt")
    if kind == "folder":  # found by its Diffusers name: an empty vae/ stands for them all
        (root / file).unlink()
        file = WAN / "vae"
        (root / file).mkdir()
        said = "a folder without weight files"
    else:
        said = BREAKS[kind](root / file, wan_download / file, key)
    with pytest.raises(WeightsError) as error:
        load_model("wan-causal", weights=str(root), threads=1)
    _assert_named(error.value, label, root / file, said, expected)


TOKENIZER_BREAKS = {
    "missing": "no such folder",
    "a-file": "a file, not a folder",
    "empty-folder": "a folder with none of tokenizer.json",
    "garbage-json": "not a loadable tokenizer folder (JSONDecodeError",
    "cut-off-json": "not a loadable tokenizer folder (JSONDecodeError",
}


#: Under weights=DIR a tokenizer folder missing, or a file named umt5-xxl, is a part not found (not a load error).
TOKENIZER_CASES = [(kind, "option") for kind in sorted(TOKENIZER_BREAKS)] + [
    (kind, "weights") for kind in ("cut-off-json", "empty-folder", "garbage-json")
]


@pytest.mark.parametrize(("kind", "route"), TOKENIZER_CASES)
def test_wan_causal_names_a_tokenizer_folder_that_does_not_load(
    wan_download: Path, tmp_path: Path, kind: str, route: str
) -> None:
    root = tmp_path / "download"
    shutil.copytree(wan_download, root)
    (root / "lora.pt").unlink()
    folder = root / WAN / "google" / "umt5-xxl"
    if kind in ("missing", "a-file", "empty-folder"):
        shutil.rmtree(folder)
        if kind == "a-file":
            folder.write_text("not a folder")
        elif kind == "empty-folder":
            folder.mkdir()
    else:
        text = (folder / "tokenizer.json").read_text()
        (folder / "tokenizer.json").write_text("{not json" if kind == "garbage-json" else text[: len(text) // 2])
    options = _wan_options(root, "tokenizer", folder) if route == "option" else {"weights": str(root)}
    with pytest.raises(WeightsError) as error:
        load_model("wan-causal", **options, threads=1)
    _assert_named(
        error.value, "tokenizer", folder, TOKENIZER_BREAKS[kind], "the UMT5 tokenizer folder: a folder umt5-xxl/"
    )


def test_a_text_encoder_of_another_width_is_named_as_the_text_encoder(wan_download: Path, tmp_path: Path) -> None:
    encoder = wan_files.tiny_umt5(TINY.text_dim + 8)
    path = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save(wan_files.umt5_to_wan(encoder), path)
    with pytest.raises(WeightsError) as error:
        load_model("wan-causal", **_wan_options(wan_download, "text_encoder", path), threads=1)
    _assert_named(
        error.value,
        "text encoder",
        path,
        f"an encoder of {TINY.text_dim + 8}-dim states; the transformer (config tiny) takes {TINY.text_dim}",
        "Wan's UMT5 text encoder: models_t5_umt5-xxl-enc-bf16.pth",
    )


def _matrix_options(root: Path, part: str, broken: Path) -> dict[str, str]:
    options = {option: str(root / file) for option, file in ((p[1], p[2]) for p in MATRIX_PARTS.values())}
    options[MATRIX_PARTS[part][1]] = str(broken)
    return options


@pytest.mark.parametrize("kind", sorted(BREAKS))
@pytest.mark.parametrize("part", sorted(MATRIX_PARTS))
def test_matrix_game_names_the_part_of_a_broken_file_given_by_its_option(
    matrix_download: Path, tmp_path: Path, part: str, kind: str
) -> None:
    root = tmp_path / "Matrix-Game-2.0"
    shutil.copytree(matrix_download, root)
    label, _, file, key, expected = MATRIX_PARTS[part]
    said = BREAKS[kind](root / file, matrix_download / file, key)
    with pytest.raises(WeightsError) as error:
        load_model("matrix-game-2", **_matrix_options(root, part, root / file))
    _assert_named(error.value, label, root / file, said, expected)


@pytest.mark.parametrize("kind", DIR_BREAKS)
@pytest.mark.parametrize("part", sorted(MATRIX_PARTS))
def test_matrix_game_names_the_part_of_a_broken_file_found_under_weights(
    matrix_download: Path, tmp_path: Path, part: str, kind: str
) -> None:
    root = tmp_path / "Matrix-Game-2.0"
    shutil.copytree(matrix_download, root)
    label, _, file, key, expected = MATRIX_PARTS[part]
    said = BREAKS[kind](root / file, matrix_download / file, key)
    with pytest.raises(WeightsError) as error:
        load_model("matrix-game-2", weights=str(root))
    _assert_named(error.value, label, root / file, said, expected)


@pytest.mark.parametrize("part", ["vae", "image_encoder"])
def test_matrix_game_loads_a_vae_or_image_encoder_given_with_random_transformer_weights(
    matrix_download: Path, tmp_path: Path, part: str
) -> None:
    """``vae=PATH`` without a checkpoint was dropped unread; now it loads (as wan-causal's does), or says why not."""
    label, option, file, _, expected = MATRIX_PARTS[part]
    model = load_model("matrix-game-2", **{option: str(matrix_download / file)})
    assert model.loaded.sources == {part: matrix_download / file}
    assert model.loaded.dummy
    broken = tmp_path / file.name
    shutil.copy(matrix_download / file, broken)
    said = garbage(broken, matrix_download / file, "")
    with pytest.raises(WeightsError) as error:
        load_model("matrix-game-2", **{option: str(broken)})
    _assert_named(error.value, label, broken, said, expected)


def test_inspect_names_the_part_of_a_broken_file(wan_download: Path, matrix_download: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from worldserve.tools.inspect import inspect_path

    wan = tmp_path / "wan"
    shutil.copytree(wan_download, wan)
    vae = wan / WAN_PARTS["vae"][2]
    garbage(vae, vae, "")
    with pytest.raises(WeightsError) as error:
        inspect_path(wan)
    _assert_named(error.value, "VAE", vae, "not a torch file", WAN_PARTS["vae"][4])
    matrix = tmp_path / "Matrix-Game-2.0"
    shutil.copytree(matrix_download, matrix)
    clip = matrix / MATRIX_PARTS["image_encoder"][2]
    cut_off(clip, matrix_download / MATRIX_PARTS["image_encoder"][2], "")
    with pytest.raises(WeightsError) as error:
        inspect_path(matrix)
    _assert_named(error.value, "image encoder", clip, "cut off", MATRIX_PARTS["image_encoder"][4])
    done = subprocess.run(
        [sys.executable, "-m", "worldserve", "inspect", str(vae)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(f"VAE {vae}: not a torch file"), done.stderr
    assert f"; expected {WAN_PARTS['vae'][4]}" in done.stderr
