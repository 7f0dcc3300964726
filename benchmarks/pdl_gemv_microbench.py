"""Does programmatic dependent launch (PDL) let a batch-1 GEMV hide its weight reads behind the
latency-bound kernel before it?

In a batch-1 decode step the attention launch (~9 us) and the norm launches (~2 us) read almost
nothing from HBM, yet the matmul after each waits for them before it reads a byte of its weight,
and cuBLAS's o_proj / qkv run at only 0.65-0.75 of copy bandwidth (ramp-up and tail). With PDL
(Hopper's griddepcontrol) the GEMV's programs launch while the kernel before them still runs,
load their weight tiles into registers, and only then wait for the input vector.

Each variant is timed as one CUDA graph of 32 "layers" over 32 distinct weights: a latency-bound
primary kernel (a dependent arithmetic loop on a few programs, tuned to a given duration, which
writes the GEMV's input) followed by the GEMV. Reported: us per layer, and the GEMV's share
(layer minus the primary alone).

    PYTHONPATH=src python benchmarks/pdl_gemv_microbench.py [o_proj qkv gate_up down]
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from decode_layer_microbench import time_graph  # benchmarks/ is on sys.path when run as a script
from gemv_microbench import split_k_finish

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _busy_kernel(y_prev_ptr, x_ptr, N_PREV, K, ITERS, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """The stand-in for attention / a norm: reads the previous GEMV's output, spins ITERS
    dependent steps, writes the next GEMV's input."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < K
    v = tl.load(y_prev_ptr + offs % N_PREV, mask=ok, other=0.0).to(tl.float32)
    for _ in range(ITERS):
        v = v * 0.999 + 0.001
    tl.store(x_ptr + offs, v.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_pdl_kernel(
    x_ptr,  # [K]
    w_ptr,  # [K, N] row-major (in-major weight)
    y_ptr,  # [N]
    partial_ptr,  # float32 [SPLIT_K, N]
    counter_ptr,  # int32 [cdiv(N, BLOCK_N)], zero between calls
    N,
    K,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRE_K: tl.constexpr,  # rows of this split's slab loaded before waiting for x
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_begin = pid_k * K_PER_SPLIT
    pre = k_begin + tl.arange(0, PRE_K)
    pre_ok = pre < K
    # The weight does not depend on the kernel before us: load it while that kernel runs.
    w_pre = tl.load(w_ptr + pre[:, None].to(tl.int64) * N + cols[None, :], mask=pre_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
    if PDL:
        gdc_wait()
    x_pre = tl.load(x_ptr + pre, mask=pre_ok, other=0.0).to(tl.float32)
    partial = tl.sum(w_pre.to(tl.float32) * x_pre[:, None], axis=0)
    if K_PER_SPLIT > PRE_K:
        rows = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for k0 in range(PRE_K, K_PER_SPLIT, BLOCK_K):
            k = k_begin + k0 + rows
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + k[:, None].to(tl.int64) * N + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            acc += w.to(tl.float32) * x[:, None]
        partial += tl.sum(acc, axis=0)
    if PDL:
        gdc_launch_dependents()
    split_k_finish(
        partial, y_ptr, y_ptr, partial_ptr, counter_ptr, cols, col_ok, pid_n, pid_k, N, SPLIT_K, False
    )


@dataclass(frozen=True, slots=True)
class Config:
    block_n: int
    split_k: int
    pre_k: int  # 0: none (PRE_K = BLOCK_K then, loaded after the wait)
    num_warps: int
    block_k: int = 64


class Workspace:
    def __init__(self, device: torch.device, max_n: int, max_split: int = 64) -> None:
        self.partials = torch.empty(max_split * max_n, dtype=torch.float32, device=device)
        self.counters = torch.zeros(triton.cdiv(max_n, 16), dtype=torch.int32, device=device)


def gemv(x, w_in_major, y, ws: Workspace, c: Config, pdl: bool) -> None:
    k, n = w_in_major.shape
    k_per_split = k // c.split_k
    pre_k = c.pre_k if c.pre_k else c.block_k
    grid = (triton.cdiv(n, c.block_n), c.split_k)
    _gemv_pdl_kernel[grid](
        x, w_in_major, y, ws.partials, ws.counters, n, k,
        K_PER_SPLIT=k_per_split, SPLIT_K=c.split_k, PRE_K=pre_k, PDL=pdl,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, launch_pdl=pdl,
    )  # fmt: skip


def busy(y_prev, x, iters: int, pdl: bool) -> None:
    k = x.numel()
    block = 64
    _busy_kernel[(triton.cdiv(k, block),)](
        y_prev, x, y_prev.numel(), k, iters, PDL=pdl, BLOCK=block, num_warps=2, launch_pdl=pdl
    )


def graph_us(calls, reps: int = 20) -> float:
    """us per replay of one CUDA graph of `calls` (median of 5 timings of `reps` replays)."""
    return time_graph(lambda: [call() for call in calls], reps) * 1000


SHAPES = {  # name: (N, K, primary duration in us it stands in for)
    "o_proj": (4096, 4096, 9.0),
    "qkv": (6144, 4096, 2.3),
    "gate_up": (28672, 4096, 2.3),
    "down": (4096, 14336, 1.5),
}
LAYERS = 32


def bench_shape(name: str, n: int, k: int, primary_us: float, ws: Workspace) -> tuple[float, float]:
    """Prints the variants for one shape; returns (cuBLAS's share, the best share) in us."""
    device = torch.device("cuda")
    weights = [torch.randn(k, n, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]
    xs = [torch.empty(k, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ys = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(LAYERS + 1)]

    # Tune the primary's loop to the duration of the kernel it stands in for.
    iters, alone = 1, 0.0
    for iters in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        alone = (
            graph_us([lambda i=i, it=iters: busy(ys[i], xs[i], it, False) for i in range(LAYERS)]) / LAYERS
        )
        if alone >= primary_us:
            break

    def layers(kind: str, c: Config | None = None, pdl_primary: bool = False) -> list:
        calls = []
        for i in range(LAYERS):
            calls.append(lambda i=i: busy(ys[i], xs[i], iters, pdl_primary))
            if kind == "cublas":
                calls.append(lambda i=i: torch.matmul(xs[i].view(1, k), weights[i], out=ys[i + 1].view(1, n)))
            else:
                calls.append(lambda i=i: gemv(xs[i], weights[i], ys[i + 1], ws, c, kind == "pdl"))
        return calls

    def check(c: Config, pdl: bool) -> float:
        """Relative error against a float32 product, fresh data, output poisoned first."""
        x = torch.randn(k, device=device, dtype=torch.bfloat16)
        y = torch.full((n,), float("nan"), device=device, dtype=torch.bfloat16)
        gemv(x, weights[0], y, ws, c, pdl)
        ref = x.float() @ weights[0].float()
        return ((y.float() - ref).norm() / ref.norm()).item()

    rows: list[tuple[str, Config | None, float]] = [("cublas", None, graph_us(layers("cublas")) / LAYERS)]
    configs = []
    for block_n, split_k, warps in itertools.product((64, 128, 256), (4, 8, 16, 32, 64), (4, 8)):
        k_per_split = k // split_k
        if k_per_split < 64 or k % split_k or n % block_n:
            continue
        for pre in sorted({min(k_per_split, 256), min(k_per_split, 512), k_per_split}):
            if pre * block_n > 128 * 512:  # more than ~128 KB of bf16 registers a program
                continue
            configs.append(Config(block_n=block_n, split_k=split_k, pre_k=pre, num_warps=warps))
    for c in configs:
        try:
            err = check(c, True)
        except Exception as e:  # a config Triton cannot compile (registers): say so, go on
            print(f"  {name} {c}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if not err < 1e-2:
            print(f"  {name} {c}: relative error {err:.2e}, skipped")
            continue
        rows.append(("pdl", c, graph_us(layers("pdl", c)) / LAYERS))
    best_pdl = sorted((r for r in rows if r[0] == "pdl"), key=lambda r: r[2])[:3]
    for _, c, _ in best_pdl:
        rows.append(("triton-no-pdl", c, graph_us(layers("plain", c)) / LAYERS))
        rows.append(("pdl+pdl-primary", c, graph_us(layers("pdl", c, pdl_primary=True)) / LAYERS))
    print(f"{name}: N={n} K={k}; primary alone {alone:.2f} us/layer ({iters} iters)")
    for kind, c, us in sorted(rows, key=lambda r: r[2])[:12] + [rows[0]]:
        print(f"  {us:7.2f} us/layer  gemv share {us - alone:6.2f}  {kind:16s} {c}", flush=True)
    return rows[0][2] - alone, min(r[2] for r in rows) - alone


def main() -> None:
    if gdc_wait is None:
        sys.exit("this Triton has no triton.language.extra.cuda.gdc_wait")
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__)
    ws = Workspace(torch.device("cuda"), max_n=28672)
    names = sys.argv[1:] or list(SHAPES)
    summary = {name: bench_shape(name, *SHAPES[name], ws) for name in names}
    for name, (cublas, best) in summary.items():
        print(f"{name:8s} cuBLAS share {cublas:6.2f} us, best {best:6.2f} us: {cublas - best:+.2f} us/layer")


if __name__ == "__main__":
    main()
