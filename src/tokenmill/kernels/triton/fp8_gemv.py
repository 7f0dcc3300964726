"""Matmuls of 1-4 16-bit rows against FP8 weights (W8A16) on CUDA cores: the batch-1 decode path.

A decode step of one request reads every weight once and does two flops per weight byte, so the
time is the weight read. As the row GEMV of gemv.py does for 16-bit weights, each program
streams BLOCK_N out-major weight rows ([N, K] float8_e4m3fn, contiguous in K) with wide loads,
converts them to float32 in registers and multiplies them into [BLOCK_N, BLOCK_K] float32
accumulators (one per activation row), reducing over K once at the end. The activations stay
16-bit (no activation quantization at decode: exact products of the dequantized weights, up to
float32 summation order).

Few programs per SM leave the loads' latency exposed (an H200's ncu profile of down_proj, 2048
programs of two rows: 43 % of issue slots empty, warps waiting on loads; and each K step reloads x
for only two weight rows). So per-channel weights may split K among SPLIT_K programs per column
tile, as int4_kernel.py does: each stores its float32 partial sums, and the last of the tile's
programs to arrive (an atomic count, release / acquire) adds them in split order (deterministic),
resets the count for the next call and runs the epilogue. One launch, capturable in CUDA graphs.

Scales: per-channel weights multiply the reduced sum by scale[n] once. For 128x128-block weights
(`_fp8_gemv_block_kernel`) a program's BLOCK_N rows lie in one row of scale blocks, so each K
step multiplies the activations (not the weights) by that row's block scales: one multiply per
activation element and step, shared by the BLOCK_N rows, and the weight tile is read as
[BLOCK_N, K blocks, 128] so its loads stay as wide as the per-channel kernel's.

With a residual the result goes to a new tensor: writing into the residual it reads measured
slower on an H100 (o_proj 11.8 against 9.3 us, down 28.2 against 25.1; the row GEMV of gemv.py
saw the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fp8_epilogue import store_output

MAX_ROWS = 4


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K], last dimension contiguous
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    ws_ptr,  # float32 [N]
    bias_ptr,
    res_ptr,
    y_ptr,
    part_ptr,  # float32 [SPLIT_K, ROWS, N]: the splits' partial sums (only with SPLIT_K > 1)
    count_ptr,  # int32 per column tile, zero between calls (only with SPLIT_K > 1)
    M,
    N,
    K,
    k_per_split,  # columns of K per split, a multiple of BLOCK_K (K with SPLIT_K == 1)
    stride_xm,
    stride_rm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    ROWS: tl.constexpr,  # 1..4, >= M
    SPLIT_K: tl.constexpr,  # programs sharing one column tile's K range
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N re-read the last weight row (their stores are masked): no mask on the loads.
    cols_c = tl.minimum(cols, N - 1)
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    ks = k_begin + tl.arange(0, BLOCK_K)
    w_at = w_ptr + cols_c.to(tl.int64)[:, None] * K + ks[None, :]
    # Rows past M re-read row M - 1 (their stores are masked too).
    x0_at = x_ptr + ks
    x1_at = x_ptr + tl.minimum(1, M - 1) * stride_xm + ks
    x2_at = x_ptr + tl.minimum(2, M - 1) * stride_xm + ks
    x3_at = x_ptr + tl.minimum(3, M - 1) * stride_xm + ks
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            # Each weight byte is read once per step: don't let it push the activations out of L2.
            w = tl.load(w_at, eviction_policy="evict_first")
        else:
            k_ok = (k0 - k_begin + ks) < K
            w = tl.load(w_at, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        w = w.to(tl.float32)
        if EVEN_K:
            acc0 += w * tl.load(x0_at).to(tl.float32)[None, :]
            if ROWS > 1:
                acc1 += w * tl.load(x1_at).to(tl.float32)[None, :]
            if ROWS > 2:
                acc2 += w * tl.load(x2_at).to(tl.float32)[None, :]
            if ROWS > 3:
                acc3 += w * tl.load(x3_at).to(tl.float32)[None, :]
        else:
            acc0 += w * tl.load(x0_at, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if ROWS > 1:
                acc1 += w * tl.load(x1_at, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if ROWS > 2:
                acc2 += w * tl.load(x2_at, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if ROWS > 3:
                acc3 += w * tl.load(x3_at, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w_at += BLOCK_K
        x0_at += BLOCK_K
        x1_at += BLOCK_K
        x2_at += BLOCK_K
        x3_at += BLOCK_K
    col_scale = tl.load(ws_ptr + cols_c)
    if SPLIT_K == 1:
        for row in tl.static_range(ROWS):
            acc = _row_acc(row, acc0, acc1, acc2, acc3)
            store_output(
                (tl.sum(acc, axis=1) * col_scale)[None, :], tl.full((1,), row, tl.int32), cols, M, N,
                bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym, HAS_BIAS, HAS_RESIDUAL,
            )  # fmt: skip
    else:
        # Each split stores its rows' partial sums; the last of the tile's SPLIT_K programs to
        # arrive adds them in split order (deterministic), scales once and runs the epilogue.
        # Every thread's stores come before one thread counts the program in; the count's release
        # (and the last program's acquire) order them for the last program.
        col_ok = cols < N
        part_at = part_ptr + (tl.program_id(1) * ROWS) * N + cols
        tl.store(part_at, tl.sum(acc0, axis=1), mask=col_ok)
        if ROWS > 1:
            tl.store(part_at + N, tl.sum(acc1, axis=1), mask=col_ok)
        if ROWS > 2:
            tl.store(part_at + 2 * N, tl.sum(acc2, axis=1), mask=col_ok)
        if ROWS > 3:
            tl.store(part_at + 3 * N, tl.sum(acc3, axis=1), mask=col_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for row in tl.static_range(ROWS):
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for split in tl.static_range(SPLIT_K):
                    # .cg: from L2, where the other programs' stores are, not from a stale L1 line.
                    total += tl.load(
                        part_ptr + (split * ROWS + row) * N + cols,
                        mask=col_ok,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                store_output(
                    (total * col_scale)[None, :], tl.full((1,), row, tl.int32), cols, M, N,
                    bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym, HAS_BIAS, HAS_RESIDUAL,
                )  # fmt: skip
            tl.atomic_xchg(count_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")


@triton.jit
def _row_acc(row: tl.constexpr, acc0, acc1, acc2, acc3):
    """The accumulator of activation row `row` (the kernels keep one per row, up to four)."""
    if row == 0:
        acc = acc0
    elif row == 1:
        acc = acc1
    elif row == 2:
        acc = acc2
    else:
        acc = acc3
    return acc


@triton.jit
def _load_x(at, ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        x = tl.load(at)
    else:
        x = tl.load(at, mask=ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _fp8_gemv_block_kernel(
    x_ptr,  # [M, K], last dimension contiguous
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    ws_ptr,  # float32 [cdiv(N, SCALE_BLOCK), KB_W]
    bias_ptr,
    res_ptr,
    y_ptr,
    M,
    N,
    K,
    KB_W,
    stride_xm,
    stride_rm,
    stride_ym,
    SCALE_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % (SUBS * SCALE_BLOCK) == 0
    ROWS: tl.constexpr,  # 1..4, >= M
    BLOCK_N: tl.constexpr,  # divides SCALE_BLOCK
    SUBS: tl.constexpr,  # scale blocks per K step
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, N - 1)  # past N: re-read the last row, stores masked
    sub = tl.arange(0, SUBS)
    koff = sub[:, None] * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)[None, :]  # [SUBS, SCALE_BLOCK]
    w_at = w_ptr + cols_c.to(tl.int64)[:, None, None] * K + koff[None, :, :]
    s_at = ws_ptr + ((pid * BLOCK_N) // SCALE_BLOCK) * KB_W + sub
    x0_at = x_ptr + koff
    x1_at = x_ptr + tl.minimum(1, M - 1) * stride_xm + koff
    x2_at = x_ptr + tl.minimum(2, M - 1) * stride_xm + koff
    x3_at = x_ptr + tl.minimum(3, M - 1) * stride_xm + koff
    acc0 = tl.zeros((BLOCK_N, SUBS, SCALE_BLOCK), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, SUBS, SCALE_BLOCK), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, SUBS, SCALE_BLOCK), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, SUBS, SCALE_BLOCK), dtype=tl.float32)
    for k0 in range(0, K, SUBS * SCALE_BLOCK):
        k_ok = (k0 + koff) < K
        if EVEN_K:
            w = tl.load(w_at, eviction_policy="evict_first")
            s = tl.load(s_at)[:, None]
        else:
            w = tl.load(w_at, mask=k_ok[None, :, :], other=0.0, eviction_policy="evict_first")
            s = tl.load(s_at, mask=(k0 // SCALE_BLOCK + sub) < KB_W, other=0.0)[:, None]
        w = w.to(tl.float32)
        acc0 += w * (_load_x(x0_at, k_ok, EVEN_K) * s)[None, :, :]
        if ROWS > 1:
            acc1 += w * (_load_x(x1_at, k_ok, EVEN_K) * s)[None, :, :]
        if ROWS > 2:
            acc2 += w * (_load_x(x2_at, k_ok, EVEN_K) * s)[None, :, :]
        if ROWS > 3:
            acc3 += w * (_load_x(x3_at, k_ok, EVEN_K) * s)[None, :, :]
        w_at += SUBS * SCALE_BLOCK
        s_at += SUBS
        x0_at += SUBS * SCALE_BLOCK
        x1_at += SUBS * SCALE_BLOCK
        x2_at += SUBS * SCALE_BLOCK
        x3_at += SUBS * SCALE_BLOCK
    for row in tl.static_range(ROWS):
        acc = _row_acc(row, acc0, acc1, acc2, acc3)
        store_output(
            tl.sum(tl.sum(acc, axis=2), axis=1)[None, :], tl.full((1,), row, tl.int32), cols, M, N,
            bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym, HAS_BIAS, HAS_RESIDUAL,
        )  # fmt: skip


def fp8_gemv_config(
    n: int, k: int, rows: int, block_scaled: bool, can_split: bool = True
) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): the best of sweeps at Llama-3.1-8B's
    shapes (benchmarks/fp8_linear_microbench.py --sweep gemv). On an H100
    (fp8-linear-sweep-h100-*.json), us at one row: per channel qkv 11.3 (8, 512, 4), o_proj 8.7
    (8, 512, 8), gate_up 42.3 (16, 256, 4), down 24.9 (2, 1024, 4, 2 stages), lm_head 174.5
    (16, 256, 4); per block 12.0, 9.1 (8, 512, 8), 43.2, 26.0 (8, 512, 8), 178.4. Two rows (the
    wide matrices take skinny8 from two rows on): (8, 512, 4) for o_proj, (4, 1024, 4) for qkv and
    down. On an H200 with K splits among the candidates (fp8-gemv-split-sweep-h200.json), one row,
    per channel: down 18.27 us with 32-row tiles split 4 ways (21.15 with the H100's choice), qkv
    8.93 with (16, 512, 8) (9.79); the others and two rows kept their choices. `can_split`: the
    caller has tile counters (else no K split)."""
    split_k = 1
    if rows > 1:
        block_n, block_k, warps, stages = (8, 512, 4, 1) if n <= 4096 and k <= 8192 else (4, 1024, 4, 1)
    elif n > 16384:
        block_n, block_k, warps, stages = 16, 256, 4, 1
    elif block_scaled:
        block_n, block_k, warps, stages = (8, 512, 8, 1) if n <= 4096 else (8, 512, 4, 1)
    elif k > 8192 and can_split:
        block_n, block_k, warps, stages, split_k = 32, 256, 4, 1, 4
    elif k > 8192:
        block_n, block_k, warps, stages = 2, 1024, 4, 2
    else:
        block_n, block_k, warps, stages = (8, 512, 8, 1) if n <= 4096 else (16, 512, 8, 1)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return block_n, max(block_k, 128) if block_scaled else block_k, warps, stages, split_k


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, ...] | None = None,
    tile_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """`residual + (x @ W.T + bias)` for x [M, K] with 1 <= M <= 4 rows, W the dequantized FP8
    `weight` [N, K] (contiguous) with `scale` ([N] per channel, or [cdiv(N, 128), cdiv(K, 128)]
    with block (128, 128)); [M, N] in `out` (which may be `residual`) or a new tensor of
    `out_dtype` (default x's). The caller (fp8_linear.py) has checked the shapes.

    `config` overrides (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]). A K split (per-channel
    weights only) needs `tile_counters`: int32, zero, at least cdiv(N, BLOCK_N) of them, left zero
    by every call (Fp8Weights.tile_counters)."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fp8_gemv takes 1-{MAX_ROWS} rows, got {m}: use fp8_linear")
    block_n, block_k, warps, stages, *split = config or fp8_gemv_config(
        n, k, m, block is not None, can_split=tile_counters is not None
    )
    split_k = split[0] if split else 1
    grid_n = triton.cdiv(n, block_n)
    if split_k > 1 and block is not None:
        raise ValueError(
            f"fp8_gemv splits K for per-channel weights only, got split {split_k} with {block} blocks"
        )
    if split_k > 1 and (
        tile_counters is None
        or tile_counters.dtype != torch.int32
        or tile_counters.numel() < grid_n
        or tile_counters.device != x.device
    ):
        raise ValueError(
            f"fp8_gemv with K split {split_k} needs int32 tile_counters on {x.device} with at least "
            f"{grid_n} entries (cdiv({n}, {block_n})), got "
            f"{None if tile_counters is None else (tile_counters.dtype, tile_counters.numel())}"
        )
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    common = dict(
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, EVEN_K=k % block_k == 0, ROWS=m,
        BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    bias_arg = bias if bias is not None else out
    residual_arg = residual if residual is not None else out
    residual_stride = residual.stride(0) if residual is not None else 0
    if block is None:
        k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
        partials = out  # unused without a K split
        if split_k > 1:
            partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        _fp8_gemv_kernel[(grid_n, split_k)](
            x, weight, scale, bias_arg, residual_arg, out, partials,
            tile_counters if split_k > 1 else scale,
            m, n, k, k_per_split, x.stride(0), residual_stride, out.stride(0),
            SPLIT_K=split_k, BLOCK_K=block_k, **common,
        )  # fmt: skip
    else:
        if block_k % block[1] or block[0] % block_n or block[0] != block[1]:
            raise ValueError(
                f"fp8_gemv with {block} scale blocks needs BLOCK_K a multiple of {block[1]} and BLOCK_N "
                f"dividing {block[0]}, got {block_n}x{block_k}"
            )
        _fp8_gemv_block_kernel[(grid_n,)](
            x, weight, scale, bias_arg, residual_arg, out,
            m, n, k, scale.shape[1], x.stride(0), residual_stride, out.stride(0),
            SCALE_BLOCK=block[1], SUBS=block_k // block[1], **common,
        )  # fmt: skip
    return out
