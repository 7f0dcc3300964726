"""W4A16 linear on the GPU: `int4_linear(x, w)` = x @ W.T (+ bias, + residual) for INT4 weights
repacked once by `prepare_int4_weights` (int4_pack.py), through one Triton kernel (int4_kernel.py)
whose tiles int4_configs.py picks by shape.

Every call is CUDA-graph capturable: no host syncs, and allocations depend on shapes only.
"""

from __future__ import annotations

import torch
import triton

from tokenmill.kernels.triton.int4_configs import MAX_SPLIT_K_ROWS, Int4Config, device_sms, int4_config
from tokenmill.kernels.triton.int4_kernel import int4_matmul_kernel, magic_for
from tokenmill.kernels.triton.int4_pack import (
    PACK_CHUNK,
    PACK_K,
    Int4Weights,
    prepare_int4_weights,
    unpack_nibbles,
)

# Act-order x is gathered inside the kernel up to this many rows (each program re-reads a few rows
# from L2); beyond, one index_select first, so the kernel's x loads stay contiguous.
MAX_IN_KERNEL_GATHER_ROWS = 64


def int4_linear(
    x: torch.Tensor,
    w: Int4Weights,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Int4Config | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for 16-bit x [..., K], in `out_dtype` (default x's); with `residual`
    [..., N], `residual + x @ W.T + bias` written into `residual` and returned. `config` overrides
    the tiles (the microbenchmark's sweep)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"int4_linear takes float16 or bfloat16 activations, got {x.dtype}")
    if x.shape[-1] != w.k:
        raise ValueError(f"int4_linear: x has {x.shape[-1]} input features, the weights {w.k}")
    if x.device != w.packed.device:
        raise ValueError(f"int4_linear: x is on {x.device}, the weights on {w.packed.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w.n
    if bias is not None and (bias.numel() != n or not bias.is_contiguous() or bias.device != x.device):
        raise ValueError(f"int4_linear's bias must hold {n} contiguous values on {x.device}, got {tuple(bias.shape)}")
    if residual is not None:
        if residual.shape != (*lead, n) or residual.device != x.device:
            raise ValueError(
                f"int4_linear's residual must be {(*lead, n)} on {x.device}, got {tuple(residual.shape)} on {residual.device}"
            )
        if out_dtype is not None and out_dtype != residual.dtype:
            raise ValueError(f"int4_linear writes into the residual ({residual.dtype}): out_dtype {out_dtype} cannot apply")
        y = residual.view(-1, n)  # a view of residual, or an error for a layout that has none
        if y.stride(-1) != 1:
            raise ValueError(f"int4_linear's residual must be contiguous in its last dimension, got strides {residual.stride()}")
        result = residual
    else:
        y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
        result = y.view(*lead, n)
    if m == 0:
        return result

    cfg = config or int4_config(m, n, w.k_padded, device_sms(x.device))
    cfg.check()
    split_k = cfg.split_k
    grid_n, grid_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    if split_k > 1 and (m > MAX_SPLIT_K_ROWS or grid_n * grid_m > w.tile_counters.numel()):
        raise ValueError(f"int4_linear: split-K runs up to {MAX_SPLIT_K_ROWS} rows and block_n >= 16, got {m} rows, {cfg}")
    act_order_in_kernel = w.act_order and m <= MAX_IN_KERNEL_GATHER_ROWS
    if w.act_order and not act_order_in_kernel:
        x2 = x2.index_select(1, w.perm[: w.k])
    num_packs = w.k_padded // PACK_K
    packs_per_split = triton.cdiv(num_packs, split_k)
    workspace = torch.empty((split_k, m, w.n_padded), dtype=torch.float32, device=x.device) if split_k > 1 else y
    int4_matmul_kernel[(grid_n, grid_m, split_k)](
        x2,
        w.packed,
        w.scales,
        w.zeros,
        w.perm if act_order_in_kernel else w.packed,
        bias if bias is not None else y,
        y,
        y,
        workspace,
        w.tile_counters,
        m,
        n,
        w.k,
        x2.stride(0),
        y.stride(0),
        y.stride(0),
        w.n_padded,
        num_packs,
        packs_per_split,
        GROUP=w.group_size,
        CHUNK=PACK_CHUNK,
        MAGIC=magic_for(str(x.dtype).removeprefix("torch.")),
        ACT_ORDER=act_order_in_kernel,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        EVEN_K=w.k % PACK_K == 0,
        SCALE_AFTER=cfg.scale_after,
        ASM=x.is_cuda and cfg.asm_dequant,
        SPLIT_K=split_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return result


def dequantize_int4(w: Int4Weights) -> torch.Tensor:
    """The float32 [N, K] weight that `w` holds, from its packed form (tests check the repack with it)."""
    q = unpack_nibbles(w.packed).float()
    group = torch.arange(w.k_padded, device=q.device) // w.group_size
    scales = w.scales.float().t()[:, group]
    zeros = w.zeros.float().t()[:, group]
    sorted_w = ((q - zeros) * scales)[: w.n, : w.k]
    if w.perm is None:
        return sorted_w
    out = torch.empty_like(sorted_w)
    out[:, w.perm[: w.k].long()] = sorted_w
    return out


__all__ = ["Int4Config", "Int4Weights", "dequantize_int4", "int4_linear", "prepare_int4_weights"]
