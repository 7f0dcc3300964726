"""y = x @ W.T for a few rows of x (decode at small batch): a weight-streaming Triton kernel.

At batch 1 to 16 a decode step's matmuls read every weight once and do almost no arithmetic,
so their speed is the rate at which they stream W. Each program owns BLOCK_N output columns and
walks K, loading [BLOCK_N, BLOCK_K] weight tiles (contiguous along K, several in flight through
the software pipeline); the few rows of x are padded to a tensor-core tile (masked loads), or
for one row reduced with plain multiply-adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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
