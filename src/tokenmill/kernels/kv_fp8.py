"""The FP8 KV cache's number format, in torch: what every backend stores and reads.

A value x of a layer's keys (or values) is stored as e4m3 of x / scale, saturated at +-448 (the
largest finite e4m3fn number; torch's plain conversion would make larger values NaN), and read as
stored * scale. Scales are float32, per KV head ([num_kv_heads]; a per-tensor scale is the same
number for every head), 1.0 unless a checkpoint gives k_scale / v_scale. The Triton kernels do the
same arithmetic in registers (kernels/triton/kv_store.py, paged_attention_kernel.py).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] (any float dtype) -> e4m3 of x / scale[head], saturating.
    The division is in float32, from x as the model computed it (rounded to the model's dtype)."""
    x = x.to(torch.float32)
    if scale is not None:
        x = x / scale.to(device=x.device, dtype=torch.float32)[:, None]
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | None, heads_axis: int = -2) -> torch.Tensor:
    """stored (e4m3) -> float32 stored * scale[head], the KV heads along `heads_axis`."""
    values = stored.to(torch.float32)
    if scale is None:
        return values
    shape = [1] * values.dim()
    shape[heads_axis] = -1
    return values * scale.to(device=values.device, dtype=torch.float32).view(shape)
