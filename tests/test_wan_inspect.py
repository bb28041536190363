"""``worldserve inspect``: a folder of downloads named by its parts, family, config and serve command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import wan_files  # noqa: E402
from worldserve.models.wan.config import get_config  # noqa: E402
from worldserve.tools.inspect import format_inspection, inspect_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_inspect_names_the_family_and_the_missing_part_of_a_folder_with_one_part_removed(tmp_path: Path) -> None:
    wan_files.self_forcing_download(tmp_path, get_config("tiny"))
    (tmp_path / "wan_models" / "Wan2.1-T2V-1.3B" / "Wan2.1_VAE.pth").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "worldserve", "inspect", str(tmp_path), "--gpu-gib", "141"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "missing: vae\n" in out
    assert "family: self-forcing (from the published name self_forcing_dmd.pt)" in out
    assert "config: tiny (dim 32, layers 2, heads 2)" in out
    assert "training checkpoint with generator, generator_ema" in out
    command = f"worldserve serve --model wan-causal --model-option weights={tmp_path} --model-option vae=random"
    assert f"  serve: {command}" in out
    if torch.cuda.is_available():
        assert f"  serve: {command} --model-option device=cuda\n" in out
    else:  # the GPU's line would fail here: the CPU's, and what the GPU's needs
        assert f"  serve: {command}\n" in out
        assert "device=cuda" not in out.split("  serve: ")[1].splitlines()[0]
        assert "no CUDA on this machine" in out
        assert "on a machine with CUDA add --model-option device=cuda" in out
    assert "| 15 |" in out  # a row per window, the family's (Self-Forcing: 15) among them


def test_inspect_prints_device_cuda_only_where_cuda_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wan_files.diffusers_snapshot(tmp_path, get_config("tiny"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = inspect_path(tmp_path)
    assert "device=" not in cpu.command
    assert any(note.startswith("no CUDA on this machine") for note in cpu.notes)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = inspect_path(tmp_path)
    assert gpu.command == cpu.command + " --model-option device=cuda"
    assert not any("CUDA" in note for note in gpu.notes)


def test_inspect_of_a_folder_without_a_model_prints_no_serve_command(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not weights")
    done = subprocess.run(
        [sys.executable, "-m", "worldserve", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "worldserve serve" not in out
    assert "  serve: none (no transformer checkpoint here: no model to serve)" in out
    assert "missing: transformer, vae, text encoder, tokenizer\n" in out
    assert "note: no transformer checkpoint (e.g. self_forcing_dmd.pt" in out
    assert "family: ? (from no transformer checkpoint)" in out


def test_inspect_reports_a_diffusers_snapshot_whole_and_a_14b_checkpoint_by_its_shapes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    wan_files.diffusers_snapshot(tmp_path / "diffusers", get_config("tiny"))
    whole = inspect_path(tmp_path / "diffusers")
    assert whole.missing == []
    assert (whole.family, whole.parts["transformer"].layout, whole.parts["vae"].layout) == (
        "wan",
        "Diffusers",
        "Diffusers",
    )
    assert "text=hashed" not in whole.command
    # A 14B-wide checkpoint under an unpublished name: the size names the config and the family (Krea's 14B).
    config = get_config("14b")
    tensors = {"model.patch_embedding.weight": torch.zeros(config.dim, 16, 1, 2, 2)}
    save_file(tensors, str(tmp_path / "mine.safetensors"))
    wide = inspect_path(tmp_path / "mine.safetensors", gpu_gib=141)
    assert (wide.config, wide.family) == ("14b", "krea")
    assert "family=krea" in wide.command
    rows = {window: sessions for window, _, _, sessions in wide.memory}
    assert rows[3] > rows[15]  # a longer window, fewer sessions
    assert "| window (latent frames) |" in format_inspection(wide)
