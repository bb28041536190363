"""The README's Python example and the benchmarks still run (small, in subprocesses)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Subprocesses doing real work: generous, so that a slow or busy CPU passes too.
pytestmark = pytest.mark.timeout(600)


def test_readme_python_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Use it from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    script = tmp_path / "example.py"
    script.write_text(code.group(1))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "0 (1,) (4, 48, 48, 3)"
    assert lines[-1] == "7 () (4, 48, 48, 3)"


def test_runtime_benchmark_smoke() -> None:
    command = [sys.executable, "bench/runtime.py", "--step-ms", "3", "--seconds", "0.2", "--sessions", "1", "8"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr
    assert "chunks/s" in done.stdout
    assert re.search(r"batching at 8 sessions: [\d.]+x", done.stdout), done.stdout


def test_chunk_parts_benchmark_smoke() -> None:
    pytest.importorskip("diffusers")
    command = [sys.executable, "bench/chunk_parts.py", "--models", "wan-causal", "--sessions", "1", "--chunks", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    row = re.search(r"\| wan-causal \| 1 \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (-?\d+) \| 3 \|", done.stdout)
    assert row is not None, done.stdout
    _, parted, first, playable, _ = (int(value) for value in row.groups())
    assert first <= playable <= parted  # the first of 3 parts is in before the chunk is


def test_tinyworld_benchmark_smoke() -> None:
    command = [sys.executable, "bench/tinyworld.py", "--chunks", "4", "--repeats", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr
    assert re.search(r"\| 1 session, frames/s +\| [\d.]+ ", done.stdout), done.stdout
    assert re.search(r"8 sessions batched, aggregate frames/s \| [\d.]+ \([\d.]+x one session\)", done.stdout)


def test_tinyworld_profile_benchmark_smoke() -> None:
    command = [sys.executable, "bench/tinyworld_profile.py", "--steps", "1", "--batches", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr
    assert re.search(r"\| denoising: convolutions +\| [\d.]+ ms \(\d+%\)", done.stdout), done.stdout
    assert re.search(r"\| convolutions: arithmetic, rate +\| [\d.]+ GFLOP, \d+ GFLOP/s", done.stdout), done.stdout


def test_tinyworld_runtimes_benchmark_smoke() -> None:
    # ONNX Runtime and OpenVINO are not dependencies: without onnx it says so; with it, it compares.
    command = [sys.executable, "bench/tinyworld_runtimes.py", "--repeats", "1", "--chunks", "1", "--batches", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    if importlib.util.find_spec("onnx") is None:
        assert done.returncode == 2
        assert "needs the onnx package" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert re.search(r"\| 1 +\| [\d.]+ ms", done.stdout), done.stdout


@pytest.mark.timeout(90)
def test_capacity_benchmark_smoke() -> None:
    command = [sys.executable, "bench/capacity.py", "--model", "procedural", "--duration", "1.5", "--stagger", "0.5"]
    command += ["--start", "1", "--max-clients", "2", "--sides", "on", "jit", "--server-arg", "--gather-wait-ms 10"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=80, check=False)
    assert done.returncode == 0, done.stderr
    assert ", --gather-wait-ms 10," in done.stdout.splitlines()[0]  # passed on to the server
    assert re.search(r"sessions held at <= 1 % late chunks \(counted by the player's underruns\): \d+", done.stdout), (
        done.stdout
    )
    assert re.search(r"\| on \| \d+ \| [\d.]+ \|", done.stdout), done.stdout
    assert "chunk clock on, --lead jit:" in done.stdout
    assert re.search(r"\| jit \| \d+ \| ", done.stdout), done.stdout  # held or not: a 1.5 s run decides nothing


@pytest.mark.timeout(120)
def test_media_benchmark_smoke() -> None:
    done = subprocess.run(
        [sys.executable, "bench/media.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"\| h264, quality 65 \(CRF 18\), cap 128 kbit/s \(default\) +\| [\d.]+ +\|", done.stdout)
    assert re.search(r"At equal-or-better PSNR: h264 [\d.]+ kB/s vs JPEG quality \d+", done.stdout), done.stdout
    assert re.search(r"\| 48x48 \| h264 +\| [\d.]+ ", done.stdout), done.stdout
    assert "### Viewers, h264" in done.stdout


def test_readme_lists_every_doc_and_tool() -> None:
    """The README's layout names each docs/*.md and each tools/*.py (a newcomer finds them there)."""
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    tools = sorted(p.name for p in (ROOT / "src/worldserve/tools").glob("*.py") if p.name != "__init__.py")
    missing = [name for name in docs + tools if not re.search(rf"(?<![\w/.-]){re.escape(name)}", layout)]
    assert missing == []


