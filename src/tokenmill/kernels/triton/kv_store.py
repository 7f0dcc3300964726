"""Scatter this step's keys and values into their slots of the paged KV cache (an FP8 cache: as
e4m3 of value / scale, see kernels/kv_fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import is_fp8_kv
from tokenmill.kernels.triton.fast_launch import FastLauncher
from tokenmill.kernels.triton.kv_fp8 import kv_scales_for, quantize_kv


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,  # FP8 only: float32 [NUM_KV_HEADS]
    v_scale_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,  # the cache is e4m3: store value / scale of each KV head
):
    # One program per token: all of its KV heads go to one slot, a contiguous run in the cache.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # CUDA-graph padding: write nowhere
        return
    block = slot // PAGE_SIZE
    offset_in_block = slot % PAGE_SIZE
    heads = tl.arange(0, NUM_KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    dst = block * stride_cache_block + offset_in_block * stride_cache_slot + heads * stride_cache_head + dims
    if FP8:
        head_valid = heads < NUM_KV_HEADS
        k_scale = tl.load(k_scale_ptr + heads, mask=head_valid, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=head_valid, other=1.0)
        key = quantize_kv(key, k_scale, key_cache_ptr.dtype.element_ty)
        value = quantize_kv(value, v_scale, value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def _inner_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


# Launched eagerly per layer in mixed steps (between CUDA-graph pieces): skip Triton's dispatch.
_STORE_KV_LAUNCH = FastLauncher(_store_kv_kernel)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] at slot_mapping into kv_cache.

    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; slots equal to -1 are skipped.
    An FP8 (float8_e4m3fn) cache stores value / scale per KV head (k_scale / v_scale float32
    [num_kv_heads]; None = 1.0); other caches ignore the scales.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping shape {tuple(slot_mapping.shape)} must be ({num_tokens},), one slot per token"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    if num_tokens == 0:
        return
    key = _inner_dim_contiguous(key)
    value = _inner_dim_contiguous(value)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    k_scale, v_scale = kv_scales_for(kv_cache, k_scale, v_scale, num_kv_heads)
    _STORE_KV_LAUNCH(
        (num_tokens,),
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=kv_cache.shape[2],
        FP8=is_fp8_kv(kv_cache.dtype),
        num_warps=4,
    )
