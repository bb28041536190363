"""The ``worldserve`` command answers bad input in one line, exit status 2, before any work starts.

Every case runs the real command (``python -m worldserve``) in a subprocess and asserts on
what a user sees: the exit status, exactly one line on stderr saying what is wrong, no
traceback (and so no shared-memory warning from a runtime that started and then failed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from worldserve import __version__
from worldserve.tools.cli import build_parser

pytestmark = pytest.mark.timeout(300)


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cuda_option() -> str:
    """A device this machine does not have: ``cuda`` without a GPU, else a GPU index past the last."""
    import torch

    return "device=cuda:99" if torch.cuda.is_available() else "device=cuda"


def _cuda_said() -> str:
    """What serve says of :func:`_cuda_option`'s device: what is missing, and so what to change."""
    import torch

    if torch.cuda.is_available():
        return f"device=cuda:99: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
    return "device=cuda needs a CUDA GPU, and this machine's PyTorch sees none"


def run(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "worldserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def _journal_lines(model: str = "procedural") -> list[str]:
    start = {
        "type": "start", "session_id": "s", "model": model, "model_version": "world-1", "precision": "exact",
        "model_options": {}, "options": {"prompt": None, "seed": 2, "image": None}, "frames_per_chunk": 4,
        "fps": 16.0,
    }  # fmt: skip
    chunk = {"type": "chunk", "chunk_index": 0, "applied_event_ids": [], "prompt": None, "controls": []}
    return [json.dumps(start), json.dumps(chunk), json.dumps({**chunk, "chunk_index": 1})]


GOOD_SCRIPT = json.dumps({"chunks": 2, "events": [{"after_chunk": 0, "prompt": "snow"}]})

#: (case id, files to write into the test's directory, arguments ({dir}, {dead} filled in), what stderr names ({dir}
#: filled in too))
CASES: list[tuple[str, dict[str, str], list[str], str]] = [
    ("serve-workers-0", {}, ["serve", "--workers", "0"], "--workers: must be at least 1"),
    ("serve-port-99999", {}, ["serve", "--port", "99999"], "--port: a TCP port is 0 to 65535"),
    ("serve-pending-negative", {}, ["serve", "--max-pending-events", "-1"], "--max-pending-events: must be at"),
    ("serve-deadline-negative", {}, ["serve", "--tick-deadline-s", "-5"], "--tick-deadline-s: must be zero or more"),
    ("serve-batch-0", {}, ["serve", "--max-batch-size", "0"], "--max-batch-size: must be at least 1"),
    ("serve-sessions-0", {}, ["serve", "--max-sessions-per-worker", "0"], "--max-sessions-per-worker: must be at"),
    ("serve-unknown-model", {}, ["serve", "--model", "nosuchmodel"], "unknown model 'nosuchmodel'"),
    ("serve-memory-budget", {}, ["serve", "--memory-budget", "lots"], "not a byte size: 'lots'"),
    (
        "serve-memory-budget-too-small",
        {},
        ["serve", "--port", "0", "--model", "procedural", "--memory-budget", "1"],
        "a worker can hold no session: one session's state needs",
    ),
    ("serve-option-steps", {}, ["serve", "--port", "0", "--model-option", "steps=abc"], "steps must be noise levels"),
    (
        "serve-option-precision",
        {},
        ["serve", "--port", "0", "--model-option", "precision=float16"],
        "precision must be auto, bfloat16 or float32",
    ),
    (
        "serve-option-unknown",
        {},
        ["serve", "--port", "0", "--model", "procedural", "--model-option", "nosuch=1"],
        "unexpected keyword argument 'nosuch'",
    ),
    ("serve-option-device", {}, ["serve", "--port", "0", "--model-option", "{cuda}"], "{cuda_said}"),
    ("serve-option-no-equals", {}, ["serve", "--model-option", "steps"], "--model-option takes KEY=VALUE"),
    ("serve-port-in-use", {}, ["serve", "--port", "{busy}"], "cannot listen on 127.0.0.1:"),
    ("serve-unknown-host", {}, ["serve", "--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
    ("record-malformed-json", {"s.json": "{not json"}, ["record", "{dir}/s.json"], "is not JSON"),
    ("record-not-an-object", {"s.json": "[1, 2]"}, ["record", "{dir}/s.json"], "must be a JSON object"),
    ("record-chunks-ten", {"s.json": '{"chunks": "ten"}'}, ["record", "{dir}/s.json"], "'chunks' must be a positive"),
    ("record-missing-file", {}, ["record", "{dir}/nope.json"], "cannot read script"),
    # The output format is checked before anything connects (the server here is not there).
    ("record-avi", {"s.json": GOOD_SCRIPT}, ["record", "{dir}/s.json", "--out", "x.avi", "--url", "{dead}"], ".avi"),
    ("record-no-server", {"s.json": GOOD_SCRIPT}, ["record", "{dir}/s.json", "--url", "{dead}"], "cannot connect"),
    ("record-http-url", {"s.json": GOOD_SCRIPT}, ["record", "{dir}/s.json", "--url", "http://x/"], "ws:// or wss://"),
    ("replay-empty", {"j.jsonl": ""}, ["replay", "{dir}/j.jsonl"], "empty"),
    ("replay-missing", {}, ["replay", "{dir}/nope.jsonl"], "cannot read journal"),
    ("replay-cut-start", {"j.jsonl": _journal_lines()[0][:40]}, ["replay", "{dir}/j.jsonl"], "cut off in its first"),
    (
        "replay-unknown-model",
        {"j.jsonl": "\n".join(_journal_lines("nosuchmodel")) + "\n"},
        ["replay", "{dir}/j.jsonl"],
        "unknown model 'nosuchmodel'",
    ),
    (
        "replay-avi",
        {"j.jsonl": "\n".join(_journal_lines()) + "\n"},
        ["replay", "{dir}/j.jsonl", "--out", "a.avi"],
        ".avi",
    ),
    ("bench-no-server", {}, ["bench", "--url", "{dead}", "--clients", "1", "--duration", "1"], "cannot connect"),
    ("bench-http-url", {}, ["bench", "--url", "http://127.0.0.1:8000/v1/world"], "ws:// or wss://"),
    ("bench-stagger-negative", {}, ["bench", "--stagger", "-5"], "--stagger: must be zero or more"),
    ("bench-session-seconds-alone", {}, ["bench", "--session-seconds", "5"], "--session-seconds needs --arrival-rate"),
    ("bench-newcomers-negative", {}, ["bench", "--newcomers", "-1"], "--newcomers: must be zero or more"),
    ("bench-slack-negative", {}, ["bench", "--slack-frames", "-1"], "--slack-frames: must be zero or more"),
    ("serve-queue-timeout-0", {}, ["serve", "--queue-timeout-s", "0"], "--queue-timeout-s: must be more than 0"),
    ("serve-ray-connect-0", {}, ["serve", "--ray-connect-timeout-s", "0"], "--ray-connect-timeout-s: must be more"),
    ("inspect-missing", {}, ["inspect", "{dir}/nope.pt"], "no such file or folder"),
    # A part's file that is no weight file: named as that part, with the file, in the worker's one line.
    (
        "serve-broken-vae",
        {"Wan2.1_VAE.pth": "not a torch file"},
        ["serve", "--port", "0", "--model", "wan-causal", "--model-option", "vae={dir}/Wan2.1_VAE.pth"],
        "could not load model 'wan-causal': WeightsError: VAE {dir}/Wan2.1_VAE.pth: not a torch file",
    ),
    (
        "serve-broken-image-encoder",
        {"clip.pth": ""},
        ["serve", "--port", "0", "--model", "matrix-game-2", "--model-option", "image_encoder={dir}/clip.pth"],
        "WeightsError: image encoder {dir}/clip.pth: not a torch file: it is empty (0 bytes); expected Wan's OpenCLIP",
    ),
]


@pytest.mark.parametrize(("files", "args", "said"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, files: dict[str, str], args: list[str], said: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    dead = f"ws://127.0.0.1:{_closed_port()}/v1/world"
    with socket.socket() as busy:  # a port something listens on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fill = {"dir": tmp_path, "dead": dead, "busy": busy.getsockname()[1]}
        filled = [arg.format(**fill, cuda=_cuda_option() if "{cuda}" in arg else "") for arg in args]
        done = run(*filled)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"worldserve {filled[0]}: error: "), lines[0]
    expected = _cuda_said() if said == "{cuda_said}" else said.format(**fill)
    assert expected in lines[0], lines[0]
    assert done.stdout == ""
    assert not (tmp_path / "x.avi").exists()


def test_help_shows_every_option_with_its_help_and_default() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(subparsers.choices) == ["bench", "inspect", "record", "replay", "serve"]
    for name, sub in subparsers.choices.items():
        text = run(name, "--help").stdout
        flat = " ".join(text.split())
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, (name, action.option_strings)
            default = action.default
            if default is None or isinstance(default, bool) or default == []:
                continue  # a flag, or its help says what happens without it
            assert f"(default: {default})" in flat, (name, action.option_strings, default)
    assert run("--version").stdout.strip() == f"worldserve {__version__}"


def test_a_journal_cut_mid_line_replays_its_complete_prefix_with_a_warning(tmp_path: Path) -> None:
    lines = _journal_lines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines) + "\n" + lines[2][:25])  # the server died writing the next chunk line
    done = run("replay", str(cut), "--out", str(tmp_path / "cut.gif"), "--executor", "inprocess")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, done.stderr
    assert "cut.jsonl:4: the last line is cut off" in warnings[0]
    assert "replayed 2 chunks (8 frames)" in done.stdout

    unclosed = tmp_path / "unclosed.jsonl"
    unclosed.write_text("\n".join(lines) + "\n")
    done = run("replay", str(unclosed), "--out", str(tmp_path / "unclosed.gif"), "--executor", "inprocess")
    assert done.returncode == 0, done.stderr
    assert "no close line" in done.stderr
    assert "replayed 2 chunks (8 frames)" in done.stdout

    closed = tmp_path / "closed.jsonl"
    closed.write_text("\n".join([*lines, json.dumps({"type": "close"})]) + "\n")
    done = run("replay", str(closed), "--out", str(tmp_path / "closed.gif"), "--executor", "inprocess")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr

    middle = tmp_path / "middle.jsonl"  # a bad line that is not the last is not a crash's: refused, named
    middle.write_text("\n".join([lines[0], lines[1][:25], lines[2]]) + "\n")
    done = run("replay", str(middle), "--out", str(tmp_path / "middle.gif"), "--executor", "inprocess")
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1
    assert "middle.jsonl:2: not JSON" in done.stderr
