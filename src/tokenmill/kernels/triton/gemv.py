"""One-row matmuls against an out-major weight, on the GPU: one program per output column.

A decode step of one request multiplies one row by every weight matrix, so it is a weight read
and nothing else. cuBLAS's kernels for that shape fill the GPU by splitting K and reducing in a
second launch, and reach only 0.64-0.75 of copy bandwidth on Llama-3.1-8B's o_proj / qkv
(benchmarks/row_gemv_microbench.py). Here one program streams one contiguous [K] row of the
weight ([N, K], as checkpoints store it) with wide loads, multiplies it into a [BLOCK_K]
float32 accumulator and reduces once at the end: N programs fill the GPU without splitting K,
so one launch, no workspace. On an H200 at batch 1 (same call, us per matmul, cuBLAS with the
weights in-major, its faster layout there): qkv 12.9 vs 15.9, o_proj with the residual add 10.0
vs 12.6, gate_up 52.5 vs 58.5, down with the residual add 27.9 vs 34.0, lm_head 227.5 vs 247.7;
a step's projections 3.71 vs 3.88 ms, 0.956 of copy bandwidth. From two rows on, skinny_gemm.py.

The residual add (`residual`) and the bias happen in float32 before the one rounding to the
output dtype, as cuBLAS's epilogue (beta = 1, bias) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] (read only with HAS_BIAS)
    res_ptr,  # [N] (read only with HAS_RESIDUAL; may be y itself)
    y_ptr,  # [N]
    K,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    col = tl.program_id(0)
    w_row = w_ptr + col.to(tl.int64) * K
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            # Each weight byte is read once per step: don't let it push the activations out of L2.
            w = tl.load(w_row + k, eviction_policy="evict_first")
            x = tl.load(x_ptr + k)
        else:
            k_ok = k < K
            w = tl.load(w_row + k, mask=k_ok, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)
    y = tl.sum(acc, axis=0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + col).to(tl.float32)
    if HAS_RESIDUAL:
        y += tl.load(res_ptr + col).to(tl.float32)
    tl.store(y_ptr + col, y.to(y_ptr.dtype.element_ty))


def row_gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_K, num_warps, num_stages), the best of a sweep on an H200
    (benchmarks/row_gemv_microbench.py): long K slices with 8 warps for the wide matrices, 1024
    with 4 warps for the 4096-wide ones."""
    block_k, warps = (2048, 8) if n > 4096 else (1024, 4)
    return min(block_k, triton.next_power_of_2(k)), warps, 1


def serves_out_major_16bit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """What our few-row CUDA matmuls (this module, skinny_gemm.py) take: a 16-bit CUDA x [M, K]
    contiguous in K against a contiguous [N, K] weight of its dtype. (float32 keeps cuBLAS: the
    oracle tests' path.)"""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and weight.is_contiguous()
        and x.stride(1) == 1
    )


def use_row_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `row_gemv` serves this matmul: one row (from two on, skinny_gemm.py)."""
    return serves_out_major_16bit(x, weight) and x.shape[0] == 1


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """`residual + x @ weight.T + bias` for one row x [1, K] and weight [N, K] contiguous: [1, N].

    `out` may be `residual` itself (each program reads its residual element before writing it),
    though on an H200 that is slower than a new tensor (see linear.linear_add).
    `out_dtype` (default x's) lets lm_head write float32 logits without a cast launch.
    `config` overrides (BLOCK_K, num_warps, num_stages), for the microbenchmark's sweep.
    """
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"row_gemv takes one contiguous row [1, K], got {tuple(x.shape)}: use F.linear")
    k = x.shape[1]
    n = weight.shape[0]
    if not weight.is_contiguous() or weight.shape[1] != k:
        raise ValueError(f"row_gemv needs a contiguous [N, {k}] weight, got {tuple(weight.shape)}")
    for name, t in (("bias", bias), ("residual", residual), ("out", out)):
        if t is not None and (t.numel() != n or not t.is_contiguous() or t.device != x.device):
            raise ValueError(
                f"row_gemv's {name} must hold {n} contiguous values on {x.device}, got {tuple(t.shape)}"
            )
    if out is None:
        out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    block_k, warps, stages = config or row_gemv_config(n, k)
    _row_gemv_kernel[(n,)](
        x,
        weight,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        k,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out
