"""Wire compatibility with vllm-omni 0.30.0, checked against its own modules.

The wheel is fetched from the package registry (as ``bench/control_plane.py`` does) into a
temporary folder, never installed nor copied into the project; its consumer's parser is
loaded with stand-ins for the two vllm-omni modules it imports only for type names. When
the registry cannot be reached, the test is skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worldserve import ChunkMetadata, build_chunk_envelope, parse_chunk_envelope

WHEEL = "vllm-omni==0.30.0"
CONSUMER = "vllm_omni/experimental/ar_diffusion/consumer.py"
TICK_PROTOCOL = "vllm_omni/experimental/ar_diffusion/tick_protocol.py"


@pytest.fixture(scope="module")
def consumer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[types.ModuleType]:
    folder = tmp_path_factory.mktemp("vllm-omni")
    fetched = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    wheels = list(folder.glob("*.whl"))
    if fetched.returncode != 0 or not wheels:
        pytest.skip(f"{WHEEL} could not be fetched: {fetched.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as archive:
        archive.extract(CONSUMER, folder)
        archive.extract(TICK_PROTOCOL, folder)
    saved = dict(sys.modules)
    stubs = {
        "vllm_omni": [],
        "vllm_omni.experimental": [],
        "vllm_omni.experimental.ar_diffusion": [],
        "vllm_omni.inputs": [],
        "vllm_omni.inputs.data": ["OmniDiffusionSamplingParams", "OmniPromptType", "OmniSamplingParams"],
        "vllm_omni.outputs": ["OmniRequestOutput"],
    }
    try:
        for name, attributes in stubs.items():
            module = types.ModuleType(name)
            module.__path__ = []  # type: ignore[attr-defined]
            for attribute in attributes:
                setattr(module, attribute, object)
            sys.modules[name] = module
        yield _load(folder / TICK_PROTOCOL, "vllm_omni.experimental.ar_diffusion.tick_protocol", folder)
    finally:
        sys.modules.clear()
        sys.modules.update(saved)


def _load(path: Path, name: str, folder: Path) -> types.ModuleType:
    tick_spec = importlib.util.spec_from_file_location(name, path)
    assert tick_spec is not None
    assert tick_spec.loader is not None
    tick_module = importlib.util.module_from_spec(tick_spec)
    sys.modules[name] = tick_module
    tick_spec.loader.exec_module(tick_module)
    consumer_name = "vllm_omni.experimental.ar_diffusion.consumer"
    spec = importlib.util.spec_from_file_location(consumer_name, folder / CONSUMER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[consumer_name] = module
    spec.loader.exec_module(module)
    return module


def _their_metadata(consumer: types.ModuleType, multimodal_output: dict[str, Any]) -> dict[str, Any]:
    output = types.SimpleNamespace(multimodal_output=multimodal_output)
    parsed = consumer._parse_chunk_metadata(output)
    return {
        "session_id": parsed.session_id,
        "request_id": parsed.request_id,
        "chunk_index": parsed.chunk_index,
        "applied_event_ids": list(parsed.applied_event_ids),
    }


def test_the_flattened_output_asyncomni_returns_parses_as_its_consumer_reads_it(consumer: types.ModuleType) -> None:
    metadata = ChunkMetadata("world-1", "req-7", 7, (3, 5))
    # What a pipeline returns (the worker side) ...
    envelope = build_chunk_envelope({"latents": [1.0, 2.0]}, metadata)
    # ... and what AsyncOmni hands the consumer: the payload's keys beside the metadata.
    flattened = {**envelope["payload"], "metadata": envelope["metadata"]}
    assert _their_metadata(consumer, flattened) == metadata.to_dict()
    payload, parsed = parse_chunk_envelope(flattened)
    assert parsed == metadata
    assert payload == {"latents": [1.0, 2.0]}
    assert parse_chunk_envelope(envelope) == ({"latents": [1.0, 2.0]}, metadata)


def test_both_refuse_output_without_the_identity(consumer: types.ModuleType) -> None:
    for bad in ({"latents": 1}, {"latents": 1, "metadata": {}}, {"latents": 1, "metadata": {"ar_diffusion": 3}}):
        with pytest.raises(ValueError, match="metadata"):
            consumer._parse_chunk_metadata(types.SimpleNamespace(multimodal_output=bad))
        with pytest.raises(ValueError, match="metadata"):
            parse_chunk_envelope(bad)
