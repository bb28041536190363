"""A reduced precision the CPU has no kernels for is served in float32, and the server says so.

On an AVX2-only CPU PyTorch emulates bfloat16 and float16: 9x (linear) to 60x (3D convolution)
slower than float32. The AVX2 machine is made here from this one: ``ATEN_CPU_CAPABILITY=avx2``
and ``ONEDNN_MAX_CPU_ISA=AVX2`` turn off the AVX-512 and AMX kernels (and oneDNN then reports no
native bf16), in a child process so that the test's own torch is untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from worldserve.models.precision import native_low_precision, served_precision

#: A process whose torch sees an AVX2-only CPU.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

_PROBE = """
import json, sys
import torch
from worldserve.models import load_model
from worldserve.models.precision import native_low_precision
out = {"capability": torch.backends.cpu.get_cpu_capability(),
       "native_bf16": native_low_precision(torch.device("cpu"), "bfloat16")}
for name, options in json.loads(sys.argv[1]):
    spec = load_model(name, **options).spec
    out[name] = {"precision": spec.precision, "notes": list(spec.notes)}
print(json.dumps(out))
"""


def _probe(models: list[tuple[str, dict[str, object]]], env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(models)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(150)
def test_bfloat16_asked_on_an_avx2_only_cpu_is_served_in_float32_with_a_note() -> None:
    models = [
        ("wan-causal", {"config": "tiny", "dtype": "bfloat16", "threads": 1}),
        ("tinyworld", {"precision": "bfloat16", "threads": 1}),
    ]
    seen = _probe(models, AVX2_ONLY)
    assert seen["capability"] == "AVX2"
    assert seen["native_bf16"] is False
    for name in ("wan-causal", "tinyworld"):
        served = seen[name]
        assert isinstance(served, dict)
        assert served["precision"] == "float32", (name, served)
        (note,) = served["notes"]
        assert "bfloat16 asked, serving float32" in note, note
        assert "AVX2" in note, note


def test_the_rule_keeps_what_the_device_computes_natively() -> None:
    cpu = torch.device("cpu")
    assert served_precision("float32", cpu, "m") == ("float32", None)
    assert native_low_precision(torch.device("cuda"), "bfloat16")  # a GPU: never second-guessed
    native = native_low_precision(cpu, "bfloat16")
    served, note = served_precision("bfloat16", cpu, "m")
    assert (served, note is None) == (("bfloat16", True) if native else ("float32", False))


def test_wan_causal_serves_bfloat16_where_the_cpu_has_it() -> None:
    if not native_low_precision(torch.device("cpu"), "bfloat16"):
        pytest.skip("this CPU has no native bfloat16 (the AVX2 case is tested above)")
    from worldserve.models import load_model

    spec = load_model("wan-causal", config="tiny", dtype="bfloat16", threads=1).spec
    assert (spec.precision, spec.notes) == ("bfloat16", ())


@pytest.mark.timeout(200)
def test_the_server_says_at_start_up_what_it_serves_in_and_on_how_many_threads() -> None:
    from server_harness import start_server
    from worldserve.runtime.config import default_threads_per_worker

    args = ["--model", "wan-causal", "--model-option", "config=tiny", "--model-option", "dtype=bfloat16"]
    server = start_server(*args, env=AVX2_ONLY, timeout=150.0)
    try:
        log = server.log()
    finally:
        server.stop()
    threads, why = default_threads_per_worker(1)
    said = (
        f"worldserve: serving wan-causal (float32) on 1 worker x {threads} thread{'s' if threads != 1 else ''} ({why}"
    )
    assert said in log, log
    assert "worldserve: note: wan-causal: bfloat16 asked, serving float32: this CPU (AVX2)" in log, log
