"""tinyworld's float32 denoising in other runtimes: ``python bench/tinyworld_runtimes.py``.

Exports one chunk's denoising (all the sampler's steps, after the per-chunk work of
:class:`~worldserve.models.tinyworld.accel.FastSampler`, with the cache in front; batch
dynamic) from the shipped weights to ONNX, and times it per chunk in ONNX Runtime and
OpenVINO (whichever is installed; neither is a dependency of worldserve) against
``accel="eager"`` in PyTorch, in alternation, repeat after repeat, at each of ``--batches``
with a full cache. Prints ms per chunk (medians), each runtime's speed-up over eager (the
median of per-repeat ratios) and its largest |x0| difference from the reference path.

ISA caps, for standing in for an AVX2-only CPU (``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``): OpenVINO's oneDNN kernels honour
``ONEDNN_MAX_CPU_ISA`` (the table's last line names the convolution kernels it ran), but
its and ONNX Runtime's MLAS kernels pick the widest ISA the CPU has, with no cap; so on a
CPU with AVX-512, compare all runtimes without the caps too. Needs ``onnx`` (and
``onnxscript``) for the export.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tinyworld import print_table
from worldserve.models.tinyworld.accel import FastSampler
from worldserve.models.tinyworld.cache import KVCache, gather
from worldserve.models.tinyworld.network import TinyWorldNet, _timestep_features
from worldserve.models.tinyworld.sampler import encode_keyframes, sample_chunk
from worldserve.models.tinyworld.weights import load_net

INPUTS = ("noise", "conds", "share", "shifted", "ctx_k", "ctx_v", "mask")


class ChunkGraph(nn.Module):
    """One chunk's denoising steps as one graph, through :meth:`FastSampler._denoise_step`.

    Inputs: noise [steps, B, F, 3, H, W]; conds [steps, B, F, dim] (each step's conditioning);
    share [B*F, C, H, W] and shifted [B*F, 3, H, W] (the motion path's per-chunk terms);
    ctx_k, ctx_v [depth, B, S, dim] (the caches); mask bool [B, 1, 1, S + F*P].
    """

    def __init__(self, fast: FastSampler) -> None:
        super().__init__()
        self.fast = fast
        self.steps = fast.config.steps

    def forward(
        self, noise: Tensor, conds: Tensor, share: Tensor, shifted: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor
    ) -> Tensor:
        b, f = noise.shape[1], noise.shape[2]
        tokens = f * self.fast.config.tokens_per_frame
        pad = ctx_k.new_zeros(b, tokens, ctx_k.shape[-1])
        keys = [torch.cat([ctx_k[layer], pad], dim=1) for layer in range(ctx_k.shape[0])]
        values = [torch.cat([ctx_v[layer], pad], dim=1) for layer in range(ctx_v.shape[0])]
        x = noise[0]
        x0 = x
        for index in range(len(self.steps)):
            x0 = self.fast._denoise_step(x, conds[index], share, shifted, keys, values, mask)
            if index + 1 < len(self.steps):
                following = self.steps[index + 1]
                x = (1.0 - following) * x0 + following * noise[index + 1]
        return x0.clamp(-1.0, 1.0)


def graph_inputs(
    fast: FastSampler, caches: list[KVCache], noise: Tensor, text: Tensor, controls: Tensor, keyframe: Tensor
) -> tuple[Tensor, ...]:
    """The per-chunk work of :meth:`FastSampler.sample_chunk`, as the graph's inputs."""
    config = fast.config
    b, f = controls.shape[:2]
    context, valid = gather(caches)
    ctx_k = torch.stack([k for k, _ in context])
    ctx_v = torch.stack([v for _, v in context])
    mask = torch.cat([valid, valid.new_ones(b, f * config.tokens_per_frame)], dim=1)[:, None, None]
    static = fast._static_conditioning(text, controls)
    shifted, share = fast._keyframe_share(keyframe, controls)
    t_mlp = fast.net.conditioner.t_mlp
    conds = torch.stack([static + t_mlp(_timestep_features(torch.full((1,), level), 64)) for level in config.steps])
    assert shifted is not None, "the shipped network has the motion path"
    return noise, conds, share.contiguous(), shifted.contiguous(), ctx_k, ctx_v, mask


def chunk_inputs(net: TinyWorldNet, sessions: int, seed: int) -> tuple[Any, ...]:
    """Caches holding a full window of random keyframes, and one chunk's noise and conditioning."""
    config = net.config
    generator = torch.Generator().manual_seed(seed)
    caches = [KVCache(config) for _ in range(sessions)]
    size = (config.height, config.width)
    for _ in range(config.cache_slots + 1):
        frames = torch.rand((sessions, 3, *size), generator=generator) * 2 - 1
        text = torch.randint(0, config.text_buckets, (sessions, config.max_words), generator=generator)
        encode_keyframes(net, caches, frames, text, torch.randn((sessions, 4), generator=generator) * 2)
    f = config.frames_per_chunk
    noise = torch.randn((len(config.steps), sessions, f, 3, *size), generator=generator)
    text = torch.randint(0, config.text_buckets, (sessions, config.max_words), generator=generator)
    controls = torch.randn((sessions, f, 4), generator=generator) * 3
    keyframe = torch.rand((sessions, 3, *size), generator=generator) * 2 - 1
    return caches, noise, text, controls, keyframe


def export(fast: FastSampler, path: Path) -> None:
    example = graph_inputs(fast, *chunk_inputs(fast.net, 2, 0))
    batch = {"noise": {1: "b"}, "conds": {1: "b"}, "share": {0: "bf"}, "shifted": {0: "bf"}}
    batch |= {"ctx_k": {1: "b"}, "ctx_v": {1: "b"}, "mask": {0: "b"}, "x0": {0: "b"}}
    torch.onnx.export(
        ChunkGraph(fast).eval(),
        example,
        str(path),
        dynamo=False,
        opset_version=18,
        input_names=list(INPUTS),
        output_names=["x0"],
        dynamic_axes=batch,
    )


def runners(
    fast: FastSampler, path: Path, threads: int, wanted: list[str]
) -> tuple[dict[str, Callable[..., Tensor]], str]:
    """Each runtime's chunk function (same arguments as :meth:`FastSampler.sample_chunk`), and notes."""
    notes = []

    def feeds(args: tuple[Any, ...]) -> dict[str, np.ndarray]:
        return {name: tensor.numpy() for name, tensor in zip(INPUTS, graph_inputs(fast, *args), strict=True)}

    out: dict[str, Callable[..., Tensor]] = {"eager": lambda *args: fast.sample_chunk(*args)}
    if "onnxruntime" in wanted:
        if importlib.util.find_spec("onnxruntime") is None:
            notes.append("onnxruntime: not installed")
        else:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            out["onnxruntime"] = lambda *args: torch.from_numpy(session.run(None, feeds(args))[0])
            notes.append(f"onnxruntime {ort.__version__} (MLAS: no ISA cap)")
    if "openvino" in wanted:
        if importlib.util.find_spec("openvino") is None:
            notes.append("openvino: not installed")
        else:
            import openvino as ov

            core = ov.Core()
            config = {
                "INFERENCE_PRECISION_HINT": "f32",
                "INFERENCE_NUM_THREADS": threads,
                "PERFORMANCE_HINT": "LATENCY",
            }
            compiled = core.compile_model(core.read_model(str(path)), "CPU", config | {"PERF_COUNT": True})
            request = compiled.create_infer_request()

            def run_openvino(*args: Any) -> Tensor:
                request.infer(feeds(args))
                return torch.from_numpy(request.get_output_tensor(0).data.copy())

            out["openvino"] = run_openvino
            run_openvino(*chunk_inputs(fast.net, 1, 0))
            kernels = collections.Counter(
                item.exec_type for item in request.profiling_info if item.node_type == "Convolution"
            )
            notes.append(f"openvino {ov.__version__} (convolution kernels: {', '.join(sorted(kernels))})")
    return out, "; ".join(notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--runtimes", nargs="+", choices=["onnxruntime", "openvino"], default=["onnxruntime", "openvino"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats; medians are reported")
    parser.add_argument("--chunks", type=int, default=6, help="timed chunks per runtime per repeat (median)")
    args = parser.parse_args()
    if importlib.util.find_spec("onnx") is None:
        print("the ONNX export needs the onnx package (pip install onnx onnxscript); nothing compared", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    net = load_net().eval()
    fast = FastSampler(net)
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        path = Path(folder) / "tinyworld_chunk.onnx"
        started = time.perf_counter()
        export(fast, path)
        print(f"exported in {time.perf_counter() - started:.1f} s ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
        runs, notes = runners(fast, path, threads, args.runtimes)
        worst: dict[tuple[str, int], float] = {}
        for sessions in args.batches:
            inputs = chunk_inputs(net, sessions, sessions)
            reference = sample_chunk(net, *inputs)
            for name, run in runs.items():
                worst[(name, sessions)] = float((run(*inputs) - reference).abs().max())
        times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1} of {args.repeats}", flush=True)
            for sessions in args.batches:
                inputs = chunk_inputs(net, sessions, sessions)
                for name, run in runs.items():
                    run(*inputs)
                    samples = []
                    for _ in range(args.chunks):
                        started = time.perf_counter()
                        run(*inputs)
                        samples.append(time.perf_counter() - started)
                    times[(name, sessions)].append(1000 * statistics.median(samples))
    caps = " ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ)
    print(
        f"\ntinyworld chunk denoising ({len(net.config.steps)} steps, full cache), float32, {threads} threads, "
        f"torch {torch.__version__}, caps: {caps or 'none'}; ms per chunk (median of {args.repeats} alternating "
        f"repeats), speed-up over eager (median of per-repeat ratios), largest |x0 - reference| (Δx0)"
    )
    others = [name for name in runs if name != "eager"]
    header = ["sessions", *runs, *(f"{name} vs eager" for name in others), *(f"Δx0 {name}" for name in runs)]
    rows = [header]
    for sessions in args.batches:
        eager = times[("eager", sessions)]
        row = [str(sessions)]
        row += [f"{statistics.median(times[(name, sessions)]):.1f} ms" for name in runs]
        row += [
            f"{statistics.median([e / o for e, o in zip(eager, times[(name, sessions)], strict=True)]):.2f}x"
            for name in others
        ]
        row += [f"{worst[(name, sessions)]:.1e}" for name in runs]
        rows.append(row)
    print_table(rows)
    print(notes, f"; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
