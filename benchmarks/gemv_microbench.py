"""Batch-1 decode matmuls of Llama-3.1-8B: cuBLAS (F.linear) against our split-K Triton GEMV.

Each shape is timed as one CUDA graph of 32 matmuls over 32 distinct weight matrices (one per
layer, as a decode step reads them), so the L2 cache holds none of them and launch gaps are those
of a graph replay. Weights are stored in-major, as CausalLM keeps them on CUDA. Rates count the
weight bytes read; the fraction is against a device-to-device copy's bandwidth (bytes read +
written), the roofline of `tokenmill bench latency`.

    PYTHONPATH=src python benchmarks/gemv_microbench.py

(An earlier weight-streaming kernel here, one program per column block reducing across K every
iteration, lost to cuBLAS on every shape; it is in git history before this file's split-K version.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.bench.latency import copy_bandwidth

# -- the candidate: a split-K Triton GEMV ------------------------------------------------------
# The grid is (column blocks, K splits), enough programs to keep every SM streaming. Each program
# multiplies a [BLOCK_K, BLOCK_N] tile of the in-major weight elementwise into a 2-D accumulator
# (one reduction across K at the end), writes its partial sums to a float32 workspace and bumps a
# per-column-block counter; the program that arrives last sums the partials, writes the output
# and resets the counter, so one launch does the whole matmul. On an H200 (BENCHMARKS.md) it
# matched cuBLAS on down_proj, beat it by 2 % on lm_head and lost on qkv, o_proj and gate_up, so
# the engine keeps F.linear.


@triton.jit
def _gemv_split_k_kernel(
    x_ptr,  # [K]
    w_ptr,  # [K, N] row-major
    bias_ptr,  # [N] (unused without HAS_BIAS)
    y_ptr,  # [N]
    partial_ptr,  # float32 [SPLIT_K, N]
    counter_ptr,  # int32 [cdiv(N, BLOCK_N)], zero between calls
    N,
    K,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_K)
    k_begin = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k = k_begin + k0 + rows
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + k[:, None].to(tl.int64) * N + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        acc += w.to(tl.float32) * x[:, None]
    partial = tl.sum(acc, axis=0)
    split_k_finish(
        partial, y_ptr, bias_ptr, partial_ptr, counter_ptr, cols, col_ok, pid_n, pid_k, N, SPLIT_K, HAS_BIAS
    )


@triton.jit
def split_k_finish(
    partial, y_ptr, bias_ptr, partial_ptr, counter_ptr, cols, col_ok, pid_n, pid_k, N,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """A split-K GEMV program's end: with one split it writes its columns; otherwise it writes its
    partial sums to the workspace, and the last program of the column block to arrive sums them,
    writes the output and resets the block's counter."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            partial += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + cols, partial.to(y_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(partial_ptr + pid_k * N + cols, partial, mask=col_ok)
        # acq_rel: our partial is visible before the count moves; the last program sees them all.
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            splits = tl.arange(0, SPLIT_K)
            parts = tl.load(
                partial_ptr + splits[:, None] * N + cols[None, :],
                mask=col_ok[None, :],
                other=0.0,
                cache_modifier=".cg",  # written by other SMs: read through L2, not a stale L1
            )
            total = tl.sum(parts, axis=0)
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + cols, total.to(y_ptr.dtype.element_ty), mask=col_ok)
            tl.atomic_xchg(counter_ptr + pid_n, 0)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 128
    block_k: int = 64
    split_k: int = 16
    num_warps: int = 4


def default_config(n: int, k: int, num_sms: int) -> GemvConfig:
    """A split that gives every SM a few programs of at most a few hundred KiB each."""
    block_n, block_k = 128, 64
    col_blocks = triton.cdiv(n, block_n)
    split = 1
    while col_blocks * split < 4 * num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split)


