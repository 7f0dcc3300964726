"""Matmuls of a few rows (decode batches, up to BLOCK_M = 64) against FP8 weights, on tensor cores.

As skinny_gemm.py does for 16-bit weights, each program takes BLOCK_N output features (rows of
the out-major [N, K] weight, contiguous in K) and every row of x, padded to BLOCK_M, and
multiplies [BLOCK_N, BLOCK_K] weight tiles by [BLOCK_K, BLOCK_M] activation tiles with `tl.dot`
(the weight is the wide side of the tensor-core tile, so a handful of rows wastes little) while
Triton's software pipeline keeps several weight tiles in flight. No K split: one launch.

Two activation forms:
- 16-bit x (W8A16): the FP8 weight tile is converted to x's dtype in registers (exact: every
  e4m3 value is a bf16 / fp16 value) and multiplied in 16 bits with float32 accumulation;
- FP8 x (W8A8, from fp8_quant.py): the FP8 tiles go to the tensor cores as they are, and the
  activation scales join the weight scales.
Per-channel scales multiply the sum once at the end; 128x128-block scales multiply each K step's
partial product (BLOCK_K divides 128 and BLOCK_N divides 128, so a step lies in one block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fp8_epilogue import store_output

MAX_ROWS = 64


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,  # [M, K] 16-bit or float8_e4m3fn, last dimension contiguous
    xs_ptr,  # float32 activation scales (read only with X_FP8): [M] per token or [M, KB] per group
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    ws_ptr,  # float32 [N] (per channel) or [cdiv(N, SCALE_BLOCK), KB_W] (block)
    bias_ptr,
    res_ptr,
    y_ptr,
    M,
    N,
    K,
    KB_W,
    stride_xm,
    stride_xsm,
    stride_xsk,
    stride_rm,
    stride_ym,
    X_FP8: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    UPCAST_DOT: tl.constexpr,  # float32 dots for bf16 x (the CPU interpreter mis-multiplies bf16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" for the interpreter's float32 dots
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, N - 1)  # past N: re-read the last row, stores masked
    rows = tl.arange(0, BLOCK_M)
    rows_c = tl.minimum(rows, M - 1)  # past M: re-read the last row, stores masked
    ks = tl.arange(0, BLOCK_K)
    w_at = w_ptr + cols_c.to(tl.int64)[:, None] * K + ks[None, :]
    x_at = x_ptr + rows_c[None, :] * stride_xm + ks[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            # Each weight byte is read once per step: don't let it push the activations out of L2.
            w = tl.load(w_at, eviction_policy="evict_first")
            x = tl.load(x_at)
        else:
            k_ok = (k0 + ks) < K
            w = tl.load(w_at, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_at, mask=k_ok[:, None], other=0.0)
        if UPCAST_DOT:
            w, x = w.to(tl.float32), x.to(tl.float32)
        elif not X_FP8:
            w = w.to(x.dtype)
        if BLOCK_SCALED:
            kb = k0 // SCALE_BLOCK
            step_scale = tl.load(ws_ptr + (cols_c // SCALE_BLOCK) * KB_W + kb)[:, None]
            if X_FP8:
                step_scale = step_scale * tl.load(xs_ptr + rows_c * stride_xsm + kb * stride_xsk)[None, :]
            acc += tl.dot(w, x, input_precision=PRECISION) * step_scale
        else:
            # FP8 x FP8: Hopper's tensor cores keep fewer accumulator bits, so add each K step's
            # product into the float32 sum (16-bit products accumulate in float32 anyway).
            acc = tl.dot(w, x, acc, input_precision=PRECISION, max_num_imprecise_acc=BLOCK_K)
        w_at += BLOCK_K
        x_at += BLOCK_K
    if not BLOCK_SCALED:
        acc = acc * tl.load(ws_ptr + cols_c)[:, None]
        if X_FP8:
            acc = acc * tl.load(xs_ptr + rows_c * stride_xsm)[None, :]
    store_output(
        tl.trans(acc), rows, cols, M, N, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym, HAS_BIAS, HAS_RESIDUAL
    )


def fp8_skinny_config(n: int, k: int, rows: int, x_fp8: bool, block_scaled: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the best of a sweep on an H100
    (benchmarks/fp8_linear_microbench.py --sweep, 16 / 32 / 64 rows, decode-step weighted) for the
    6144-wide and narrower matrices and for the wide ones (gate_up, lm_head)."""
    if x_fp8 and not block_scaled:
        block_n, block_k, warps, stages = 64, 256, 4, 4
    elif x_fp8 and n > 16384:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    elif x_fp8:
        block_n, block_k, warps, stages = (64, 128, 4, 6) if rows <= 16 else (32, 128, 4, 4)
    else:  # 16-bit x: slower than FP8 x at every size measured (the weight conversion), not dispatched
        block_n, block_k, warps, stages = 64, 128, 4, 4
    return (
        min(block_n, max(16, triton.next_power_of_2(n))),
        min(block_k, max(32, triton.next_power_of_2(k))),
        warps,
        stages,
    )


def fp8_skinny(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`residual + (x @ W.T + bias)` for x [M, K] with M <= 64: 16-bit x (x_scale None), or FP8 x
    with its per-token [M, 1] or per-group [M, cdiv(K, 128)] float32 scales; W the dequantized FP8
    `weight` [N, K] with `scale` as in fp8_gemv.py. [M, N] in `out` (may be `residual`) or a new
    tensor of `out_dtype` (default: x's dtype, bfloat16 for FP8 x)."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fp8_skinny takes 1-{MAX_ROWS} rows, got {m}: use fp8_linear")
    x_fp8 = x.dtype == torch.float8_e4m3fn
    if x_fp8 != (x_scale is not None):
        raise ValueError("fp8_skinny takes activation scales exactly when x is float8_e4m3fn")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or (torch.bfloat16 if x_fp8 else x.dtype), device=x.device)
    block_n, block_k, warps, stages = config or fp8_skinny_config(n, k, m, x_fp8, block is not None)
    if block is not None and (block[1] % block_k or block[0] % block_n):
        raise ValueError(f"fp8_skinny with {block} scale blocks needs tiles dividing them, got {block_n}x{block_k}")
    _fp8_skinny_kernel[(triton.cdiv(n, block_n),)](
        x,
        x_scale if x_scale is not None else scale,
        weight, scale,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        m, n, k,
        scale.shape[1] if block is not None else 0,
        x.stride(0),
        x_scale.stride(0) if x_scale is not None else 0,
        x_scale.stride(1) if x_scale is not None else 0,
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        X_FP8=x_fp8,
        BLOCK_SCALED=block is not None,
        SCALE_BLOCK=block[0] if block is not None else 1,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        EVEN_K=k % block_k == 0,
        UPCAST_DOT=x.device.type != "cuda" and x.dtype == torch.bfloat16,
        PRECISION="ieee" if x.device.type != "cuda" else "tf32",
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out
