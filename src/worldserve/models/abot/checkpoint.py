"""``abot-world``'s transformer weights as ABot-World publishes them -> the diffusers modules and the adapter.

Owns: :data:`ADAPTER_PREFIX`, :func:`original_layout` (every key of the published
``diffusion_pytorch_model.safetensors`` with its shape: Wan2.2-TI2V-5B's transformer under the
original Wan names, as ``CausalWanModel`` saves it, and the control adapter under
``act_control_adapter.``), :func:`read_checkpoint` (a file or folder -> the shared
:class:`~worldserve.models.wan.checkpoint.TransformerState` in diffusers' names, the adapter's keys kept
as they are) and :func:`load_checkpoint` (strict, both parts: a key missing, extra or of the wrong
shape is a :class:`~worldserve.models.wan.statedict.WeightsError` naming the user's key, the file and
both shapes). A checkpoint without the adapter is refused: it is not ABot-World's.
Must not know: sessions, the sampler, caches.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from worldserve.models.abot.config import ABotConfig
from worldserve.models.abot.control_adapter import ControlAdapter
from worldserve.models.wan.checkpoint import TransformerState, load_renamed, transformer_state
from worldserve.models.wan.checkpoint import original_layout as wan_layout
from worldserve.models.wan.statedict import WeightsError, check_shapes, read_tensors

__all__ = ["ADAPTER_PREFIX", "build_adapter", "load_checkpoint", "original_layout", "read_checkpoint"]

ADAPTER_PREFIX = "act_control_adapter."


def build_adapter(config: ABotConfig) -> ControlAdapter:
    """The control adapter of ``config``'s size (randomly initialised)."""
    wan = config.wan
    return ControlAdapter(
        wan.dim,
        keys=config.keys,
        repeat=config.key_repeat,
        downscale=config.adapter_downscale,
        patch=(wan.patch[1], wan.patch[2]),
    )


def original_layout(config: ABotConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the published checkpoint of ``config``'s size, by its name in the file."""
    shapes = wan_layout(config.wan)
    adapter = build_adapter(config)
    shapes.update({ADAPTER_PREFIX + k: tuple(v.shape) for k, v in adapter.state_dict().items()})
    return shapes


def read_checkpoint(path: str | Path) -> TransformerState:
    """The transformer checkpoint (``diffusion_pytorch_model.safetensors``, a folder of shards, a torch file)."""
    path = Path(path)
    return transformer_state(read_tensors(path), str(path), keep=(ADAPTER_PREFIX,))


def load_checkpoint(state: TransformerState, transformer: nn.Module, adapter: nn.Module, config: ABotConfig) -> None:
    """Load ``state`` strictly into ``transformer`` and ``adapter``."""
    weights = {k: v for k, v in state.tensors.items() if not k.startswith(ADAPTER_PREFIX)}
    found = {k[len(ADAPTER_PREFIX) :]: v for k, v in state.tensors.items() if k.startswith(ADAPTER_PREFIX)}
    if not found:
        raise WeightsError(f"no control adapter ({ADAPTER_PREFIX}*): not an ABot-World checkpoint", path=state.source)
    load_renamed(
        transformer,
        weights,
        state.user_names,
        original=wan_layout(config.wan) if state.layout == "original" else None,
        where=state.source,
        part=f"the file ({state.layout} layout, config {config.wan.name})",
    )
    wanted = {k: tuple(v.shape) for k, v in adapter.state_dict().items()}
    check_shapes(found, wanted, where=state.source, part="its control adapter", user_name=lambda k: ADAPTER_PREFIX + k)
    adapter.load_state_dict(found, strict=True)
