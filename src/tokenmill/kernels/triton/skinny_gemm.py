"""Matmuls of 2-8 rows (a few requests decoding) against an out-major weight, on the GPU.

At these sizes a matmul is still a weight read. Each program takes BLOCK_N output columns (rows
of the [N, K] weight, contiguous in K) and every row of x, padded to 16, multiplies
[BLOCK_N, BLOCK_K] weight tiles by [BLOCK_K, 16] x tiles on the tensor cores (`tl.dot`) while
Triton's software pipeline keeps several weight tiles in flight, and reduces over K in
registers: no K split, one launch. On an H200 (benchmarks/skinny_gemm_microbench.py, us per
matmul at 2 / 8 rows, cuBLAS with the same out-major weights): qkv 14.2 / 14.4 vs 15.3 / 14.8,
o_proj 10.6 / 10.6 vs 12.4 / 12.2, gate_up 54.7 / 55.6 vs 54.8 / 55.3, down 29.3 / 29.5 vs
31.2 / 30.8, lm_head 232 / 234 vs 242 / 241. (One row: gemv.py's row GEMV is faster.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.gemv import serves_out_major_16bit

MIN_ROWS, MAX_ROWS = 2, 8
_BLOCK_M = 16  # tl.dot's smallest tile side; rows past M are masked to zero


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], last dimension contiguous
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] (read only with HAS_BIAS)
    y_ptr,  # [M, N], last dimension contiguous
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x_at = x_ptr + rows[None, :] * stride_xm + k[:, None]
        if EVEN:
            # Each weight byte is read once per step: don't let it push the activations out of L2.
            w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
            x = tl.load(x_at, mask=row_ok[None, :], other=0.0)
        else:
            k_ok = k < K
            w = tl.load(
                w_rows + k[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            x = tl.load(x_at, mask=row_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    y_at = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_at, tl.trans(acc).to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_gemm` serves this matmul: 2-8 rows (the sizes measured against cuBLAS)."""
    return serves_out_major_16bit(x, weight) and MIN_ROWS <= x.shape[0] <= MAX_ROWS


def skinny_gemm_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the best of a sweep on an H200
    (benchmarks/skinny_gemm_microbench.py) for 4096-wide, 6144-wide and wider matrices."""
    if n <= 4096:
        block_n, block_k, warps, stages = 32, 256, 4, 5
    elif n <= 8192:
        block_n, block_k, warps, stages = 64, 128, 4, 6
    else:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    return (
        min(block_n, max(16, triton.next_power_of_2(n))),
        min(block_k, max(16, triton.next_power_of_2(k))),
        warps,
        stages,
    )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` for x [M, K] with 2 <= M <= 8 and weight [N, K] contiguous: [M, N]
    in `out_dtype` (default x's). `config` overrides (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if x.dim() != 2 or not MIN_ROWS <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1:
        raise ValueError(
            f"skinny_gemm takes {MIN_ROWS}-{MAX_ROWS} rows [M, K] contiguous in K, got {tuple(x.shape)}: use F.linear"
        )
    m, k = x.shape
    n = weight.shape[0]
    if not weight.is_contiguous() or weight.shape[1] != k:
        raise ValueError(f"skinny_gemm needs a contiguous [N, {k}] weight, got {tuple(weight.shape)}")
    if bias is not None and (bias.numel() != n or not bias.is_contiguous() or bias.device != x.device):
        raise ValueError(
            f"skinny_gemm's bias must hold {n} contiguous values on {x.device}, got {tuple(bias.shape)}"
        )
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or skinny_gemm_config(n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out
