"""The CPU's one-row GGUF matmul kernels on the default model's shapes, alternating in one run:
the float-activation kernel (csrc/cpu_quant_gemv.cpp) against the integer-activation one
(csrc/cpu_quant_gemv_int8.cpp, 16- and 8-bit activations; AVX-512 VNNI or AVX2, whichever this
build has). Weights are random valid blocks of each shape's type; each call reads a fresh copy
of the weights (a ring of copies larger than the last-level cache), as a decode step does.
Times are this thread's CPU time a call (--threads 1 runs the kernels on the calling thread), which
other jobs' load on a shared machine moves much less than wall time.

    PYTHONPATH=src python benchmarks/cpu_gemv_microbench.py --threads 1 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

# (name, out_features, in_features, kernel quant code) of SmolLM2-135M's matmuls: 30 layers of the
# first four, one tied Q8_0 lm_head.
SHAPES = [
    ("qkv_proj", 960, 576, 0),
    ("o_proj", 576, 576, 0),
    ("gate_up_proj", 3072, 576, 0),
    ("down_proj", 576, 1536, 0),
    ("lm_head", 49152, 576, 1),
]
_BLOCK_BYTES = {0: 20, 1: 34}


def _random_rows(rng: np.random.Generator, code: int, n: int, k: int) -> np.ndarray:
    rows = rng.integers(0, 256, size=(n, k // 32, _BLOCK_BYTES[code]), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // 32, 2)) * 0.05).astype(np.float16).view(np.uint8)
    rows[..., : 2 * (2 if code == 0 else 1)] = scales[..., : 2 * (2 if code == 0 else 1)]
    return rows.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU times are the kernels')")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (median reported)")
    parser.add_argument("--calls", type=int, default=20, help="calls a round per shape and kernel")
    parser.add_argument("--ring-mb", type=int, default=256, help="weights copies cycled through, MB per kernel")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    args = parser.parse_args()

    from tokenmill.kernels.cpu.build import load_cpu_kernels
    from tokenmill.kernels.cpu.quant_gemv import split_rows
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_available, int8_isa, vnni_rows

    load_cpu_kernels()
    torch.set_num_threads(args.threads)
    ops = torch.ops.tokenmill_cpu
    rng = np.random.default_rng(0)
    kernels = ["float"] + (["int16", "int8"] if int8_available() else [])
    results: dict[str, dict[str, float]] = {}
    for name, n, k, code in SHAPES:
        rows = _random_rows(rng, code, n, k)
        copies = max(1, args.ring_mb * 2**20 // rows.nbytes)
        plain = [torch.from_numpy(split_rows(rows, code)) for _ in range(copies)]
        packed = [torch.from_numpy(vnni_rows(rows, code)) for _ in range(copies)] if int8_available() else []
        x = torch.randn(1, k)
        out = torch.empty(1, n)
        times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
        for _ in range(args.rounds):
            for kernel in kernels:
                started = time.thread_time()
                for i in range(args.calls):
                    if kernel == "float":
                        ops.quant_gemv(out, x, plain[i % copies], code)
                    else:
                        ops.quant_gemv_int8(out, x, packed[i % copies], code, 16 if kernel == "int16" else 8)
                times[kernel].append(1e6 * (time.thread_time() - started) / args.calls)
        results[name] = {kernel: statistics.median(t) for kernel, t in times.items()}
        line = ", ".join(f"{kernel} {us:.0f} us" for kernel, us in results[name].items())
        ratios = ", ".join(f"float/{kn} {results[name]['float'] / results[name][kn]:.2f}x" for kn in kernels[1:])
        print(f"{name} [{n} x {k}, {'Q4_1' if code == 0 else 'Q8_0'}]: {line}; {ratios}")
    # One decode step's matmuls: 30 layers of the four, plus the lm_head.
    step = {
        kernel: sum(results[name][kernel] * (1 if name == "lm_head" else 30) for name, *_ in SHAPES) / 1000
        for kernel in kernels
    }
    print("decode step's matmuls (ms): " + ", ".join(f"{kernel} {ms:.2f}" for kernel, ms in step.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"isa": int8_isa(), "threads": args.threads, "per_call_us": results, "step_matmuls_ms": step}, f, indent=1
            )


if __name__ == "__main__":
    main()
