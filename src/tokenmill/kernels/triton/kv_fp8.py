"""The FP8 KV cache's number format in Triton registers; the torch twin is kernels/kv_fp8.py."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import FP8_E4M3_MAX, is_fp8_kv

E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
_ONES: dict[tuple[torch.device, int], torch.Tensor] = {}  # scale 1.0 for callers that pass none


# Triton's CPU interpreter (3.9) converts float32 to float8e4nv wrongly when rounding carries into
# the exponent (7.9 becomes 4.0, not 8.0); it converts values already on the e4m3 grid exactly. Under
# the interpreter the rounding is therefore done here first; a GPU's conversion instruction rounds
# to nearest even itself. (Triton decides interpreter or compiler from the same variable.)
_ROUND_BEFORE_CONVERTING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round_to_e4m3_grid(y):
    """y (float32, |y| <= 448) rounded to nearest even on the e4m3 grid, still float32: 3 mantissa
    bits for normal values, multiples of 2^-9 below 2^-6 (the subnormals); the sign kept (-0.0 too)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds |t| < 2^22 to an integer, to nearest even
    subnormal = (((magnitude * 512.0 + magic) - magic) * 0.001953125).to(tl.uint32, bitcast=True) | sign
    return tl.where(magnitude >= 0.015625, normal, subnormal).to(tl.float32, bitcast=True)


@triton.jit
def quantize_kv(x, scale, dtype: tl.constexpr):
    """e4m3 of x / scale (IEEE division, as torch divides), saturated at +-448 first: the
    conversion alone would turn larger values into NaN."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
    if _ROUND_BEFORE_CONVERTING:
        y = _round_to_e4m3_grid(y)
    return y.to(dtype)


def kv_scales_for(
    kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors a launch passes: the layer's for an FP8 cache (ones where it has none),
    any tensor for a 16-bit cache (the kernel's FP8 branch is compiled out and never reads them)."""
    if not is_fp8_kv(kv_cache.dtype):
        return kv_cache, kv_cache
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            scale = _ONES.get((kv_cache.device, num_kv_heads))
            if scale is None:
                scale = torch.ones(num_kv_heads, dtype=torch.float32, device=kv_cache.device)
                _ONES[(kv_cache.device, num_kv_heads)] = scale
        wrong = scale.shape != (num_kv_heads,) or scale.dtype != torch.float32
        if wrong or scale.device != kv_cache.device:
            raise ValueError(
                f"{name} must be float32 [{num_kv_heads}] on {kv_cache.device}, one per KV head, "
                f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
            )
        scales.append(scale)
    return scales[0], scales[1]
