"""W8A8 matmuls for many rows (prefill, large decode batches): FP8 activations times FP8 weights.

x arrives quantized by fp8_quant.py (per token, or per token and 128 columns for block weights);
each program computes a [BLOCK_M, BLOCK_N] output tile with FP8 tensor-core dots over K, the B
operand read straight from the out-major [N, K] weight (a K-contiguous tile: the layout Hopper's
FP8 tensor cores take). Programs are ordered in groups of GROUP_M row tiles so that the weight
tiles a group shares are read from L2.

- Per-channel weights: the dot accumulates over all of K and the tile is multiplied by
  x_scale[m] * w_scale[n] once at the end.
- 128x128-block weights: BLOCK_K divides 128 and BLOCK_N divides 128, so each K step's partial
  product is multiplied by x_scale[m, kb] * w_scale[nb, kb] (DeepSeek-V3's recipe).
Either way each K step's FP8 dot is added to the float32 accumulator at full precision
(`max_num_imprecise_acc`), as cuBLAS does without fast accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fp8_epilogue import store_output


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K] float8_e4m3fn, last dimension contiguous
    xs_ptr,  # float32 [M] (per token) or [M, KB] (per group) with strides (stride_xsm, stride_xsk)
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
    BLOCK_SCALED: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, M - 1)  # past M / N: re-read the last row, stores masked
    cols_c = tl.minimum(cols, N - 1)
    ks = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rows_c.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_at = w_ptr + cols_c.to(tl.int64)[None, :] * K + ks[:, None]  # [BLOCK_K, BLOCK_N]: W.T's tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_at)
            w = tl.load(w_at)
        else:
            k_ok = (k0 + ks) < K
            x = tl.load(x_at, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_at, mask=k_ok[:, None], other=0.0)
        if BLOCK_SCALED:
            kb = k0 // SCALE_BLOCK
            x_scale = tl.load(xs_ptr + rows_c * stride_xsm + kb * stride_xsk)
            w_scale = tl.load(ws_ptr + (cols_c // SCALE_BLOCK) * KB_W + kb)
            acc += tl.dot(x, w) * (x_scale[:, None] * w_scale[None, :])
        else:
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_K)
        x_at += BLOCK_K
        w_at += BLOCK_K
    if not BLOCK_SCALED:
        acc = acc * tl.load(xs_ptr + rows_c * stride_xsm)[:, None] * tl.load(ws_ptr + cols_c)[None, :]
    store_output(acc, rows, cols, M, N, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym, HAS_BIAS, HAS_RESIDUAL)


def fp8_gemm_config(m: int, n: int, k: int, block_scaled: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M): the best of a sweep on an H100
    (benchmarks/fp8_linear_microbench.py --sweep, 64 / 128 / 512 rows, Llama-3.1-8B's shapes)."""
    stages = 5 if m <= 128 and not block_scaled else 4
    block_m, block_n, block_k, warps, group_m = 64, 128, 128, 4, 8
    return (
        min(block_m, max(16, triton.next_power_of_2(m))),
        min(block_n, max(16, triton.next_power_of_2(n))),
        min(block_k, max(32, triton.next_power_of_2(k))),
        warps,
        stages,
        group_m,
    )


def fp8_gemm(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """`residual + (dequant(x) @ W.T + bias)` for FP8 x [M, K] with float32 scales [M, 1] (per
    token) or [M, cdiv(K, 128)] (per group, with block weights); W the dequantized FP8 `weight`
    [N, K] with `scale` as in fp8_gemv.py. [M, N] in `out` (may be `residual`) or a new tensor of
    `out_dtype`."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages, group_m = config or fp8_gemm_config(m, n, k, block is not None)
    if block is not None and (block[1] % block_k or block[0] % block_n):
        raise ValueError(f"fp8_gemm with {block} scale blocks needs tiles dividing them, got {block_n}x{block_k}")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](
        x, x_scale, weight, scale,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        m, n, k,
        scale.shape[1] if block is not None else 0,
        x.stride(0), x_scale.stride(0), x_scale.stride(1),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        BLOCK_SCALED=block is not None,
        SCALE_BLOCK=block[0] if block is not None else 1,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out
