"""World-model adapters and the built-in model registry.

Importing this package needs the ``models`` extra (numpy, jsonschema), never torch:
a model's heavy dependencies load only when :func:`load_model` builds it, which the
runtime does inside its worker processes.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from worldserve.models.base import ControlSchema, ModelSpec, SessionOptions, SpecControlValidator, WorldModel

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "ControlSchema",
    "ModelSpec",
    "SessionOptions",
    "SpecControlValidator",
    "WorldModel",
    "load_model",
]

#: The model the runtime and the server use unless told otherwise.
DEFAULT_MODEL = "tinyworld"

#: Built-in model names and the ``module:factory`` that builds each.
BUILTIN_MODELS: Mapping[str, str] = MappingProxyType(
    {
        "procedural": "worldserve.models.procedural:ProceduralModel",
        "tinyworld": "worldserve.models.tinyworld.adapter:TinyWorldModel",
        "wan-causal": "worldserve.models.wancausal.adapter:WanCausalModel",
        "matrix-game-2": "worldserve.models.matrixgame.adapter:MatrixGameModel",
        "abot-world": "worldserve.models.abot.model:ABotWorldModel",
    }
)

#: The extra each built-in model needs beyond ``models``.
_EXTRAS: Mapping[str, str] = MappingProxyType(
    {"tinyworld": "tinyworld", "wan-causal": "wan", "matrix-game-2": "wan", "abot-world": "wan"}
)


def load_model(name: str, **options: Any) -> WorldModel:
    """Build a model by built-in name, or by ``"package.module:factory"`` for your own."""
    target = BUILTIN_MODELS.get(name, name)
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"unknown model {name!r}; built-in models: {sorted(BUILTIN_MODELS)}.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if name in _EXTRAS and error.name is not None and not error.name.startswith("worldserve"):
            raise ModuleNotFoundError(
                f"model {name!r} needs the {_EXTRAS[name]!r} extra ({error.name} is missing): "
                f"pip install 'worldserve[{_EXTRAS[name]}]', or choose --model procedural.",
                name=error.name,
            ) from error
        raise
    factory = getattr(module, attribute)
    model = factory(**options)
    if not isinstance(model, WorldModel):
        raise TypeError(f"{target} did not build a WorldModel (got {type(model).__name__}).")
    return model
