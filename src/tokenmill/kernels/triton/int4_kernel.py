"""The W4A16 matmul kernel: 16-bit x [M, K] times INT4 weights (int4_pack.py layout), on the GPU.

Decode is a weight read, and INT4 weights are a quarter of the 16-bit bytes, so the work per byte
matters: each int32 word is loaded once and unpacked in registers (int4_dequant.py) into eight
values that feed eight `tl.dot`s of the same [BLOCK_N, CHUNK] shape (see int4_pack.py), the
dequantized tile never leaving registers. W_LEFT puts the weights on the dot's left (rows = output
features: wgmma once a warpgroup holds 64 rows, mma.sync below) or right (x on the left: mma.sync
for BLOCK_M < 64); the accumulator is float32 either way.

Zero points are subtracted exactly in 16 bits (int4_dequant.py); then either
- SCALE_AFTER: the dot takes the exact integers and the per-group partial sum is scaled in float32
  (one multiply per output element per group instead of one per weight), or
- not: the weight is scaled in 16-bit before the dot (one rounding, as Marlin does).

Few rows leave few output tiles, so SPLIT_K programs share a tile's K range: each stores its float32
partial sums to a workspace and counts itself in (an atomic per tile, after a barrier, with release
semantics); the last to arrive adds the partials in split order (deterministic), resets the count
to zero for the next call, and runs the epilogue. One launch, no memset: CUDA-graph capturable.

Epilogue: + bias, + residual (in float32, one rounding to y's dtype), y may be the residual itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.int4_dequant import dequant_plane, magic_plane, unpack_scale_zero


# Shape arguments are not specialized (on == 1 or on divisibility by 16): they only bound loops and
# masks, and specializing them compiled one variant per matrix shape and row count.
@triton.jit(do_not_specialize=["M", "N", "K", "num_packs", "packs_per_split"])
def int4_matmul_kernel(
    x_ptr,  # [M, K] 16-bit, K contiguous, columns in checkpoint order
    w_ptr,  # [N_pad, K_pad // 8] int32 (int4_pack.py)
    sz_ptr,  # [G_pad, N_pad] int32: scale's 16 bits | zero point << 16
    perm_ptr,  # [K_pad] int32: x column of sorted column k (read only with ACT_ORDER)
    bias_ptr,  # [N] (read only with HAS_BIAS)
    res_ptr,  # [M, N] (read only with HAS_RESIDUAL; may be y itself)
    y_ptr,  # [M, N]
    ws_ptr,  # [SPLIT_K, M, N_pad] float32 partial sums (only with SPLIT_K > 1)
    count_ptr,  # int32 per output tile, zero between calls (only with SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_ym,
    n_padded,
    num_packs,
    packs_per_split,
    GROUP: tl.constexpr,  # columns per scale group, a divisor or multiple of 8 * CHUNK
    CHUNK: tl.constexpr,
    MAGIC: tl.constexpr,
    ACT_ORDER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % (8 * CHUNK) == 0: x loads need no column mask
    SCALE_AFTER: tl.constexpr,
    # With SCALE_AFTER and W_LEFT: the dots take 128 + q (no per-weight zero subtraction), and each
    # group's partial sums lose (128 + zero) * sum(x), sum(x) from a dot of ones with the same x
    # tile (it lands in the accumulator's layout, broadcast over the rows): one HMMA per weight HMMA
    # instead of one HADD2 per two weights.
    ZERO_BY_XSUM: tl.constexpr,
    ASM: tl.constexpr,  # dequantize with inline PTX (CUDA), else plain Triton (the interpreter)
    SCALE_BF16: tl.constexpr,  # the scales' 16 bits are bfloat16 (else float16)
    SPLIT_K: tl.constexpr,
    W_LEFT: tl.constexpr,  # weights as the dot's left operand (acc [BLOCK_N, BLOCK_M]), else right
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    PACK: tl.constexpr = 8 * CHUNK
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # < N_pad: weights and scales need no mask
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    words = tl.arange(0, CHUNK)
    w_at = w_ptr + cols[:, None].to(tl.int64) * (num_packs * CHUNK) + words[None, :]
    x_rows = x_ptr + rows[None, :].to(tl.int64) * stride_xm
    if SPLIT_K == 1:
        first_pack = 0
        end_pack = num_packs
    else:
        first_pack = tl.program_id(2) * packs_per_split
        end_pack = tl.minimum(first_pack + packs_per_split, num_packs)

    if W_LEFT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ZERO_BY_XSUM:
        ones = tl.full((BLOCK_N, CHUNK), 1.0, DTYPE)
    for t in range(first_pack, end_pack):
        # Each weight byte is read once per call: don't let it push x out of L2.
        packed = tl.load(w_at + t * CHUNK, eviction_policy="evict_first")
        for j in tl.static_range(8):
            if (j * CHUNK) % GROUP == 0:  # a group starts here (at j = 0 only, for groups >= a pack)
                group = (t * PACK + j * CHUNK) // GROUP
                # One 4-byte load for both (cp.async copies 4 bytes or more: this one is pipelined).
                scale_zero = tl.load(sz_ptr + group * n_padded + cols)
                scale, zero_magic = unpack_scale_zero(scale_zero, MAGIC, DTYPE, SCALE_BF16)
                if SCALE_AFTER:
                    part = tl.zeros_like(acc)
                if ZERO_BY_XSUM:
                    x_sum = tl.zeros_like(acc)
            k = t * PACK + j * CHUNK + words
            if ACT_ORDER:
                x_cols = tl.load(perm_ptr + k)
            else:
                x_cols = k
            if EVEN_K:
                xt = tl.load(x_rows + x_cols[:, None], mask=row_ok[None, :], other=0.0)
            else:
                xt = tl.load(x_rows + x_cols[:, None], mask=row_ok[None, :] & (k < K)[:, None], other=0.0)
            if ZERO_BY_XSUM:
                w = magic_plane(packed, j, MAGIC, DTYPE, ASM)
            else:
                w = dequant_plane(packed, j, zero_magic, MAGIC, DTYPE, ASM)
            if not SCALE_AFTER:
                w = w * scale.to(DTYPE)[:, None]
            if ZERO_BY_XSUM:
                part = tl.dot(w, xt, part)
                x_sum = tl.dot(ones, xt, x_sum)
            elif SCALE_AFTER and W_LEFT:
                part = tl.dot(w, xt, part)
            elif SCALE_AFTER:
                part = tl.dot(tl.trans(xt), tl.trans(w), part)
            elif W_LEFT:
                acc = tl.dot(w, xt, acc)
            else:
                acc = tl.dot(tl.trans(xt), tl.trans(w), acc)
            if SCALE_AFTER and (((j + 1) * CHUNK) % GROUP == 0 or j == 7):  # the group (or pack) ends here
                if ZERO_BY_XSUM:
                    part -= zero_magic.to(tl.float32)[:, None] * x_sum
                if W_LEFT:
                    acc += part * scale.to(tl.float32)[:, None]
                else:
                    acc += part * scale.to(tl.float32)[None, :]

    if not W_LEFT:
        acc = tl.trans(acc)
    col_ok = cols < N
    if SPLIT_K > 1:
        tile = pid_m * tl.num_programs(0) + pid_n
        ws_at = ws_ptr + rows[None, :].to(tl.int64) * n_padded + cols[:, None]
        split_stride = M * n_padded  # < 2**31: split-K runs only for a few rows
        tl.store(ws_at + tl.program_id(2) * split_stride, acc, mask=row_ok[None, :])
        # Every thread's partial sums are written before one thread counts the program in; the
        # count's release (and the last program's acquire) order them for the last program.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other programs' stores are, not from a stale L1 line.
                partial = tl.load(
                    ws_at + s * split_stride, mask=row_ok[None, :], other=0.0, cache_modifier=".cg"
                )
                acc += partial
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
            _epilogue(acc, rows, cols, row_ok, col_ok, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym,
                      HAS_BIAS, HAS_RESIDUAL)  # fmt: skip
    else:
        _epilogue(acc, rows, cols, row_ok, col_ok, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym,
                  HAS_BIAS, HAS_RESIDUAL)  # fmt: skip


@triton.jit
def _epilogue(
    acc,  # [BLOCK_N, BLOCK_M] float32
    rows,
    cols,
    row_ok,
    col_ok,
    bias_ptr,
    res_ptr,
    y_ptr,
    stride_rm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    mask = row_ok[None, :] & col_ok[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + rows[None, :].to(tl.int64) * stride_rm + cols[:, None], mask=mask)
        acc += residual.to(tl.float32)
    y_at = y_ptr + rows[None, :].to(tl.int64) * stride_ym + cols[:, None]
    tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=mask)
