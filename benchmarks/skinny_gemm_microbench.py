"""Decode matmuls of 2-8 rows (a few requests decoding): cuBLAS against a Triton skinny GEMM.

The row GEMV (kernels/triton/gemv.py) serves one row; from two rows on it re-reads x per output column
and loses to cuBLAS. The skinny GEMM (kernels/triton/skinny_gemm.py; this script carried its own copy of
the kernel, the same loads, dot and store, until the engine had one) gives each program BLOCK_N
output columns (out-major weight rows) and all rows of x padded to 16, multiplies
[BLOCK_N, BLOCK_K] weight tiles by [BLOCK_K, 16] x tiles on the tensor cores (tl.dot) with
Triton's software pipelining keeping several weight tiles in flight, and reduces over K in
registers: no split, one launch. This script sweeps its (BLOCK_N, BLOCK_K, num_warps,
num_stages), timed like row_gemv_microbench.py: one CUDA graph of 32 matmuls over distinct
weights (lm_head: 4), us per matmul, fraction of copy bandwidth.

    PYTHONPATH=src python3 benchmarks/skinny_gemm_microbench.py
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from tokenmill.bench.latency import copy_bandwidth
from tokenmill.bench.timing import graph_ms
from tokenmill.kernels.triton.skinny_gemm import skinny_gemm

SHAPES = {  # name: (out, in, copies)
    "qkv": (6144, 4096, 32),
    "o_proj": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 4),
}
ROWS = (2, 8)  # (the first H200 run, results/skinny-gemm-microbench-h200-run1.txt, also had 1 and 4)


CONFIGS = [
    (n, k, w, s)
    for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8), (4, 5, 6, 7))
    if n * k <= 16384 and s * (n + 16) * k * 2 <= 200 * 1024  # the pipeline's tiles fit in shared memory
]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per matmul (fraction of copy bandwidth)")
    device = torch.device("cuda")
    for name, (n, k, copies) in SHAPES.items():
        ideal_us = n * k * 2 / bandwidth * 1e6
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            cublas = graph_ms([lambda w=w, x=x: F.linear(x, w) for w in weights]) * 1000 / copies
            expected = (x.float() @ weights[0].float().t()).to(torch.bfloat16).float()
            timed = {}
            for config in CONFIGS:
                try:
                    got = skinny_gemm(x, weights[0], config=config).float()
                    err = ((got - expected).norm() / expected.norm()).item()
                    if err > 1e-2:
                        print(f"  {name} rows {m} {config}: relative error {err:.1e}, skipped")
                        continue
                    timed[config] = (
                        graph_ms([lambda w=w, x=x, c=config: skinny_gemm(x, w, config=c) for w in weights])
                        * 1000
                        / copies
                    )
                except Exception as exc:  # a config the compiler rejects (shared memory): report, go on
                    print(f"  {name} rows {m} {config}: {type(exc).__name__}: {str(exc)[:120]}")
            best = sorted(timed, key=timed.get)[:3]
            cells = "  ".join(f"{c} {timed[c]:.2f} ({ideal_us / timed[c]:.3f})" for c in best)
            print(
                f"  {name:8s} rows {m}: cublas {cublas:.2f} ({ideal_us / cublas:.3f})  best: {cells}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
