"""Fused elementwise kernels for the CUDA path of the decoder: residual-add + RMSNorm, in-place
RoPE (optionally writing the rotated keys and the values into the paged KV cache in the same
launch), SiLU-and-multiply (and GeGLU's GELU-and-multiply).

A decode step at small batch is a few big weight reads plus hundreds of tiny kernels; in eager
PyTorch RMSNorm alone is four or five launches (upcast, norm, downcast, weight multiply) and RoPE
three, each costing a few microseconds even inside a CUDA graph. One launch each here.

Rounding follows transformers' bf16 order so greedy output matches it: the residual sum is
rounded to the model dtype before it is normalized, the normalized value is rounded before the
weight multiply, and RoPE rounds `x * cos` and `rotate_half(x) * sin` before adding them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import is_fp8_kv
from tokenmill.kernels.qk_norm import QKNorm
from tokenmill.kernels.triton.kv_fp8 import kv_scales_for, quantize_kv
from tokenmill.kernels.triton.rms import head_rms_norm, inverse_rms
from tokenmill.kernels.triton.rounding import round_like as _round_like


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    out_ptr,
    weight_ptr,
    stride_x,
    stride_delta,
    stride_out,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_IN_F32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        xf = _round_like(xf + delta.to(tl.float32), dtype)
        tl.store(x_ptr + row * stride_x + cols, xf.to(dtype), mask=mask)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = xf / tl.sqrt_rn(variance + eps)
    if not WEIGHT_IN_F32:  # Llama rounds before the weight multiply, Gemma only after it
        normed = _round_like(normed, dtype)
    if HAS_WEIGHT:
        normed = normed * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    delta: torch.Tensor | None = None,
    *,
    weight_in_float32: bool = False,
) -> torch.Tensor:
    """RMSNorm of `x + delta` over the last dimension; with `delta`, `x` is updated in place to the sum.

    x, delta: [T, hidden] (rows may be strided, the last dimension contiguous). `weight` None:
    no weight multiply (a model whose norm weights are folded into the next matmul).
    `weight_in_float32`: a float32 `weight` multiplies the unrounded normalized value and the
    product is rounded once (Gemma's order, with its 1 + w precomputed as the weight).
    """
    if weight_in_float32 and (weight is None or weight.dtype != torch.float32):
        raise ValueError("weight_in_float32 needs a float32 weight")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"add_rms_norm needs a 2-D tensor contiguous in its last dimension, got {tuple(x.shape)}"
        )
    num_rows, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out
    if delta is not None and (delta.shape != x.shape or delta.stride(-1) != 1):
        raise ValueError(f"delta shape {tuple(delta.shape)} must equal x's {tuple(x.shape)}, contiguous rows")
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_rows,)](
        x,
        delta if delta is not None else x,
        out,
        weight if weight is not None else x,
        x.stride(0),
        delta.stride(0) if delta is not None else 0,
        out.stride(0),
        hidden,
        eps,
        HAS_DELTA=delta is not None,
        HAS_WEIGHT=weight is not None,
        WEIGHT_IN_F32=weight_in_float32,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out


@triton.jit
def _rope_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_token,
    stride_head,
    stride_table,
    num_heads,
    # Only with STORE_KV: x's heads from first_kv_head on are keys; they and v go to their slots.
    first_kv_head,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,  # STORE_KV and FP8 only: float32 [NUM_KV_HEADS]
    v_scale_ptr,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    # Only with QK_NORM: x's heads before first_kv_head are q heads normalized with q_norm, the rest
    # k heads with k_norm ([2 * HALF] weights), before the rotation.
    q_norm_ptr,
    k_norm_ptr,
    qk_norm_eps,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    STORE_KV: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,  # STORE_KV into an e4m3 cache: keys and values divided by their head's scale
    QK_NORM: tl.constexpr,  # per-head RMSNorm of q and k first (Qwen3, Gemma 3)
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    # The tables hold [cos, cos] and [-sin, sin] over the head dimension.
    cos = tl.load(cos_ptr + pos * stride_table + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    first = x_ptr + token * stride_token + heads * stride_head + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    if QK_NORM:
        is_k = heads >= first_kv_head
        w1 = tl.where(
            is_k,
            tl.load(k_norm_ptr + dims, mask=dims < HALF, other=0.0),
            tl.load(q_norm_ptr + dims, mask=dims < HALF, other=0.0),
        )
        w2 = tl.where(
            is_k,
            tl.load(k_norm_ptr + HALF + dims, mask=dims < HALF, other=0.0),
            tl.load(q_norm_ptr + HALF + dims, mask=dims < HALF, other=0.0),
        )
        x1n = x1.to(tl.float32)
        x2n = x2.to(tl.float32)
        inv = 1.0 / tl.sqrt_rn((tl.sum(x1n * x1n, axis=1) + tl.sum(x2n * x2n, axis=1)) / (2 * HALF) + qk_norm_eps)
        x1 = head_rms_norm(x1, inv[:, None], w1)
        x2 = head_rms_norm(x2, inv[:, None], w2)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # rotate_half(x) = [-x2, x1]; each product rounded to the model dtype, as transformers does.
    out1 = _round_like(x1f * cos, dtype) + _round_like(-x2f * sin, dtype)
    out2 = _round_like(x2f * cos, dtype) + _round_like(x1f * sin, dtype)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:  # -1: a CUDA-graph padding row, written nowhere
            slot_base = (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_slot
            kv_head = heads - first_kv_head
            key_dst = key_cache_ptr + slot_base + kv_head * stride_cache_head + dims
            key_mask = mask & (kv_head >= 0)
            key1 = out1.to(dtype)
            key2 = out2.to(dtype)
            v_heads = tl.arange(0, KV_HEADS_PAD)[:, None]
            v_dims = tl.arange(0, 2 * HALF_PAD)[None, :]
            v_mask = (v_heads < NUM_KV_HEADS) & (v_dims < 2 * HALF)
            value = tl.load(v_ptr + token * stride_v_token + v_heads * stride_v_head + v_dims, mask=v_mask)
            if FP8:  # the rotated key as rounded to the model dtype, then scaled: as store_kv does
                is_key_row = (kv_head >= 0) & (kv_head < NUM_KV_HEADS)
                k_scale = tl.load(k_scale_ptr + kv_head, mask=is_key_row, other=1.0)  # [heads, 1]
                key1 = quantize_kv(key1, k_scale, key_cache_ptr.dtype.element_ty)
                key2 = quantize_kv(key2, k_scale, key_cache_ptr.dtype.element_ty)
                v_scale = tl.load(v_scale_ptr + v_heads, mask=v_heads < NUM_KV_HEADS, other=1.0)
                value = quantize_kv(value, v_scale, value_cache_ptr.dtype.element_ty)
            tl.store(key_dst, key1, mask=key_mask)
            tl.store(key_dst + HALF, key2, mask=key_mask)
            tl.store(
                value_cache_ptr + slot_base + v_heads * stride_cache_head + v_dims,
                value.to(value_cache_ptr.dtype.element_ty),
                mask=v_mask,
            )


def _check_rope_input(x: torch.Tensor) -> None:
    if x.stride(-1) != 1 or x.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head_dim contiguous in memory, got {tuple(x.shape)}")


def _checked_qk_norm(qk_norm: QKNorm | None, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if qk_norm is None:
        return None
    q_weight, k_weight = qk_norm.q_weight, qk_norm.k_weight
    for name, weight in (("q norm", q_weight), ("k norm", k_weight)):
        if weight.shape != (head_dim,) or weight.stride(0) != 1:
            raise ValueError(f"the {name} weight must be a contiguous [{head_dim}] tensor, got {tuple(weight.shape)}")
    return q_weight, k_weight


def rope_inplace(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    qk_norm: QKNorm | None = None,
    first_kv_head: int = 0,
) -> None:
    """Rotates x [T, heads, head_dim] (token and head strides free, head_dim contiguous) in place.

    cos_cache / sin_cache: [max_positions, head_dim] as RotaryEmbedding holds them. With `qk_norm`
    every head is first RMS-normalized, heads from `first_kv_head` on
    with the k weight (see layers/rmsnorm.py for the two rounding orders the weights' dtypes pick).
    """
    num_tokens, num_heads, head_dim = x.shape
    _check_rope_input(x)
    norm = _checked_qk_norm(qk_norm, head_dim)
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        x, positions, cos_cache, sin_cache, x.stride(0), x.stride(1), cos_cache.stride(0), num_heads,
        first_kv_head, x, x, x, positions, x, x, 0, 0, 0, 0, 0,  # no KV store
        norm[0] if norm else x, norm[1] if norm else x, qk_norm.eps if qk_norm else 0.0,
        HALF=half, HEADS_PAD=triton.next_power_of_2(num_heads), HALF_PAD=triton.next_power_of_2(half),
        STORE_KV=False, NUM_KV_HEADS=1, KV_HEADS_PAD=1, PAGE_SIZE=1, FP8=False, QK_NORM=norm is not None,
        num_warps=4,
    )  # fmt: skip


def rope_and_store_kv(
    x: torch.Tensor,
    first_kv_head: int,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    qk_norm: QKNorm | None = None,
) -> None:
    """rope_inplace(x) (with `qk_norm`: the per-head norms first), then the rotated keys (x's
    heads from `first_kv_head` on) and v [T, kv_heads, head_dim] written to their slots of
    kv_cache [2, blocks, block_size, kv_heads, head_dim]; slot -1 writes nothing. One launch
    instead of two for a decode layer. An FP8 cache stores them as store_kv does (divided by
    k_scale / v_scale per KV head; None = 1.0)."""
    num_tokens, num_heads, head_dim = x.shape
    _check_rope_input(x)
    num_kv_heads = num_heads - first_kv_head
    if v.shape != (num_tokens, num_kv_heads, head_dim) or v.stride(-1) != 1:
        raise ValueError(f"v must be [{num_tokens}, {num_kv_heads}, {head_dim}] contiguous in head_dim")
    if (
        kv_cache.dim() != 5
        or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim)
        or kv_cache.stride(-1) != 1
    ):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} must be [2, blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} must be ({num_tokens},)")
    norm = _checked_qk_norm(qk_norm, head_dim)
    if num_tokens == 0:
        return
    half = head_dim // 2
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    k_scale, v_scale = kv_scales_for(kv_cache, k_scale, v_scale, num_kv_heads)
    _rope_kernel[(num_tokens,)](
        x, positions, cos_cache, sin_cache, x.stride(0), x.stride(1), cos_cache.stride(0), num_heads,
        first_kv_head, v, key_cache, value_cache, slot_mapping, k_scale, v_scale, v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        norm[0] if norm else x, norm[1] if norm else x, qk_norm.eps if qk_norm else 0.0,
        HALF=half, HEADS_PAD=triton.next_power_of_2(num_heads), HALF_PAD=triton.next_power_of_2(half),
        STORE_KV=True, NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        PAGE_SIZE=kv_cache.shape[2], FP8=is_fp8_kv(kv_cache.dtype), QK_NORM=norm is not None, num_warps=4,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    norm_source_ptr,
    stride_in,
    stride_out,
    stride_norm_source,
    intermediate,
    hidden,
    eps,
    NORM_SCALE: tl.constexpr,
    GELU_TANH: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + intermediate + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if NORM_SCALE:
        # gate_up was computed from the un-normalized residual row (see silu_mul): apply the
        # RMSNorm's 1/rms here, rounding where the projection's output would have been rounded.
        inv_rms = inverse_rms(norm_source_ptr + row * stride_norm_source, hidden, eps, HIDDEN_PAD)
        g = _round_like(g * inv_rms, dtype)
        u = _round_like(u * inv_rms, dtype)
    if GELU_TANH:
        # GeGLU: PyTorch's gelu(approximate="tanh") = g/2 * (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3);
        # 1 + tanh(y) = 2 / (1 + e^-2y), so g / (1 + e^-2y), with no tanh to cancel against 1.
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = _round_like(g / (1.0 + tl.exp(-2.0 * inner)), dtype)
    else:
        act = _round_like(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(dtype), mask=mask)


def silu_mul(
    gate_up: torch.Tensor, norm_source: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * intermediate] (gate columns first) -> [T, intermediate].

    With `norm_source` [T, hidden], gate_up is `h @ W'` for the residual rows h and a weight W'
    with the RMSNorm weight folded in (CausalLM.fold_norm_weights): each row is first scaled by
    1 / rms(h) (eps as the norm's), which makes it the projection of RMSNorm(h), and the norm
    needs no launch of its own.
    """
    return _act_mul(gate_up, norm_source, eps, gelu_tanh=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) (tanh approximation) * up for gate_up [T, 2 * intermediate] (gate columns
    first) -> [T, intermediate]: Gemma's GeGLU, rounded like silu_mul."""
    return _act_mul(gate_up, None, 0.0, gelu_tanh=True)


def _act_mul(
    gate_up: torch.Tensor, norm_source: torch.Tensor | None, eps: float, gelu_tanh: bool
) -> torch.Tensor:
    num_rows, width = gate_up.shape
    if gate_up.stride(-1) != 1 or width % 2:
        raise ValueError(
            f"the gated activation needs [T, 2 * intermediate] contiguous rows, got {tuple(gate_up.shape)}"
        )
    if norm_source is not None and (
        norm_source.dim() != 2 or norm_source.shape[0] != num_rows or norm_source.stride(-1) != 1
    ):
        raise ValueError(
            f"norm_source must be [{num_rows}, hidden] with contiguous rows, got {tuple(norm_source.shape)}"
        )
    intermediate = width // 2
    out = torch.empty((num_rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    hidden = norm_source.shape[1] if norm_source is not None else 1
    block = min(1024, triton.next_power_of_2(intermediate))
    _silu_mul_kernel[(num_rows, triton.cdiv(intermediate, block))](
        gate_up,
        out,
        norm_source if norm_source is not None else gate_up,
        gate_up.stride(0),
        out.stride(0),
        norm_source.stride(0) if norm_source is not None else 0,
        intermediate,
        hidden,
        eps,
        NORM_SCALE=norm_source is not None,
        GELU_TANH=gelu_tanh,
        HIDDEN_PAD=triton.next_power_of_2(hidden),
        BLOCK=block,
        num_warps=4,
    )
    return out