def test_docs_name_only_files_that_exist() -> None:
    """Each file a doc links to, or names by a path from itself (a backquoted ``x.md`` or ``../x.md``), is in
    the repository (``docs/serving/...`` paths name other projects' files)."""
    missing = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        text = doc.read_text()
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        named = re.findall(r"`((?:\.\./)*[\w.-]+(?:/[\w.-]+)*\.md)`", text)
        named = [n for n in named if n.startswith("../") or "/" not in n]
        for target in links + named:
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            found = [p.resolve() for p in (doc.parent / target, ROOT / target) if p.exists()]
            if not any(p.is_relative_to(ROOT) for p in found):  # outside the checkout is not in the repository
                missing.append(f"{doc.name}: {target}")
    assert missing == []


@pytest.mark.timeout(120)
def test_leads_benchmark_smoke() -> None:
    command = [sys.executable, "bench/leads.py", "--models", "procedural", "--clients", "1", "--duration", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr
    for side in ("1:off", "1", "jit"):  # every side, one row each, with a measured key-to-photon
        assert re.search(rf"\| procedural \| {side} \| 1 \(1 played\) \| \d+ / \d+ / \d+ \|", done.stdout), done.stdout
    off = r"\| procedural \| 1:off \|[^\n]*\| 0 of \d+ \| 0 / 0 \|"  # preemption off: none made again, none lost
    assert re.search(off, done.stdout), done.stdout


@pytest.mark.timeout(240)
def test_page_latency_benchmark_smoke() -> None:
    """The page's own key-to-photon figures, through headless Chromium, beside the bench's, in one table."""
    done = subprocess.run(
        [sys.executable, "bench/page_latency.py", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=230
    )
    assert done.returncode == 0, done.stderr
    figure = r"\d+ / \d+ / \d+ \(\d+\)"
    versus = r"[+-]\d+ % \([+-]\d+ to [+-]\d+\)"  # the bench's p50 against the page's, its 95 % interval
    row = rf"\| procedural \| jit \| jpeg \| parts \| {figure} \| {figure} \| {versus} \|"
    assert re.search(row, done.stdout), done.stdout


def test_the_page_benchs_interval_covers_equal_medians_and_not_a_shift_of_a_fifth() -> None:
    """bench/page_latency.py's 95 % bootstrap interval of the bench's median against the page's."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from page_latency import ratio_interval
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import random

    rng = random.Random(3)
    page = [rng.uniform(100, 350) for _ in range(200)]
    same = [rng.uniform(100, 350) for _ in range(200)]
    low, high = ratio_interval(same, page, seed=1)
    assert low < 0 < high
    assert high - low < 0.25
    low, high = ratio_interval([value * 1.2 for value in same], page, seed=1)
    assert 0 < low < 0.2 < high


@pytest.mark.timeout(240)
def test_webrtc_latency_benchmark_smoke() -> None:
    """WebRTC beside a WebSocket across the user-space lossy link (two network namespaces: root only)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from link import available
    finally:
        sys.path.remove(str(ROOT / "bench"))
    if (why := available()) is not None:
        pytest.skip(f"no link here: {why}")
    command = [sys.executable, "bench/webrtc_latency.py", "--smoke", "--links", "lossy", "--transports", "ws/jpeg"]
    done = subprocess.run([*command, "webrtc"], cwd=ROOT, capture_output=True, text=True, timeout=230, check=False)
    assert done.returncode == 0, done.stderr
    for transport in ("ws/jpeg", "webrtc"):  # one row each: key-to-photon measured, no event lost, no error
        row = rf"\| lossy \(1 % loss\) \| {re.escape(transport)} \| \d+ / \d+ / \d+ \| \d+ / \d+ / \d+ \|"
        assert re.search(row + r"[^\n]*\| [1-9]\d* \| 0 / 0 \| 0 \| \d+ \|", done.stdout), done.stdout
    assert "lossy: webrtc key-to-photon p95 vs ws/jpeg:" in done.stdout
