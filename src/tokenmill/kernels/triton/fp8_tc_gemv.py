"""Matmuls of 1-4 16-bit rows against per-channel FP8 weights on the tensor cores, K split among
programs: an alternative to fp8_gemv.py's CUDA-core GEMV for the batch-1 decode path.

The CUDA-core GEMV spends 3.2-3.8 instructions a weight (local sm_90 SASS: e4m3 -> f16x2, f16 ->
f32, an FFMA, and x's loads), and the one-row decode GEMVs are bound by instructions, not bytes.
Here each [BLOCK_N, BLOCK_K] weight tile is converted to float16 in registers (one cvt per two
weights, exact: every e4m3 value is a float16 value) and multiplied by x on the tensor cores
(`tl.dot`, float32 accumulation): about 2.1-2.3 instructions a weight in the same counts, most of
the rest being x's conversion over the tile's 16 padded rows.

x goes to float16 too. bf16 x is scaled by 2**-8 first (exact, undone on the sum): float16 then
holds it exactly from 2**-6 to 2**24 in magnitude (bf16 keeps 8 significant bits, float16 11);
smaller values keep fewer bits, an absolute error of at most 2**-17 each (relative to the sum of
|x w|, below 2**-16 for any x of unit scale: far under the output's bf16 rounding), and only
|x| > 1.6e7 would overflow. float16 x is used as it is.

Few programs per SM leave latency exposed, so K is split as in fp8_gemv.py: each split stores its
float32 partial sums and the last program of a column tile (an atomic count) adds them in split
order, scales once and runs the epilogue. One launch, capturable in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fp8_epilogue import store_output

MAX_ROWS = 4
_BLOCK_M = 16  # tl.dot's smallest side; rows past M are zero
_X_PRESCALE = 2.0**-8  # bf16 x into float16's range (see the module docstring)


@triton.jit
def _fp8_tc_gemv_kernel(
    x_ptr,  # [M, K] 16-bit, last dimension contiguous
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    ws_ptr,  # float32 [N] per-channel scales
    bias_ptr,
    res_ptr,
    y_ptr,
    part_ptr,  # float32 [SPLIT_K, BLOCK_M, N] partial sums (only with SPLIT_K > 1)
    count_ptr,  # int32 per column tile, zero between calls (only with SPLIT_K > 1)
    M,
    N,
    K,
    k_per_split,  # columns of K per split, a multiple of BLOCK_K
    stride_xm,
    stride_rm,
    stride_ym,
    X_PRESCALE: tl.constexpr,  # x is multiplied by this before its float16 conversion (1.0: none)
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # float32 dots (the CPU interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, N - 1)  # past N: re-read the last row, stores masked
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    ks = k_begin + tl.arange(0, BLOCK_K)
    w_at = w_ptr + cols_c.to(tl.int64)[:, None] * K + ks[None, :]
    x_at = x_ptr + rows[None, :] * stride_xm + ks[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            # Each weight byte is read once per step: don't let it push the activations out of L2.
            w = tl.load(w_at, eviction_policy="evict_first")
            x = tl.load(x_at, mask=row_ok[None, :], other=0.0)
        else:
            k_ok = (k0 - k_begin + ks) < K
            w = tl.load(w_at, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_at, mask=row_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST_DOT:
            if X_PRESCALE != 1.0:
                x = (x.to(tl.float32) * X_PRESCALE).to(tl.float16)
            acc = tl.dot(w.to(tl.float32), x.to(tl.float16).to(tl.float32), acc, input_precision="ieee")
        else:
            if X_PRESCALE != 1.0:
                x = (x.to(tl.float32) * X_PRESCALE).to(tl.float16)
            acc = tl.dot(w.to(tl.float16), x.to(tl.float16), acc)
        w_at += BLOCK_K
        x_at += BLOCK_K
    col_scale = tl.load(ws_ptr + cols_c)[:, None] * (1.0 / X_PRESCALE)
    if SPLIT_K == 1:
        store_output(
            tl.trans(acc * col_scale), rows, cols, M, N, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym,
            HAS_BIAS, HAS_RESIDUAL,
        )  # fmt: skip
    else:
        # As fp8_gemv.py: partials stored, a release / acquire count, the last program adds them in
        # split order (deterministic), resets the count and runs the epilogue.
        col_ok = cols < N
        part_at = part_ptr + (tl.program_id(1) * BLOCK_M + rows[None, :]) * N + cols[:, None]
        tl.store(part_at, acc, mask=col_ok[:, None] & row_ok[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(
                    part_ptr + (split * BLOCK_M + rows[None, :]) * N + cols[:, None],
                    mask=col_ok[:, None] & row_ok[None, :],
                    other=0.0,
                    cache_modifier=".cg",  # from L2, where the other programs' stores are
                )
            store_output(
                tl.trans(total * col_scale), rows, cols, M, N, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym,
                HAS_BIAS, HAS_RESIDUAL,
            )  # fmt: skip
            tl.atomic_xchg(count_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")


def fp8_tc_gemv_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): a first guess, not measured (64-row
    tiles on 2 warps, K split until there are about two programs per SM of an H100 / H200)."""
    block_n, block_k = 64, 128
    tiles = -(-n // block_n)
    steps = -(-k // block_k)
    split_k = 1
    while tiles * split_k < 264 and split_k < 8 and steps // (2 * split_k) >= 2:
        split_k *= 2
    return block_n, min(block_k, max(32, triton.next_power_of_2(k))), 2, 4, split_k


def fp8_tc_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    tile_counters: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """`residual + (x @ W.T + bias)` for x [M, K] 16-bit with 1 <= M <= 4, W the dequantized
    per-channel FP8 `weight` [N, K] (`scale` [N]); a new [M, N] tensor of `out_dtype` (default
    x's). `tile_counters`: int32, zero, at least cdiv(N, BLOCK_N) (Fp8Weights.tile_counters)."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fp8_tc_gemv takes 1-{MAX_ROWS} rows, got {m}: use fp8_linear")
    if x.dtype not in (torch.bfloat16, torch.float16) or scale.shape != (n,):
        raise ValueError(
            f"fp8_tc_gemv takes 16-bit x and per-channel scales [{n}], got {x.dtype} and {tuple(scale.shape)}"
        )
    block_n, block_k, warps, stages, split_k = config or fp8_tc_gemv_config(n, k)
    grid_n = triton.cdiv(n, block_n)
    if split_k > 1 and (tile_counters.dtype != torch.int32 or tile_counters.numel() < grid_n):
        raise ValueError(f"fp8_tc_gemv needs int32 tile_counters with at least {grid_n} entries")
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    partials = out
    if split_k > 1:
        partials = torch.empty((split_k, _BLOCK_M, n), dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    _fp8_tc_gemv_kernel[(grid_n, split_k)](
        x, weight, scale,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out, partials, tile_counters,
        m, n, k, k_per_split, x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        X_PRESCALE=_X_PRESCALE if x.dtype == torch.bfloat16 else 1.0,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        EVEN_K=k % block_k == 0,
        SPLIT_K=split_k,
        UPCAST_DOT=x.device.type != "cuda",
        BLOCK_M=_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out
