"""The batched quantized CPU matmul (kernels/cpu/csrc/cpu_quant_gemm.cpp) against oneDNN's
float32 linear over the same weights prepacked, as a decode step meets them, and, where the build
has AVX-512 VNNI or AVX2, the 16-bit-activation integer kernel (csrc/cpu_quant_gemm_vnni.cpp, or
csrc/cpu_quant_gemm_int16_avx2.cpp on AVX2).

`--layers` different random Q4_1 matrices of one shape (default 30 of 1536 x 576, SmolLM2-135M's
gate/up shape; their float32 copies, 106 MB, do not fit in L3, as the model's 425 MB do not) are
multiplied in turn by M float32 rows; ms per matmul, best of `--reps` passes, torch on 1 thread
(the CPU engine's default). Whichever path the build has (AVX-512 or AVX2+FMA) runs.

    PYTHONPATH=src python3 benchmarks/quant_gemm_microbench.py --rows 2,4,8,16,32,64,512

`--model-shapes` instead times only the 16-bit kernel (VNNI or AVX2) at SmolLM2-135M's shapes (qkv 960 x 576,
o_proj 576 x 576, gate_up 3072 x 576, down 576 x 1536 in Q4_1, the tied lm_head 49152 x 576 in
Q8_0), each over enough random copies to exceed the L3 as a decode step does, at `--rows` (default
64,128,512) and 1 and 2 threads, as G multiply-adds/s a thread; `--peak` first compiles and runs
benchmarks/vnni_peak.cpp (a tight `vpdpwssd` loop, and the tile's instruction mix) to compare with.

    PYTHONPATH=src python3 benchmarks/quant_gemm_microbench.py --model-shapes --peak
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def random_q4_1_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Valid Q4_1 block rows [n, k / 32 * 20]: float16 d and m, random quants."""
    rows = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
    rows[..., :4] = (rng.standard_normal((n, k // 32, 2)) * 0.05).astype(np.float16).view(np.uint8).reshape(n, -1, 4)
    return rows.reshape(n, -1)


def best_ms(fn, reps: int, per: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times) / per


def best_per_call_ms(fn, weights: list, reps: int) -> float:
    """Mean over the weight copies of each one's best call: on a shared machine a pass over all
    copies is rarely free of other jobs' time slices, one call usually is."""
    best = [float("inf")] * len(weights)
    for _ in range(reps):
        for i, w in enumerate(weights):
            start = time.perf_counter()
            fn(w)
            best[i] = min(best[i], time.perf_counter() - start)
    return 1000 * sum(best) / len(best)


def random_q8_0_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Valid Q8_0 block rows [n, k / 32 * 34]: float16 d, random int8 quants."""
    rows = rng.integers(0, 256, size=(n, k // 32, 34), dtype=np.uint8)
    rows[..., :2] = (np.abs(rng.standard_normal((n, k // 32, 1))) * 0.01).astype(np.float16).view(np.uint8)
    return rows.reshape(n, -1)


# name, N, K, quant type (0 = Q4_1, 1 = Q8_0): SmolLM2-135M's products (q/k/v and gate/up merged).
MODEL_SHAPES = [
    ("qkv", 960, 576, 0),
    ("o_proj", 576, 576, 0),
    ("gate_up", 3072, 576, 0),
    ("down", 576, 1536, 0),
    ("lm_head", 49152, 576, 1),
]


def run_peak() -> None:
    source = Path(__file__).with_name("vnni_peak.cpp")
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "vnni_peak")
        subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", str(source), "-o", binary], check=True)
        print("vpdpwssd tight loops (benchmarks/vnni_peak.cpp):")
        print(subprocess.run([binary], check=True, capture_output=True, text=True).stdout, end="")


def model_shapes(args: argparse.Namespace) -> None:
    from tokenmill.kernels.cpu.quant_gemv import gemm_vnni16_available
    from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows

    if not gemm_vnni16_available():
        raise SystemExit("this build has no 16-bit batched kernel (it needs AVX-512 VNNI or AVX2)")
    rng = np.random.default_rng(0)
    kernel = torch.ops.tokenmill_cpu.quant_linear_vnni16
    row_counts = [int(value) for value in (args.rows or "64,128,512").split(",")]
    threads = [int(t) for t in args.thread_counts.split(",")]
    columns = " ".join(f"{f'{t} thr ms':>9s} {'GMAC/s/thr':>10s}" for t in threads)
    print(f"{'shape':8s} {'N x K':>11s} {'rows':>5s} {columns}")
    totals = {t: {} for t in threads}
    for name, n, k, quant in MODEL_SHAPES:
        row_bytes = k // 32 * (20 if quant == 0 else 34)
        copies = max(1, min(30, (48 << 20) // (n * row_bytes)))  # > the L3, as a step's weights are
        make = random_q4_1_rows if quant == 0 else random_q8_0_rows
        weights = [torch.from_numpy(vnni_rows(make(rng, n, k), quant)) for _ in range(copies)]
        for m in row_counts:
            x = torch.randn(m, k)
            cells = []
            for t in threads:
                torch.set_num_threads(t)
                ms = best_per_call_ms(lambda w, x=x, q=quant: kernel(x, w, q), weights, args.reps)
                gmacs = m * n * k / ms / 1e6 / t
                totals[t][m] = totals[t].get(m, 0.0) + ms * (1 if name == "lm_head" else 30)
                cells.append(f"{ms:9.3f} {gmacs:10.1f}")
            print(f"{name:8s} {n:5d} x {k:4d} {m:5d} " + " ".join(cells))
    # A decode step's mix: 30 layers of each product and one lm_head, at the same row count.
    for t in threads:
        parts = []
        for m in row_counts:
            macs = sum(m * n * k * (1 if name == "lm_head" else 30) for name, n, k, _ in MODEL_SHAPES)
            parts.append(f"rows {m}: {totals[t][m]:.1f} ms, {macs / totals[t][m] / 1e6 / t:.1f} GMAC/s/thr")
        print(f"one step's products (30 layers + lm_head), {t} thread(s): " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows", default=None, help="comma-separated activation row counts (default 2,4,8,16,32,64; 64,128,512)"
    )
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-shapes", action="store_true", help="the VNNI kernel at SmolLM2-135M's shapes")
    parser.add_argument("--thread-counts", default="1,2", help="with --model-shapes")
    parser.add_argument("--peak", action="store_true", help="first run benchmarks/vnni_peak.cpp")
    args = parser.parse_args()
    if args.peak:
        run_peak()
    if args.model_shapes:
        from tokenmill.kernels.cpu.build import build_directory, load_cpu_kernels

        load_cpu_kernels()
        print(f"kernels: {build_directory()}")
        model_shapes(args)
        return

    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from tokenmill.kernels.cpu.build import load_cpu_kernels
    from tokenmill.kernels.cpu.quant_gemv import (
        QuantizedBlocks,
        gemm_available,
        gemm_vnni16_available,
        quantized_linear,
        split_rows,
    )
    from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows

    load_cpu_kernels()
    if not gemm_available():
        raise SystemExit("this build has no batched quantized kernel (needs AVX-512 or AVX2+FMA)")
    torch.set_num_threads(args.threads)
    n, k = args.out_features, args.in_features
    rng = np.random.default_rng(0)
    rows = [random_q4_1_rows(rng, n, k) for _ in range(args.layers)]
    packed = [
        torch.ops.mkldnn._reorder_linear_weight(
            torch.from_numpy(dequantize(r, GGMLQuantizationType.Q4_1).astype(np.float32)), 64
        )
        for r in rows
    ]
    blocks = [QuantizedBlocks(torch.from_numpy(split_rows(r, 0)), 0, n) for r in rows]
    vnni = [torch.from_numpy(vnni_rows(r, 0)) for r in rows] if gemm_vnni16_available() else []
    print(f"{args.layers} x [{n}, {k}] Q4_1, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    for m in (int(value) for value in (args.rows or "2,4,8,16,32,64").split(",")):
        x = torch.randn(m, k)
        onednn = best_ms(
            lambda x=x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],
            args.reps, args.layers,
        )  # fmt: skip
        quant = best_ms(lambda x=x: [quantized_linear(x, b, None) for b in blocks], args.reps, args.layers)
        line = f"rows {m:4d}: oneDNN float32 {onednn:7.3f} ms, quant_gemm {quant:7.3f} ms, ratio {onednn / quant:5.2f}"
        if vnni:
            vnni16 = best_ms(
                lambda x=x: [torch.ops.tokenmill_cpu.quant_linear_vnni16(x, v, 0) for v in vnni], args.reps, args.layers
            )
            line += f", vnni16 {vnni16:7.3f} ms (vs quant_gemm {quant / vnni16:5.2f}x, vs oneDNN {onednn / vnni16:5.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
