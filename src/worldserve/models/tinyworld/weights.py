"""Weights on disk: safetensors with the config and training facts in its metadata.

Owns: :data:`DEFAULT_WEIGHTS` (the trained weights shipped in the package),
:func:`save_weights` and :func:`load_net`. Must not know: training loops, sessions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from worldserve.models.tinyworld.config import TinyWorldConfig
from worldserve.models.tinyworld.network import TinyWorldNet

__all__ = ["DEFAULT_WEIGHTS", "load_net", "read_metadata", "save_weights", "weights_version"]

#: The trained weights that ship with the package.
DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "tinyworld.safetensors"


def save_weights(net: TinyWorldNet, path: Path, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``net``'s float32 weights and config (plus ``metadata``) to ``path``."""
    tensors = {name: value.detach().float().contiguous() for name, value in net.state_dict().items()}
    meta = {"config": net.config.to_json(), **(metadata or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as handle:
        meta: dict[str, str] | None = handle.metadata()
    return dict(meta or {})


def load_net(path: Path | None = None) -> TinyWorldNet:
    """The network stored at ``path`` (default: the shipped weights), in eval mode."""
    target = DEFAULT_WEIGHTS if path is None else Path(path)
    if not target.exists():
        raise FileNotFoundError(
            f"tinyworld weights not found at {target}; train them with python -m worldserve.models.tinyworld.train"
        )
    config = TinyWorldConfig.from_json(read_metadata(target)["config"])
    net = TinyWorldNet(config)
    net.load_state_dict(load_file(str(target)))
    net.eval()
    for parameter in net.parameters():
        parameter.requires_grad_(False)
    return net


def weights_version(path: Path | None = None) -> str:
    """``"sha256:<12 hex>"`` of the weights file (default: the shipped weights): what replays compare."""
    target = DEFAULT_WEIGHTS if path is None else Path(path)
    return "sha256:" + hashlib.sha256(target.read_bytes()).hexdigest()[:12]


def count_parameters(net: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in net.parameters())
