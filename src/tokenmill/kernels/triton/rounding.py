"""Rounding helpers shared by the decoder's fused kernels and the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_like(x, dtype: tl.constexpr):
    """x (fp32) rounded to the precision of `dtype`, kept in fp32.

    A plain `x.to(bf16).to(fp32)` is folded away by the compiler (seen with Triton 3.6 on an H200:
    the unrounded value came through), so bf16 rounds by integer arithmetic: round to nearest
    even on the 16 low bits of the fp32 pattern. fp16 keeps the cast pair; fp32 needs nothing.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def rope_rows(x, x_partner, cos, sin):
    """RoPE of rows `x` [..., head_dim] in x's dtype, rounded the way transformers rounds it.

    `x_partner` holds x's other half at each dimension (x[d + half] for d < half, x[d - half]
    after), and cos / sin the table rows ([cos, cos] and [-sin, sin], fp32). So
    out = round(x * cos) + round(rotate_half(x) * |sin|): the same two rounded products as
    `_rope_kernel` in kernels/triton/elementwise.py, bit for bit.
    """
    dtype = x.dtype
    out = round_like(x.to(tl.float32) * cos, dtype) + round_like(x_partner.to(tl.float32) * sin, dtype)
    return out.to(dtype)
