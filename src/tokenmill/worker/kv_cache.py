"""Sizing and allocating the paged KV cache pool.

The pool is one tensor per layer of a KV cache group (core/kv_cache_groups.py): a model without
sliding-window layers has one group of all its layers, so one tensor per layer; with several
groups, layer j of every group shares tensor j, and a block id belongs to one group at a time.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.config import CacheConfig
from tokenmill.core.kv_cache_groups import KVCacheGroups
from tokenmill.gpu_capability import require_fp8_capable
from tokenmill.kernels.kv_fp8 import FP8_KV_DTYPE

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~22K tokens of SmolLM2-135M in fp32


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto` is the model's dtype; `fp8` / `fp8_e4m3` the scaled e4m3 cache (kernels/kv_fp8.py);
    otherwise a float type by name."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    from tokenmill.device import resolve_dtype

    return resolve_dtype(name, torch.device("cpu"))


def check_kv_cache_dtype_on_device(kv_cache_dtype: torch.dtype, device: torch.device) -> None:
    """An FP8 KV cache on a GPU without float8 arithmetic is refused at load, not at the first
    attention kernel's compile."""
    if kv_cache_dtype == FP8_KV_DTYPE:
        require_fp8_capable(device, "--kv-cache-dtype fp8", "Leave --kv-cache-dtype at auto (the model's 16 bits)")


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block over `num_layers` layer tensors (a grouped pool: the group size)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def num_blocks_for_cpu(cache: CacheConfig, bytes_per_block: int, min_blocks: int) -> int:
    """CPU: an explicit block count, else `kv_cache_memory` bytes (default 1 GiB)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < min_blocks:
        raise ValueError(
            f"kv_cache_memory={budget} bytes holds only {num_blocks} blocks of {bytes_per_block} bytes, fewer than "
            f"the {min_blocks} one max_model_len sequence needs; raise kv_cache_memory or lower max_model_len"
        )
    return int(num_blocks)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    # zeros, not empty: padded CUDA-graph rows may read unwritten slots, and NaN garbage there would
    # poison a softmax even when masked by multiplication.
    return [
        torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]


def layer_kv_caches(tensors: list[torch.Tensor], groups: KVCacheGroups) -> list[torch.Tensor]:
    """The model's per-layer cache list: each layer gets the pool tensor its group places it in."""
    if len(tensors) != groups.num_tensors:
        raise ValueError(f"the KV cache groups use {groups.num_tensors} tensors, got {len(tensors)}")
    return [tensors[j] for j in groups.layer_tensor]
