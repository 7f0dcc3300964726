"""The epilogue the FP8 matmul kernels share: bias, residual add, one rounding to the output dtype.

Like cuBLAS's epilogue (beta = 1, bias) the additions happen in float32 on the scaled product
and the result is rounded once. `y` may be the residual itself: each element is read by the
program that then writes it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_output(
    acc,  # [R, C] float32: rows are tokens, columns output features
    rows,  # [R] token indices
    cols,  # [C] output-feature indices
    M,
    N,
    bias_ptr,  # [N] (read only with HAS_BIAS)
    res_ptr,  # [M, N] with row stride stride_rm (read only with HAS_RESIDUAL)
    y_ptr,  # [M, N] with row stride stride_ym
    stride_rm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row_ok = rows < M
    col_ok = cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)  # M * N passes 2**31 for a long prefill through lm_head
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
