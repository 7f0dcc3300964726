"""The W4A16 matmul kernel: 16-bit x [M, K] times INT4 weights (int4_pack.py layout), on the GPU.

Decode is a weight read, and INT4 weights are a quarter of the 16-bit bytes, so the work per byte
matters: each int32 word is loaded once and unpacked in registers into eight values that feed
eight `tl.dot`s of the same [BLOCK_N, CHUNK] shape (see int4_pack.py), with the weight as the
dot's left operand (rows = output features), so the tile stays in registers; x^T [CHUNK, BLOCK_M]
is the right operand. The accumulator is float32 [BLOCK_N, BLOCK_M].

Dequantization without int-to-float conversions (a quarter-rate instruction): a nibble OR'ed into
the exponent bits of 1024.0 (float16, 0x6400) or 128.0 (bfloat16, 0x4300) *is* that number plus the
nibble, so `(q | MAGIC) as 16-bit - (zero | MAGIC) as 16-bit` is q - zero, exactly. Then either
- SCALE_AFTER: the dot takes the exact integers and the per-group partial sum is scaled in float32
  (one multiply per output element per group instead of one per weight), or
- not: the weight is scaled in 16-bit before the dot (one rounding, as Marlin does); better for
  large tiles, where a second accumulator costs registers.

Few rows leave few output tiles, so SPLIT_K programs share a tile's K range: each stores its float32
partial sums to a workspace and counts itself in (an atomic per tile, after a barrier, with release
semantics); the last to arrive adds the partials in split order (deterministic), resets the count
to zero for the next call, and runs the epilogue. One launch, no memset: CUDA-graph capturable.

Epilogue: + bias, + residual (in float32, one rounding to y's dtype), y may be the residual itself.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_plane(packed, j: tl.constexpr, zero_magic, MAGIC: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Nibble plane j of a [R, C] tile of words (int4_pack.py's layout), minus the zero points, as
    exact small integers in DTYPE. `zero_magic` [R] is (zero | MAGIC) as DTYPE (`magic_zeros`).

    Words 2c and 2c + 1 hold planes 0-3 and 4-7 of columns 2c (low halfword) and 2c + 1 (high), so
    one shift and one LOP3 on one word make both 16-bit values of the register pair the tensor
    cores read (ASM: the `pack=2` asm gets the two words of a column pair). The plain Triton
    version (the interpreter's) splits and joins the same bits instead."""
    SHIFT: tl.constexpr = 4 * (j % 4)
    if ASM:
        pair = tl.inline_asm_elementwise(
            asm=f"{{ .reg .b32 t; shr.u32 t, {'$1' if j < 4 else '$2'}, {SHIFT}; "
            f"lop3.b32 $0, t, 0x000F000F, {MAGIC * 0x10001}, 0xEA; }}",
            constraints="=r,r,r",
            args=[packed],
            dtype=zero_magic.dtype,
            is_pure=True,
            pack=2,
        )
    else:
        even, odd = tl.split(tl.reshape(packed, (packed.shape[0], packed.shape[1] // 2, 2)))
        if j < 4:
            word = even
        else:
            word = odd
        low = (((word >> SHIFT) & 0xF) | MAGIC).to(tl.int16).to(DTYPE, bitcast=True)
        high = (((word >> (SHIFT + 16)) & 0xF) | MAGIC).to(tl.int16).to(DTYPE, bitcast=True)
        pair = tl.reshape(tl.join(low, high), (packed.shape[0], packed.shape[1]))
    return pair - zero_magic[:, None]


@triton.jit
def magic_zeros(zeros, MAGIC: tl.constexpr, DTYPE: tl.constexpr):
    return (zeros.to(tl.int32) | MAGIC).to(tl.int16).to(DTYPE, bitcast=True)


@triton.jit
def int4_matmul_kernel(
    x_ptr,  # [M, K] 16-bit, K contiguous, columns in checkpoint order
    w_ptr,  # [N_pad, K_pad // 8] int32 (int4_pack.py)
    s_ptr,  # [G_pad, N_pad] 16-bit scales
    z_ptr,  # [G_pad, N_pad] uint8 zero points
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
    ASM: tl.constexpr,  # dequantize with inline PTX (CUDA), else plain Triton (the interpreter)
    SPLIT_K: tl.constexpr,
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

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(first_pack, end_pack):
        # Each weight byte is read once per call: don't let it push x out of L2.
        packed = tl.load(w_at + t * CHUNK, eviction_policy="evict_first")
        for j in tl.static_range(8):
            if (j * CHUNK) % GROUP == 0:  # a group starts here (at j = 0 only, for groups >= a pack)
                group = (t * PACK + j * CHUNK) // GROUP
                scale = tl.load(s_ptr + group * n_padded + cols)
                zero_magic = magic_zeros(tl.load(z_ptr + group * n_padded + cols), MAGIC, DTYPE)
                if SCALE_AFTER:
                    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            k = t * PACK + j * CHUNK + words
            if ACT_ORDER:
                x_cols = tl.load(perm_ptr + k)
            else:
                x_cols = k
            if EVEN_K:
                xt = tl.load(x_rows + x_cols[:, None], mask=row_ok[None, :], other=0.0)
            else:
                xt = tl.load(x_rows + x_cols[:, None], mask=row_ok[None, :] & (k < K)[:, None], other=0.0)
            w = dequant_plane(packed, j, zero_magic, MAGIC, DTYPE, ASM)
            if SCALE_AFTER:
                part = tl.dot(w, xt, part)
                if ((j + 1) * CHUNK) % GROUP == 0 or j == 7:  # the group (or the pack) ends here
                    acc += part * scale.to(tl.float32)[:, None]
            else:
                acc = tl.dot(w * scale.to(DTYPE)[:, None], xt, acc)

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
                acc += tl.load(ws_at + s * split_stride, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
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
        acc += tl.load(res_ptr + rows[None, :].to(tl.int64) * stride_rm + cols[:, None], mask=mask).to(tl.float32)
    tl.store(y_ptr + rows[None, :].to(tl.int64) * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


def magic_for(dtype_name: str) -> int:
    """The exponent bits that make a nibble's 16-bit pattern a float: 1024 + q (float16), 128 + q
    (bfloat16)."""
    return {"float16": 0x6400, "bfloat16": 0x4300}[dtype_name]


__all__ = ["dequant_plane", "int4_matmul_kernel", "magic_for", "magic_zeros", "triton"]
