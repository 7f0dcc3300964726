"""The routed experts for a few tokens (decode steps): two GEMV launches, no align, no sum launch.

With a handful of tokens each expert gets about one token-expert pair, so the grouped GEMMs of
fused_moe.py pad every pair to a 16-row tensor-core tile and need an align launch before and a
sum over k after. Here instead:

1. `_pair_gate_up_kernel`, one program per (pair, BLOCK_N intermediate columns): the pair's
   token row times its expert's gate and up rows (contiguous in H, read once with wide loads,
   as the row GEMV of gemv.py reads a weight), silu(gate) * up into that pair's row: [N, I];
2. `_token_down_kernel`, one program per (token, BLOCK_N hidden columns): for each of the
   token's k experts, that pair's row times the expert's down rows, rounded, scaled by the
   routing weight and summed in float32 in registers: the layer's output [T, H], directly.

Two launches after the routing one, nothing read back to the host (graph-safe). A token's k
experts are distinct; two tokens that share an expert read its weights twice (the second time
mostly from L2), which is why larger batches take the grouped path (the tile configs choose).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.moe_tile_configs import GemmTiles
from tokenmill.kernels.triton.rounding import round_like


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H], rows contiguous
    ids_ptr,  # [N] expert of each pair (pair p = token p // top_k)
    out_ptr,  # [N, I]
    hidden,
    inter,
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0
):
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < inter
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_at = x_ptr + (pair // top_k) * stride_xm + ks
    gate_at = w_ptr + expert * stride_we + (cols % inter).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    up_at = gate_at + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_at)
            # Each weight byte is read once per step: keep the activations in L2 instead.
            gate = tl.load(gate_at, eviction_policy="evict_first")
            up = tl.load(up_at, eviction_policy="evict_first")
        else:
            k_ok = (k0 + ks) < hidden
            x = tl.load(x_at, mask=k_ok, other=0.0)
            gate = tl.load(gate_at, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            up = tl.load(up_at, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        xf = x.to(tl.float32)[None, :]
        acc_gate += gate.to(tl.float32) * xf
        acc_up += up.to(tl.float32) * xf
        x_at += BLOCK_K
        gate_at += BLOCK_K
        up_at += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    g = round_like(tl.sum(acc_gate, axis=1), dtype)
    u = round_like(tl.sum(acc_up, axis=1), dtype)
    act = round_like(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + pair * stride_om + cols, (act * u).to(dtype), mask=is_col)


@triton.jit
def _token_down_kernel(
    a_ptr,  # [N, I]: _pair_gate_up_kernel's output
    w_ptr,  # [E, H, I], rows contiguous
    ids_ptr,  # [N]
    weights_ptr,  # [N] float32
    out_ptr,  # [T, H]
    hidden,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < hidden
    wrows = (cols % hidden).to(tl.int64)[:, None] * stride_wn
    ks = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_at = a_ptr + pair * stride_am + ks
        w_at = w_ptr + expert * stride_we + wrows + ks[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_at)
                w = tl.load(w_at, eviction_policy="evict_first")
            else:
                k_ok = (k0 + ks) < inter
                a = tl.load(a_at, mask=k_ok, other=0.0)
                w = tl.load(w_at, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
            a_at += BLOCK_K
            w_at += BLOCK_K
        total += round_like(tl.sum(acc, axis=1), dtype) * tl.load(weights_ptr + pair)
    tl.store(out_ptr + token * stride_om + cols, total.to(dtype), mask=is_col)


def fused_moe_gemv(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T * k] float32
    ids: torch.Tensor,  # [T, k] int32 / int64
    gate_up_tiles: GemmTiles,
    down_tiles: GemmTiles,
) -> torch.Tensor:
    """fused_moe for a few tokens (the caller checked the shapes); [T, H] in x's dtype."""
    top_k = ids.shape[1]
    ids = ids.reshape(-1)
    activated = torch.empty((ids.numel(), w2.shape[2]), dtype=x.dtype, device=x.device)
    launch_pair_gate_up(x, w13, ids, activated, gate_up_tiles)
    out = torch.empty_like(x)
    launch_token_down(activated, w2, ids, weights, out, top_k, down_tiles)
    return out


def launch_pair_gate_up(
    x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, tiles: GemmTiles
) -> None:
    """out [N, I] = silu(gate) * up of each pair (ids: [N] flat, pair p = token p // (N / T))."""
    num_pairs, inter = out.shape
    hidden = x.shape[1]
    _pair_gate_up_kernel[(num_pairs, triton.cdiv(inter, tiles.block_n))](
        x, w13, ids, out, hidden, inter, num_pairs // x.shape[0],
        x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=hidden % tiles.block_k == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def launch_token_down(
    activated: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
    top_k: int, tiles: GemmTiles,
) -> None:  # fmt: skip
    """out [T, H] = sum over each token's k pairs of weight * down(activated row)."""
    num_tokens, hidden = out.shape
    inter = w2.shape[2]
    _token_down_kernel[(num_tokens, triton.cdiv(hidden, tiles.block_n))](
        activated, w2, ids, weights, out, hidden, inter,
        activated.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=inter % tiles.block_k == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def compile_gemv(
    kernel: str, num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype, tiles: GemmTiles
) -> None:
    """Compile one of the two kernels ("gate_up" or "down") for this shape without running it (the
    tuner's parallel warm-up; see fused_moe.compile_gemm)."""
    common = {
        "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages, "grid": (1, 1),
    }  # fmt: skip
    if kernel == "gate_up":
        _pair_gate_up_kernel.warmup(
            dtype, dtype, torch.int32, dtype, hidden, inter, top_k, hidden, 2 * inter * hidden, hidden, inter,
            EVEN_K=hidden % tiles.block_k == 0, **common,
        )  # fmt: skip
    elif kernel == "down":
        _token_down_kernel.warmup(
            dtype, dtype, torch.int32, torch.float32, dtype, hidden, inter, inter, hidden * inter, inter, hidden,
            TOP_K=top_k, EVEN_K=inter % tiles.block_k == 0, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown MoE GEMV {kernel!r}; expected 'gate_up' or 'down'")