class SplitKGemv:
    """Holds the workspace and counters for one device; call it like F.linear with one row."""

    def __init__(self, device: torch.device, max_n: int, max_split: int = 64) -> None:
        self.device = device
        # (A CPU device only runs under TRITON_INTERPRET=1, in the tests.)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        )
        self.partials = torch.empty(max_split * max_n, dtype=torch.float32, device=device)
        self.counters = torch.zeros(triton.cdiv(max_n, 16), dtype=torch.int32, device=device)
        self.max_n = max_n
        self.max_split = max_split
        self._configs: dict[tuple[int, int], GemvConfig] = {}

    def supports(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """x [1, K] and a weight [N, K] stored in-major (its transpose contiguous)."""
        return (
            x.dim() == 2
            and x.shape[0] == 1
            and x.stride(-1) == 1
            and weight.dim() == 2
            and weight.shape[1] == x.shape[1]
            and weight.t().is_contiguous()
            and weight.shape[0] <= self.max_n
            and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16)
        )

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        config: GemvConfig | None = None,
    ) -> torch.Tensor:
        n, k = weight.shape
        if config is None:
            config = self._configs.get((n, k))
            if config is None:
                config = self._configs[(n, k)] = default_config(n, k, self.num_sms)
        if config.split_k > self.max_split:
            raise ValueError(f"split_k {config.split_k} is more than this workspace's {self.max_split}")
        y = torch.empty((1, n), dtype=x.dtype, device=x.device)
        k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
        grid = (triton.cdiv(n, config.block_n), config.split_k)
        _gemv_split_k_kernel[grid](
            x,
            weight.t(),
            bias if bias is not None else y,
            y,
            self.partials,
            self.counters,
            n,
            k,
            K_PER_SPLIT=k_per_split,
            SPLIT_K=config.split_k,
            HAS_BIAS=bias is not None,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            num_warps=config.num_warps,
        )
        return y


SHAPES = {  # name: (N, K, copies)
    "qkv": (6144, 4096, 32),
    "o_proj": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 2),
}


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
    device = torch.device("cuda")
    gemv = SplitKGemv(device, max_n=max(n for n, _, _ in SHAPES.values()), max_split=64)
    totals = {"cublas": 0.0, "triton_default": 0.0, "triton_best": 0.0}
    total_bytes = 0
    best_configs = {}
    for name, (n, k, copies) in SHAPES.items():
        weights = [torch.randn(k, n, device=device, dtype=torch.bfloat16).t() for _ in range(copies)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        nbytes = copies * n * k * 2
        reference = F.linear(x, weights[0]).float()
        results = {"cublas": graph_ms([lambda w=w, x=x: F.linear(x, w) for w in weights])}
        base = default_config(n, k, gemv.num_sms)
        candidates = {base}
        for block_n, block_k, warps, split_scale in itertools.product(
            (64, 128, 256), (32, 64), (4, 8), (0.5, 1, 2)
        ):
            split = max(1, min(64, int(base.split_k * split_scale)))
            candidates.add(GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=warps))
        for config in sorted(candidates, key=str):
            if k // config.split_k < config.block_k:
                continue
            out = gemv(x, weights[0], config=config).float()
            err = ((out - reference).norm() / reference.norm()).item()
            if err > 1e-2:
                print(f"  {name} {config}: relative error {err:.2e}, skipped")
                continue
            key = "triton_default" if config == base else str(config)
            results[key] = graph_ms([lambda w=w, c=config, x=x: gemv(x, w, config=c) for w in weights])
        best = min((key for key in results if not key.startswith("cublas")), key=results.get)
        best_configs[name] = (best, base)
        scale = (32 / copies) if name != "lm_head" else 1 / copies  # per decode step: 32 layers, 1 lm_head
        totals["cublas"] += results["cublas"] * scale
        totals["triton_default"] += results["triton_default"] * scale
        totals["triton_best"] += results[best] * scale
        total_bytes += nbytes * scale
        for key, ms in sorted(results.items(), key=lambda kv: kv[1])[:6] + [
            ("cublas", results["cublas"]),
            ("triton_default", results["triton_default"]),
        ]:
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
    print("best Triton config per shape (best, default):", best_configs)


if __name__ == "__main__":
    main()
