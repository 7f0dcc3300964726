"""The RMSNorm factor, for kernels that apply a norm deferred past the matmul after it."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.rounding import round_like


@triton.jit
def inverse_rms(row_ptr, length, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(row^2) + eps) of one contiguous row, in fp32: what RMSNorm divides by.

    A model whose norm weights are folded into the next matmul's weight (CausalLM.fold_norm_weights)
    multiplies the un-normalized residual row h by that weight; scaling the product by this
    factor gives the projection of RMSNorm(h), since the norm is a per-row scale.
    """
    cols = tl.arange(0, BLOCK)
    values = tl.load(row_ptr + cols, mask=cols < length, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt_rn(tl.sum(values * values, axis=0) / length + eps)


@triton.jit
def scale_rounded(x, factor):
    """x * factor (e.g. inverse_rms) computed in fp32 and rounded back to x's dtype, as a
    projection's output of the normalized row would have been rounded."""
    return round_like(x.to(tl.float32) * factor, x.dtype).to(x.dtype)


@triton.jit
def head_rms_norm(x, inv_rms, weight):
    """RMSNorm of `x` given its 1/rms (fp32), rounded as the model's norm rounds: with a 16-bit
    `weight` (Llama-style RMSNorm, layers/rmsnorm.rms_norm) the normalized value is rounded to x's
    dtype before the weight multiplies it and the product is rounded again; a float32 `weight`
    (Gemma's 1 + w) multiplies first and the result is rounded once."""
    normed = x.to(tl.float32) * inv_rms
    if weight.dtype == tl.float32:
        out = round_like(normed * weight, x.dtype)
    else:
        out = round_like(round_like(normed, x.dtype) * weight.to(tl.float32), x.dtype)
    return out.to(x.dtype)
