"""Dynamic FP8 (e4m3) quantization of 16-bit activations, on the GPU: the A side of W8A8 matmuls.

Two granularities, both symmetric, scale = absmax / 448 (e4m3's largest finite value), so each
value becomes round_to_nearest_even(x / scale) clamped to [-448, 448]:
- per token: one float32 scale per row of x [M, K] (with per-channel weight scales, the product
  is sum_k xq[m, k] * wq[n, k] times scale_x[m] * scale_w[n]);
- per token group: one scale per row and 128 consecutive columns (with 128x128 block weight
  scales, each K block's partial product is multiplied by scale_x[m, kb] * scale_w[nb, kb]).

An all-zero row or group (the padded rows of a CUDA-graph batch) gets the scale of an absmax of
MIN_ABSMAX instead of 0, so the division stays finite and the row quantizes to zeros.
The divisions are IEEE round-to-nearest (`div_rn`; Triton's `/` is an approximate division on
CUDA), so a torch reference computing x.float() / scale quantizes to the same bits.
Outputs are allocated from shapes only: no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_ABSMAX = 1e-12
GROUP_SIZE = 128


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value (ties to even), kept in float32.

    The cast to float8 then only re-encodes an exact value. A plain cast rounds the same way on
    CUDA (cvt.rn.satfinite), but Triton's interpreter rounds half up and drops the carry into
    the exponent (124.6 became 64); doing the rounding here makes both exact, so the CPU tests
    check the same bits the GPU produces.
    """
    bits = v.to(tl.uint32, bitcast=True)
    # Normal e4m3 values keep 3 of float32's 23 mantissa bits: round the low 20 away, ties to even
    # (a carry into the exponent is the right result).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Below 2**-6 e4m3 is subnormal, multiples of 2**-9: adding 2**14 (whose float32 ulp is 2**-9)
    # makes the float add round |v| to that grid, ties to even; the sign bit goes back on after.
    grid = (tl.abs(v) + 16384.0) - 16384.0
    subnormal = (grid.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _per_token_kernel(
    x_ptr,  # [M, K], last dimension contiguous
    q_ptr,  # [M, K] float8_e4m3fn, contiguous
    s_ptr,  # [M] float32
    K,
    stride_xm,
    FP8_MAX: tl.constexpr,
    MIN_ABSMAX: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(absmax, axis=0), MIN_ABSMAX), FP8_MAX)
    # Second pass over the row: it was just read, so it comes from L1/L2, not HBM.
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _per_group_kernel(
    x_ptr,  # [M, K], last dimension contiguous
    q_ptr,  # [M, K] float8_e4m3fn, contiguous
    s_ptr,  # [M, KB] float32 with strides (stride_sm, stride_sk)
    K,
    KB,
    stride_xm,
    stride_sm,
    stride_sk,
    FP8_MAX: tl.constexpr,
    MIN_ABSMAX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,  # groups per program
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    k_ok = k < K
    x = tl.load(x_ptr + row * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_ABSMAX), FP8_MAX)
    q = round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX))
    tl.store(q_ptr + row * K + k, q.to(q_ptr.dtype.element_ty), mask=k_ok)
    tl.store(s_ptr + row * stride_sm + g * stride_sk, scale, mask=g < KB)


def _check_activations(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"FP8 activation quantization takes x [M, K] contiguous in K, 16-bit or float32; "
            f"got shape {tuple(x.shape)}, strides {x.stride()}, {x.dtype}"
        )


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] float8_e4m3fn contiguous, scale [M, 1] float32) with x ~= xq * scale."""
    _check_activations(x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block_k = min(4096, triton.next_power_of_2(k))
    _per_token_kernel[(m,)](
        x, q, scale, k, x.stride(0),
        FP8_MAX=FP8_MAX, MIN_ABSMAX=MIN_ABSMAX, BLOCK_K=block_k,
        num_warps=8 if block_k >= 2048 else 4,
    )
    return q, scale


def quantize_per_token_group(x: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] float8_e4m3fn contiguous, scale [M, ceil(K / group_size)] float32) with
    x[m, k] ~= xq[m, k] * scale[m, k // group_size]. The scale is column-major (stride (1, M)): a
    GEMM tile reads the scales of its rows for one K block as one contiguous run."""
    _check_activations(x)
    if group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two, got {group_size}")
    m, k = x.shape
    kb = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((kb, m), dtype=torch.float32, device=x.device).t()
    if m == 0:
        return q, scale
    groups = max(1, min(8, 1024 // group_size, triton.next_power_of_2(kb)))
    _per_group_kernel[(m, triton.cdiv(kb, groups))](
        x, q, scale, k, kb, x.stride(0), scale.stride(0), scale.stride(1),
        FP8_MAX=FP8_MAX, MIN_ABSMAX=MIN_ABSMAX, GROUP=group_size, GROUPS=groups,
        num_warps=4,
    )
    return q, scale
