"""INT4 dequantization in Triton: the in-register unpacking the W4A16 matmul (int4_kernel.py) uses,
and a kernel that writes the whole 16-bit weight, for the large-M path (int4_linear.py: prefill
sizes are tensor-core bound, and cuBLAS on the dequantized weight beats dequantizing every tile
inside a Triton matmul, whose dots wait for their register operands one at a time).

Dequantization without int-to-float conversions (a quarter-rate instruction): a nibble OR'ed into
the exponent bits of 1024.0 (float16, 0x6400) or 128.0 (bfloat16, 0x4300) *is* that number plus the
nibble, so `(q | MAGIC) as 16-bit - (zero | MAGIC) as 16-bit` is q - zero, exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dequant_plane(
    packed, j: tl.constexpr, zero_magic, MAGIC: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr
):
    """Nibble plane j of a [R, C] tile of words (int4_pack.py's layout), minus the zero points, as
    exact small integers in DTYPE. `zero_magic` [R] is (zero | MAGIC) as DTYPE (`magic_zeros`)."""
    return magic_plane(packed, j, MAGIC, DTYPE, ASM) - zero_magic[:, None]


@triton.jit
def magic_plane(packed, j: tl.constexpr, MAGIC: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Nibble plane j of a [R, C] tile of words as MAGIC-offset values in DTYPE, exactly: 128 + q
    (bfloat16) or 1024 + q (float16). dequant_plane subtracts the zero points' same offset from
    them; a kernel may instead subtract (zero + offset) * sum(x) from the product (int4_kernel.py,
    ZERO_BY_XSUM).

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
            dtype=tl.zeros((1,), DTYPE).dtype,  # DTYPE itself arrives wrapped as a constexpr
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
    return pair


@triton.jit
def unpack_scale_zero(scale_zero, MAGIC: tl.constexpr, DTYPE: tl.constexpr, SCALE_BF16: tl.constexpr):
    """int32 (scale's 16 bits | zero << 16) -> (scale as its 16-bit float, (zero | MAGIC) as DTYPE)."""
    bits = (scale_zero & 0xFFFF).to(tl.int16)
    if SCALE_BF16:
        scale = bits.to(tl.bfloat16, bitcast=True)
    else:
        scale = bits.to(tl.float16, bitcast=True)
    return scale, magic_zeros(scale_zero >> 16, MAGIC, DTYPE)


@triton.jit
def magic_zeros(zeros, MAGIC: tl.constexpr, DTYPE: tl.constexpr):
    return (zeros.to(tl.int32) | MAGIC).to(tl.int16).to(DTYPE, bitcast=True)


@triton.jit
def dequantize_kernel(
    w_ptr,  # [N_pad, K_pad // 8] int32 (int4_pack.py)
    sz_ptr,  # [G_pad, N_pad] int32: scale's 16 bits | zero point << 16
    out_ptr,  # [N, K] 16-bit, contiguous
    N,
    K,
    n_padded,
    k_padded,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    MAGIC: tl.constexpr,
    ASM: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_N rows of one pack (8 * CHUNK columns), in the sorted column order."""
    PACK: tl.constexpr = 8 * CHUNK
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    t = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.arange(0, CHUNK)
    packed = tl.load(w_ptr + rows[:, None].to(tl.int64) * (k_padded // 8) + t * CHUNK + words[None, :])
    out_rows = out_ptr + rows[:, None].to(tl.int64) * K
    row_ok = (rows < N)[:, None]
    for j in tl.static_range(8):
        if (j * CHUNK) % GROUP == 0:
            group = (t * PACK + j * CHUNK) // GROUP
            scale_zero = tl.load(sz_ptr + group * n_padded + rows)
            scale, zero_magic = unpack_scale_zero(scale_zero, MAGIC, DTYPE, SCALE_BF16)
        w = dequant_plane(packed, j, zero_magic, MAGIC, DTYPE, ASM) * scale.to(DTYPE)[:, None]
        cols = t * PACK + j * CHUNK + words
        tl.store(out_rows + cols[None, :], w, mask=row_ok & (cols < K)[None, :])


def magic_for(dtype: torch.dtype) -> int:
    """The exponent bits that make a nibble's 16-bit pattern a float: 1024 + q (float16), 128 + q
    (bfloat16)."""
    return {torch.float16: 0x6400, torch.bfloat16: 0x4300}[dtype]
