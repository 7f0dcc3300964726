"""Batch-1 decode matmuls of Llama-3.1-8B: cuBLAS (F.linear) against a Triton weight-streaming kernel.

Each shape is timed as one CUDA graph of 32 matmuls over 32 distinct weight matrices (one per
layer, as a decode step reads them), so the L2 cache holds none of them and launch gaps are those
of a graph replay. Rates count the weight bytes read; the fraction is against a device-to-device
copy's bandwidth (bytes read + written), the roofline of `tokenmill bench latency`.

    PYTHONPATH=src python benchmarks/gemv_microbench.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.bench.latency import copy_bandwidth

# -- the candidate: a weight-streaming Triton kernel -------------------------------------------
# Each program owns BLOCK_N output columns and walks K in [BLOCK_N, BLOCK_K] weight tiles; one row
# of x is reduced with multiply-adds, or rows are padded to a 16-row tensor-core tile (use_dot).
# On an H200 it lost to cuBLAS on every shape but lm_head (see BENCHMARKS.md), so the engine
# keeps F.linear; the kernel stays here so the comparison can be rerun.


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = False  # tensor-core tile (rows padded to 16) instead of multiply-add reduction


@triton.jit
def _skinny_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_valid = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = (k0 + rk) < K
        w = tl.load(w_ptrs, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_valid[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        else:  # BLOCK_M == 1
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_valid[None, :])


MAX_ROWS = 16


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 16, K] (last dimension contiguous), weight [N, K]."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.shape[1] != k:
        raise ValueError(
            f"skinny_linear takes x [<= {MAX_ROWS}, K] and weight [N, K] contiguous in K; got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    config = config or GemvConfig()
    use_dot = config.use_dot or num_rows > 1
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    _skinny_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=16 if use_dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_DOT=use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y


SHAPES = {  # name: (N, K, copies)
    "qkv": (6144, 4096, 32),
    "o_proj": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 2),
}
CONFIGS = [
    GemvConfig(16, 512, 4, 4),
    GemvConfig(16, 256, 4, 4),
    GemvConfig(32, 256, 4, 4),
    GemvConfig(32, 512, 8, 4),
    GemvConfig(16, 1024, 8, 3),
    GemvConfig(64, 128, 4, 4),
    GemvConfig(8, 1024, 4, 4),
    GemvConfig(16, 512, 4, 4, use_dot=True),
]


def graph_ms(calls) -> float:
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def main() -> None:
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    totals = {"cublas": 0.0, "triton_best": 0.0}
    total_bytes = 0
    best_configs = {}
    for name, (n, k, copies) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = copies * n * k * 2
        reference = F.linear(x, weights[0]).float()
        results = {"cublas": graph_ms([lambda w=w, x=x: F.linear(x, w) for w in weights])}
        # Other cuBLAS entry points for one row: gemv (torch.mv), and the weight stored K-major.
        x_row = x[0]
        results["cublas_mv"] = graph_ms([lambda w=w, v=x_row: torch.mv(w, v) for w in weights])
        weights_t = [w.t().contiguous() for w in weights]
        results["cublas_k_major"] = graph_ms([lambda w=w, x=x: torch.mm(x, w) for w in weights_t])
        del weights_t
        for config in CONFIGS:
            out = skinny_linear(x, weights[0], config=config).float()
            err = ((out - reference).norm() / reference.norm()).item()
            if err > 1e-2:
                print(f"  {name} {config}: relative error {err:.2e}, skipped")
                continue
            results[str(config)] = graph_ms(
                [lambda w=w, c=config, x=x: skinny_linear(x, w, config=c) for w in weights]
            )
        best = min((key for key in results if not key.startswith("cublas")), key=results.get)
        best_configs[name] = best
        scale = (32 / copies) if name != "lm_head" else 1 / copies  # per decode step: 32 layers, 1 lm_head
        totals["cublas"] += results["cublas"] * scale
        totals["triton_best"] += results[best] * scale
        total_bytes += nbytes * scale
        for key, ms in sorted(results.items(), key=lambda kv: kv[1]):
            rate = nbytes / (ms / 1000)
            print(
                f"  {name:8s} {ms * 1000 / copies:8.1f} us/matmul  {rate / 1e9:7.0f} GB/s  "
                f"{rate / bandwidth:5.3f} of copy  {key}"
            )
        del weights
        torch.cuda.empty_cache()
    for key, ms in totals.items():
        rate = total_bytes / (ms / 1000)
        print(
            f"one decode step's matmuls, {key}: {ms:.3f} ms, {rate / 1e9:.0f} GB/s, {rate / bandwidth:.3f} of copy"
        )
    print("best Triton config per shape:", best_configs)


if __name__ == "__main__":
    main()
