"""W4A16 linear on the GPU: `int4_linear(x, w)` = x @ W.T (+ bias, + residual) for INT4 weights
repacked once by `prepare_int4_weights` (int4_pack.py).

Two paths, picked per shape by int4_configs.py:
- the fused Triton matmul (int4_kernel.py) for decode-sized M: a weight read, with the weights
  unpacked in registers;
- for prefill-sized M, the weight dequantized to 16 bits by one Triton kernel (int4_dequant.py)
  and multiplied by cuBLAS: tensor-core bound there, where cuBLAS's pipelined GEMM beats a Triton
  matmul that dequantizes each tile in registers and waits on every dot.

Every call is CUDA-graph capturable: no host syncs, and allocations depend on shapes only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton

from tokenmill.kernels.triton.int4_configs import MAX_SPLIT_K_ROWS, Int4Config, device_sms, int4_config
from tokenmill.kernels.triton.int4_dequant import dequantize_kernel, magic_for
from tokenmill.kernels.triton.int4_kernel import int4_matmul_kernel
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
_DEQUANT_BLOCK_N = 64


def int4_linear(
    x: torch.Tensor,
    w: Int4Weights,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Int4Config | None = None,
    zero_by_xsum: bool = False,
) -> torch.Tensor:
    """`x @ W.T + bias` for 16-bit x [..., K], in `out_dtype` (default x's); with `residual`
    [..., N], `residual + x @ W.T + bias` written into `residual` and returned. `config` overrides
    the path and tiles (the microbenchmark's sweep); `zero_by_xsum` (KernelConfig.int4_zero_by_xsum)
    has the chosen fused config take zero points through sum(x) where it can (scale_after, w_left)."""
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
        raise ValueError(
            f"int4_linear's bias must hold {n} contiguous values on {x.device}, got {tuple(bias.shape)}"
        )
    y = None  # the output rows [m, n]: the residual's, when there is one
    if residual is not None:
        if residual.shape != (*lead, n) or residual.device != x.device:
            raise ValueError(
                f"int4_linear's residual must be {(*lead, n)} on {x.device}, "
                f"got {tuple(residual.shape)} on {residual.device}"
            )
        if out_dtype is not None and out_dtype != residual.dtype:
            raise ValueError(
                f"int4_linear writes into the residual ({residual.dtype}): out_dtype {out_dtype} cannot apply"
            )
        y = residual.view(-1, n)  # a view of residual, or an error for a layout that has none
        if y.stride(-1) != 1:
            raise ValueError(
                "int4_linear's residual must be contiguous in its last dimension, "
                f"got strides {residual.stride()}"
            )
    cfg = config or int4_config(m, n, w.k_padded, device_sms(x.device))
    if zero_by_xsum and cfg.scale_after and cfg.w_left and not cfg.dequantize:
        cfg = dataclasses.replace(cfg, zero_by_xsum=True)
    cfg.check()
    if m == 0:
        return residual if residual is not None else x.new_empty((*lead, n), dtype=out_dtype or x.dtype)
    if w.act_order and (cfg.dequantize or m > MAX_IN_KERNEL_GATHER_ROWS):
        x2 = x2.index_select(1, w.perm[: w.k])  # the weights' sorted column order
    if cfg.dequantize:
        product = _dequantized_matmul(x2, w, bias, y)
        if residual is not None:
            return residual
        return product.view(*lead, n) if out_dtype is None else product.to(out_dtype).view(*lead, n)
    if y is None:
        y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    _fused_matmul(x2, w, bias, residual is not None, y, cfg)
    return residual if residual is not None else y.view(*lead, n)


def _fused_matmul(
    x2: torch.Tensor,
    w: Int4Weights,
    bias: torch.Tensor | None,
    add_to_y: bool,
    y: torch.Tensor,
    cfg: Int4Config,
) -> None:
    """y (+)= x2 @ W.T + bias with the Triton W4A16 kernel."""
    m, n = x2.shape[0], w.n
    split_k = cfg.split_k
    grid_n, grid_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    if split_k > 1 and (m > MAX_SPLIT_K_ROWS or grid_n * grid_m > w.tile_counters.numel()):
        raise ValueError(
            f"int4_linear: split-K runs up to {MAX_SPLIT_K_ROWS} rows and block_n >= 16, got {m} rows, {cfg}"
        )
    gather_in_kernel = w.act_order and m <= MAX_IN_KERNEL_GATHER_ROWS  # else int4_linear gathered x
    num_packs = w.k_padded // PACK_K
    workspace = y  # unused without split-K
    if split_k > 1:
        workspace = torch.empty((split_k, m, w.n_padded), dtype=torch.float32, device=x2.device)
    int4_matmul_kernel[(grid_n, grid_m, split_k)](
        x2,
        w.packed,
        w.scale_zero,
        w.perm if gather_in_kernel else w.packed,
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
        triton.cdiv(num_packs, split_k),
        GROUP=w.group_size,
        CHUNK=PACK_CHUNK,
        MAGIC=magic_for(x2.dtype),
        ACT_ORDER=gather_in_kernel,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=add_to_y,
        EVEN_K=w.k % PACK_K == 0,
        SCALE_AFTER=cfg.scale_after,
        ZERO_BY_XSUM=cfg.zero_by_xsum,
        ASM=x2.is_cuda and cfg.asm_dequant,
        SCALE_BF16=w.scale_dtype == torch.bfloat16,
        SPLIT_K=split_k,
        W_LEFT=cfg.w_left,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _dequantized_matmul(
    x2: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None, residual_rows: torch.Tensor | None
) -> torch.Tensor:
    """x2 @ W.T + bias through cuBLAS on the 16-bit weight; into `residual_rows` when given (beta = 1)."""
    weight = dequantize_weights(w, x2.dtype)
    if residual_rows is None:
        return F.linear(x2, weight, bias)
    if bias is None:
        return residual_rows.addmm_(x2, weight.t())
    return residual_rows.add_(F.linear(x2, weight, bias))


def dequantize_weights(w: Int4Weights, dtype: torch.dtype, asm: bool = True) -> torch.Tensor:
    """The 16-bit [N, K] weight (columns in the sorted order for act-order weights), on w's device,
    one Triton kernel: each value rounded once from (q - zero) * scale."""
    out = torch.empty((w.n, w.k), dtype=dtype, device=w.packed.device)
    dequantize_kernel[(triton.cdiv(w.n, _DEQUANT_BLOCK_N), w.k_padded // PACK_K)](
        w.packed,
        w.scale_zero,
        out,
        w.n,
        w.k,
        w.n_padded,
        w.k_padded,
        GROUP=w.group_size,
        CHUNK=PACK_CHUNK,
        MAGIC=magic_for(dtype),
        ASM=out.is_cuda and asm,
        SCALE_BF16=w.scale_dtype == torch.bfloat16,
        BLOCK_N=_DEQUANT_BLOCK_N,
        num_warps=4,
    )
    return out


def dequantize_int4(w: Int4Weights) -> torch.Tensor:
    """The float32 [N, K] weight that `w` holds, in checkpoint column order, from its packed form in
    torch (tests check the repack with it)."""
    q = unpack_nibbles(w.packed).float()
    group = torch.arange(w.k_padded, device=q.device) // w.group_size
    scales = w.scales().float().t()[:, group]
    zeros = w.zeros().float().t()[:, group]
    sorted_w = ((q - zeros) * scales)[: w.n, : w.k]
    if w.perm is None:
        return sorted_w
    out = torch.empty_like(sorted_w)
    out[:, w.perm[: w.k].long()] = sorted_w
    return out


__all__ = [
    "Int4Config",
    "Int4Weights",
    "dequantize_int4",
    "dequantize_weights",
    "int4_linear",
    "prepare_int4_weights",
]
