"""Decode matmuls of 2-8 rows (a few requests decoding): cuBLAS against a Triton skinny GEMM.

The row GEMV (layers/gemv.py) serves one row; from two rows on it re-reads x per output column
and loses to cuBLAS. Here each program takes BLOCK_N output columns (out-major weight rows) and
all rows of x padded to 16, multiplies [BLOCK_N, BLOCK_K] weight tiles by [BLOCK_K, 16] x tiles
on the tensor cores (tl.dot) with Triton's software pipelining keeping several weight tiles in
flight, and reduces over K in registers: no split, one launch. Timed like row_gemv_microbench.py:
one CUDA graph of 32 matmuls over distinct weights (lm_head: 4), us per matmul, fraction of copy.

    PYTHONPATH=src:benchmarks python3 benchmarks/skinny_gemm_microbench.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemv_microbench import graph_ms  # benchmarks/ is on sys.path when run as a script

from tokenmill.bench.latency import copy_bandwidth

SHAPES = {  # name: (out, in, copies)
    "qkv": (6144, 4096, 32),
    "o_proj": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 4),
}
ROWS = (2, 8)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k[None, :], eviction_policy="evict_first")
        x = tl.load(x_ptr + rows[None, :] * stride_xm + k[:, None], mask=row_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None]
    )


def skinny_gemm(x, w, y, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    _skinny_gemm_kernel[(n // block_n,)](
        x, w, y, m, n, k, x.stride(0), y.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


CONFIGS = [
    (n, k, w, s)
    for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8), (4, 5, 6, 7))
    if n * k <= 16384 and s * (n + 16) * k * 2 <= 200 * 1024  # the pipeline's tiles fit in shared memory
]


def main() -> None:
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per matmul (fraction of copy bandwidth)")
    device = torch.device("cuda")
    for name, (n, k, copies) in SHAPES.items():
        ideal_us = n * k * 2 / bandwidth * 1e6
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            cublas = graph_ms([lambda w=w, x=x: F.linear(x, w) for w in weights]) * 1000 / copies
            expected = (x.float() @ weights[0].float().t()).to(torch.bfloat16).float()
            timed = {}
            for config in CONFIGS:
                try:
                    got = skinny_gemm(x, weights[0], y, *config).float()
                    err = ((got - expected).norm() / expected.norm()).item()
                    if err > 1e-2:
                        print(f"  {name} rows {m} {config}: relative error {err:.1e}, skipped")
                        continue
                    timed[config] = (
                        graph_ms([lambda w=w, x=x, y=y, c=config: skinny_gemm(x, w, y, *c) for w in weights])
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
