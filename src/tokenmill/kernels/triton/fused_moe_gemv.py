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

From the residual stream (`residual_norm_eps`, the deferred-norm decode path of
model/llama.DecoderLayer): x is the un-normalized residual row h, the router and w13 carry the
post-attention norm's weight folded in, and the block's RMSNorm launch is skipped. RMSNorm is a
per-row scale, so the gate/up kernel scales the router logits and the gate and up sums by 1/rms(h)
(each rounded as the projection of the normed row would be), and the down kernel adds its sum
into h in its epilogue, returning the residual stream: h + experts(RMSNorm(h)).

FP8 experts (W8A16; `w13_scale` / `w2_scale`): the weights are float8 e4m3 with float32 scales per
output row or per (SCALE_BN, SCALE_BK) block. Each weight tile, converted to float32, is multiplied
by its scales before the multiply-add: the value of the dequantized weight, exactly, and free in
kernels bound by the weight read. In block mode BLOCK_K divides SCALE_BK, so one K step lies in one
block of scales.

INT4 experts (W4A16; SCALE_MODE 3: `w13_scale` / `w2_scale` with `w13_zeros` / `w2_zeros` and a
`group_size`): int32 words of 8 unsigned 4-bit weights along K in moe_int4_layout.py's packs (word
p of a pack holds column j * CHUNK + p in nibble j), with a scale and a zero point per GROUP_SIZE
columns of a row: W = (q - zero) * scale. Each step loads a [rows, CHUNK] tile of words once (the
gate/up kernel interleaves gate and up rows in one) and walks its eight nibble planes, each against
a contiguous CHUNK-column slice of the activations (int4_pack_times_vector): a nibble OR'ed into
the bits of 2**23 is, as a float32, 2**23 + q, so one subtraction of 2**23 + zero gives q - zero
exactly, without an int-to-float conversion (a quarter-rate instruction). The unscaled products of
a group are summed in float32 and multiplied by the group's scale once per row, not once per weight.
With BLOCK_K above 256 a step loads BLOCK_K / 256 consecutive packs at once ([rows, PACKS, CHUNK],
int4_packs_times_vector): the loads are not pipelined, so bytes in flight come from bigger steps.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.moe_int4_layout import int4_chunk
from tokenmill.kernels.triton.moe_routing import topk_of_row
from tokenmill.kernels.triton.moe_tile_configs import GemmTiles
from tokenmill.kernels.triton.rms import inverse_rms
from tokenmill.kernels.triton.rounding import round_like


@triton.jit
def int4_word_and_shift(k, CHUNK: tl.constexpr):
    """The word (index along the row's words) and bit shift of column `k` in moe_int4_layout.py's
    packs of 8 * CHUNK columns."""
    return (k // (8 * CHUNK)) * CHUNK + k % CHUNK, ((k // CHUNK) % 8) * 4


@triton.jit
def dequantize_int4(words_at, scale_at, zero_at, shifts, k_ok, EVEN_K: tl.constexpr):
    """The float32 weights (q - zero) * scale of an INT4 tile gathered weight by weight (the grouped
    GEMMs), from pointers of that tile's shape: `words_at` to the int32 word of each weight,
    `scale_at` and `zero_at` to its group's scale and zero; `shifts` its nibble's bit shift
    (int4_word_and_shift) and `k_ok` the mask, unused with EVEN_K."""
    if EVEN_K:
        words = tl.load(words_at)
        zero = tl.load(zero_at)
        scale = tl.load(scale_at)
    else:
        words = tl.load(words_at, mask=k_ok, other=0)
        zero = tl.load(zero_at, mask=k_ok, other=0)
        scale = tl.load(scale_at, mask=k_ok, other=0.0)
    # The mask drops the sign bits an arithmetic shift of the top nibble brings in.
    q = (words >> shifts) & 0xF
    return (q - zero.to(tl.int32)).to(tl.float32) * scale.to(tl.float32)


_MAGIC_2_POW_23 = tl.constexpr(0x4B000000)  # the float32 bits of 2**23: OR'ed with n < 2**23, 2**23 + n


@triton.jit
def int4_zero_magic(zeros):
    """uint8 zero points as the float32 2**23 + zero (see int4_plane_minus_zero)."""
    return (zeros.to(tl.int32) | _MAGIC_2_POW_23).to(tl.float32, bitcast=True)


@triton.jit
def int4_plane_minus_zero(words, j: tl.constexpr, zero_magic):
    """Nibble plane j of a tile of words as the float32 q - zero, exactly; `zero_magic` from
    int4_zero_magic, broadcastable to the tile ([R, 1] for [R, C] words, [R, P, 1] for [R, P, C])."""
    q = ((words >> (4 * j)) & 0xF) | _MAGIC_2_POW_23  # & drops the sign bits of the top nibble's shift
    return q.to(tl.float32, bitcast=True) - zero_magic


@triton.jit
def int4_pack_times_vector(
    words,  # [R, CHUNK] int32: one pack of R rows (moe_int4_layout.py)
    x_at,  # the vector's column 0
    scale_at,  # [R] pointers: each row's first group scale
    zero_at,  # [R] pointers: each row's first uint8 zero point
    first_column,  # the pack's first column
    stride_sk,
    stride_zk,
    x_weight,  # multiplies the vector (a routing weight, or 1.0)
    CHUNK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """[R, CHUNK] float32 partial sums (to be summed over axis 1) of one pack of INT4 rows times
    x * x_weight over the pack's columns: sum of (q - zero) * scale * x[k]. A group's unscaled
    products are summed, then scaled once per row (moe_int4_layout.py keeps a plane inside a group,
    and a pack inside a group or holding whole ones)."""
    words_in_pack = tl.arange(0, CHUNK)
    acc = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        if (j * CHUNK) % GROUP_SIZE == 0:  # a group starts here (at j = 0 only, for groups >= a pack)
            group = (first_column + j * CHUNK) // GROUP_SIZE
            scale = tl.load(scale_at + group * stride_sk).to(tl.float32)
            zero_magic = int4_zero_magic(tl.load(zero_at + group * stride_zk))
            part = tl.zeros(words.shape, dtype=tl.float32)
        xj = tl.load(x_at + first_column + j * CHUNK + words_in_pack).to(tl.float32) * x_weight
        part += int4_plane_minus_zero(words, j, zero_magic[:, None]) * xj[None, :]
        if ((j + 1) * CHUNK) % GROUP_SIZE == 0 or j == 7:  # the group (or the pack) ends here
            acc += part * scale[:, None]
    return acc


@triton.jit
def int4_packs_times_vector(
    words,  # [R, PACKS, CHUNK] int32: PACKS consecutive packs of R rows
    x_at,  # the vector's column 0
    scale_at,  # [R] pointers: each row's first group scale
    zero_at,  # [R] pointers: each row's first uint8 zero point
    packs,  # [PACKS] the packs' indices along K
    pack_ok,  # [PACKS] False past the last pack (those words were loaded as 0)
    stride_sk,
    stride_zk,
    x_weight,
    CHUNK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """int4_pack_times_vector over several packs at once: [R, PACKS, CHUNK] float32 partial sums,
    so that one iteration loads more words (an iteration waits for its loads: the INT4 GEMVs' loads
    are not pipelined)."""
    PACK: tl.constexpr = 8 * CHUNK
    words_in_pack = tl.arange(0, CHUNK)
    first_columns = packs * PACK
    acc = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        if (j * CHUNK) % GROUP_SIZE == 0:  # a group starts here in every pack
            group = (first_columns + j * CHUNK) // GROUP_SIZE
            scale = tl.load(scale_at[:, None] + group[None, :] * stride_sk, mask=pack_ok[None, :], other=0.0)
            zeros = tl.load(zero_at[:, None] + group[None, :] * stride_zk, mask=pack_ok[None, :], other=0)
            zero_magic = int4_zero_magic(zeros)
            part = tl.zeros(words.shape, dtype=tl.float32)
        x_cols = (first_columns + j * CHUNK)[:, None] + words_in_pack[None, :]
        xj = tl.load(x_at + x_cols, mask=pack_ok[:, None], other=0.0).to(tl.float32) * x_weight
        part += int4_plane_minus_zero(words, j, zero_magic[:, :, None]) * xj[None, :, :]
        if ((j + 1) * CHUNK) % GROUP_SIZE == 0 or j == 7:
            acc += part * scale.to(tl.float32)[:, :, None]
    return acc


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H], rows contiguous
    ids_ptr,  # [N] expert of each pair (pair p = token p // top_k); written here with ROUTE
    weights_ptr,  # [N] float32 routing weight of each pair (written with ROUTE, else unused)
    logits_ptr,  # [T, E] router logits (read with ROUTE)
    out_ptr,  # [N, I]
    hidden,
    inter,
    num_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    stride_logits,
    norm_eps,  # NORM_SCALE only
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0
    ROUTE: tl.constexpr,  # route here: softmax + top-k of the token's logits (no routing launch)
    TOP_K_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_TO_LOGITS_DTYPE: tl.constexpr,
    NORM_SCALE: tl.constexpr,  # x is the un-normalized residual row: scale by its 1/rms
    HIDDEN_PAD: tl.constexpr,  # NORM_SCALE only: next power of 2 of hidden
    # FP8 weights (weight_scale_args). Unscaled launches leave the defaults: None is a compile-time
    # constant, so the 16-bit kernel keeps its parameters and code.
    ws_ptr=None,  # SCALE_MODE 1: float32 [E, 2I]; 2: [E, cdiv(2I, SCALE_BN), cdiv(H, SCALE_BK)]
    stride_wse=None,
    stride_wsn=None,
    stride_wsk=None,
    # 0: w unscaled, 1: e4m3 with a scale per row, 2: per block; 3: INT4, w int32 [E, 2I, H / 8]
    # (moe_int4_layout.py's packs) with scales (activation dtype or float32) and uint8 zeros
    # [E, 2I, H / GROUP_SIZE].
    SCALE_MODE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,  # BLOCK_K divides it
    wz_ptr=None,  # SCALE_MODE 3: the zero points, strides below
    stride_wze=None,
    stride_wzn=None,
    stride_wzk=None,
    GROUP_SIZE: tl.constexpr = 1,  # SCALE_MODE 3: columns per scale and zero
    CHUNK: tl.constexpr = 1,  # SCALE_MODE 3: words per pack row (moe_int4_layout.int4_chunk)
    PACKS: tl.constexpr = 1,  # SCALE_MODE 3: packs an iteration (int4_packs_per_step)
):
    pair = tl.program_id(0).to(tl.int64)
    token = pair // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < inter
    if NORM_SCALE:
        inv_rms = inverse_rms(x_ptr + token * stride_xm, hidden, norm_eps, HIDDEN_PAD)
    else:
        inv_rms = 1.0
    if ROUTE:
        # Every program of the pair's token computes the token's top-k (E values: cheap next to
        # the weight read); the first column block of each pair records its expert and weight.
        top_values, top_ids = topk_of_row(
            logits_ptr + token * stride_logits, num_experts, TOP_K, TOP_K_PAD, EXPERTS_PAD, RENORMALIZE,
            ROUND_TO_LOGITS_DTYPE, inv_rms, NORM_SCALE,
        )  # fmt: skip
        this_slot = tl.arange(0, TOP_K_PAD) == (pair % TOP_K)
        expert32 = tl.sum(tl.where(this_slot, top_ids, 0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + pair, expert32)
            tl.store(weights_ptr + pair, tl.sum(tl.where(this_slot, top_values, 0.0), axis=0))
        expert = expert32.to(tl.int64)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    wcols = (cols % inter).to(tl.int64)
    x_at = x_ptr + token * stride_xm + ks
    gate_at = w_ptr + expert * stride_we + wcols[:, None] * stride_wn + ks[None, :]
    up_at = gate_at + inter * stride_wn
    if SCALE_MODE == 1:
        gate_scale = tl.load(ws_ptr + expert * stride_wse + wcols * stride_wsn)
        up_scale = tl.load(ws_ptr + expert * stride_wse + (wcols + inter) * stride_wsn)
    elif SCALE_MODE == 2:
        # The up rows start a row of scale blocks (inter % SCALE_BN == 0, checked by the caller).
        gate_scale_at = ws_ptr + expert * stride_wse + (wcols // SCALE_BN) * stride_wsn
        up_scale_at = gate_scale_at + (inter // SCALE_BN) * stride_wsn
    if SCALE_MODE == 3:
        # Gate and up rows interleaved in one [2 * BLOCK_N, CHUNK] tile of packed words (one loop,
        # one load a pack); a scale and a zero per group (int4_pack_times_vector).
        halves = tl.arange(0, 2 * BLOCK_N)
        wrows = ((tl.program_id(1) * BLOCK_N + halves // 2) % inter + (halves % 2) * inter).to(tl.int64)
        words_at = w_ptr + expert * stride_we + wrows[:, None] * stride_wn + tl.arange(0, CHUNK)[None, :]
        scale_at = ws_ptr + expert * stride_wse + wrows * stride_wsn
        zero_at = wz_ptr + expert * stride_wze + wrows * stride_wzn
        x_row = x_ptr + token * stride_xm
        num_packs = hidden // (8 * CHUNK)
        if PACKS == 1:
            acc = tl.zeros((2 * BLOCK_N, CHUNK), dtype=tl.float32)
            for t in range(num_packs):
                # Each weight byte is read once per step: keep the activations in L2 instead.
                words = tl.load(words_at + t * CHUNK, eviction_policy="evict_first")
                acc += int4_pack_times_vector(
                    words, x_row, scale_at, zero_at, t * (8 * CHUNK), stride_wsk, stride_wzk, 1.0, CHUNK, GROUP_SIZE
                )  # fmt: skip
            row_sums = tl.sum(acc, axis=1)
        else:  # PACKS packs an iteration: a [2 * BLOCK_N, PACKS, CHUNK] tile of words
            pack_in_step = tl.arange(0, PACKS)
            step_words_at = words_at[:, None, :] + (pack_in_step * CHUNK)[None, :, None]
            acc3 = tl.zeros((2 * BLOCK_N, PACKS, CHUNK), dtype=tl.float32)
            for t0 in range(0, num_packs, PACKS):
                packs = t0 + pack_in_step
                pack_ok = packs < num_packs
                words = tl.load(
                    step_words_at + t0 * CHUNK, mask=pack_ok[None, :, None], other=0, eviction_policy="evict_first"
                )  # fmt: skip
                acc3 += int4_packs_times_vector(
                    words, x_row, scale_at, zero_at, packs, pack_ok, stride_wsk, stride_wzk, 1.0, CHUNK, GROUP_SIZE
                )  # fmt: skip
            row_sums = tl.sum(tl.sum(acc3, axis=2), axis=1)
        g_sum, u_sum = tl.split(tl.reshape(row_sums, (BLOCK_N, 2)))
    else:
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
            gate = gate.to(tl.float32)
            up = up.to(tl.float32)
            if SCALE_MODE == 2:  # per-row scales (mode 1) multiply the row sums after the loop
                gate = gate * tl.load(gate_scale_at + (k0 // SCALE_BK) * stride_wsk)[:, None]
                up = up * tl.load(up_scale_at + (k0 // SCALE_BK) * stride_wsk)[:, None]
            acc_gate += gate * xf
            acc_up += up * xf
            x_at += BLOCK_K
            gate_at += BLOCK_K
            up_at += BLOCK_K
        g_sum = tl.sum(acc_gate, axis=1)
        u_sum = tl.sum(acc_up, axis=1)
    dtype = out_ptr.dtype.element_ty
    if SCALE_MODE == 1:  # once a row, not once a weight: the loop's multiplies cost more than the bytes saved
        g_sum *= gate_scale
        u_sum *= up_scale
    g = round_like(g_sum, dtype)
    u = round_like(u_sum, dtype)
    if NORM_SCALE:
        g = round_like(g * inv_rms, dtype)
        u = round_like(u * inv_rms, dtype)
    act = round_like(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + pair * stride_om + cols, (act * u).to(dtype), mask=is_col)


@triton.jit
def _token_down_kernel(
    a_ptr,  # [N, I]: _pair_gate_up_kernel's output
    w_ptr,  # [E, H, I], rows contiguous
    ids_ptr,  # [N]
    weights_ptr,  # [N] float32
    out_ptr,  # [T, H]
    residual_ptr,  # [T, H], HAS_RESIDUAL only: added to the sum before the one rounding
    hidden,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_rm,
    TOP_K: tl.constexpr,
    K_STEPS: tl.constexpr,  # cdiv(inter, BLOCK_K); INT4: cdiv(inter / (8 * CHUNK), PACKS), steps of packs
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0
    HAS_RESIDUAL: tl.constexpr,
    # FP8 weights, as in _pair_gate_up_kernel: [E, H] or [E, cdiv(H, SCALE_BN), cdiv(I, SCALE_BK)].
    ws_ptr=None,
    stride_wse=None,
    stride_wsn=None,
    stride_wsk=None,
    SCALE_MODE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
    wz_ptr=None,  # SCALE_MODE 3 (INT4), as in _pair_gate_up_kernel: w [E, H, I / 8] (packs), [E, H, I / G]
    stride_wze=None,
    stride_wzn=None,
    stride_wzk=None,
    GROUP_SIZE: tl.constexpr = 1,
    CHUNK: tl.constexpr = 1,
    PACKS: tl.constexpr = 1,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < hidden
    wcols = (cols % hidden).to(tl.int64)
    wrows = wcols[:, None] * stride_wn
    if SCALE_MODE == 1:
        scale_rows = wcols * stride_wsn
    elif SCALE_MODE == 2:
        scale_rows = (wcols // SCALE_BN) * stride_wsn
    ks = tl.arange(0, BLOCK_K)
    if SCALE_MODE == 3:
        # One loop over (expert slot, pack), as below; K_STEPS = I / (8 * CHUNK) packs an expert.
        words_at = w_ptr + wrows + tl.arange(0, CHUNK)[None, :]
        if PACKS == 1:
            acc = tl.zeros((BLOCK_N, CHUNK), dtype=tl.float32)
            for step in range(TOP_K * K_STEPS):
                pair = token * TOP_K + step // K_STEPS
                t = step % K_STEPS
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                words = tl.load(words_at + expert * stride_we + t * CHUNK, eviction_policy="evict_first")
                acc += int4_pack_times_vector(
                    words, a_ptr + pair * stride_am, ws_ptr + expert * stride_wse + wcols * stride_wsn,
                    wz_ptr + expert * stride_wze + wcols * stride_wzn, t * (8 * CHUNK), stride_wsk, stride_wzk,
                    tl.load(weights_ptr + pair), CHUNK, GROUP_SIZE,
                )  # fmt: skip
        else:  # PACKS packs a step (K_STEPS = cdiv(packs, PACKS)), as in _pair_gate_up_kernel
            num_packs = inter // (8 * CHUNK)
            pack_in_step = tl.arange(0, PACKS)
            step_words_at = words_at[:, None, :] + (pack_in_step * CHUNK)[None, :, None]
            acc3 = tl.zeros((BLOCK_N, PACKS, CHUNK), dtype=tl.float32)
            for step in range(TOP_K * K_STEPS):
                pair = token * TOP_K + step // K_STEPS
                packs = (step % K_STEPS) * PACKS + pack_in_step
                pack_ok = packs < num_packs
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                words = tl.load(
                    step_words_at + expert * stride_we + (step % K_STEPS) * (PACKS * CHUNK),
                    mask=pack_ok[None, :, None], other=0, eviction_policy="evict_first",
                )  # fmt: skip
                acc3 += int4_packs_times_vector(
                    words, a_ptr + pair * stride_am, ws_ptr + expert * stride_wse + wcols * stride_wsn,
                    wz_ptr + expert * stride_wze + wcols * stride_wzn, packs, pack_ok, stride_wsk, stride_wzk,
                    tl.load(weights_ptr + pair), CHUNK, GROUP_SIZE,
                )  # fmt: skip
            acc = tl.sum(acc3, axis=1)
    else:
        # One loop over (expert slot, K slice), so the software pipeline keeps the loads of the next
        # expert in flight too; the routing weight scales the activation row (so one accumulator
        # serves every expert and the k outputs are summed in float32 here: no sum launch).
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for step in range(TOP_K * K_STEPS):
            pair = token * TOP_K + step // K_STEPS
            k0 = (step % K_STEPS) * BLOCK_K
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            a_at = a_ptr + pair * stride_am + k0 + ks
            w_at = w_ptr + expert * stride_we + wrows + (k0 + ks)[None, :]
            if EVEN_K:
                a = tl.load(a_at)
                w = tl.load(w_at, eviction_policy="evict_first")
            else:
                k_ok = (k0 + ks) < inter
                a = tl.load(a_at, mask=k_ok, other=0.0)
                w = tl.load(w_at, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            scaled = a.to(tl.float32) * tl.load(weights_ptr + pair)
            w = w.to(tl.float32)
            if SCALE_MODE == 1:
                w = w * tl.load(ws_ptr + expert * stride_wse + scale_rows)[:, None]
            elif SCALE_MODE == 2:
                k_block = (k0 // SCALE_BK) * stride_wsk
                w = w * tl.load(ws_ptr + expert * stride_wse + scale_rows + k_block)[:, None]
            acc += w * scaled[None, :]
    total = tl.sum(acc, axis=1)
    if HAS_RESIDUAL:
        total += tl.load(residual_ptr + token * stride_rm + cols, mask=is_col, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=is_col)


def fused_moe_gemv(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T * k] float32
    ids: torch.Tensor,  # [T, k] int32 / int64
    gate_up_tiles: GemmTiles,
    down_tiles: GemmTiles,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """fused_moe for a few tokens already routed (the caller checked the shapes, and the scales of
    FP8 weights or the scales and zeros of INT4 ones); [T, H]."""
    top_k = ids.shape[1]
    ids = ids.reshape(-1)
    # w13's rows give I for 16-bit and packed INT4 weights alike (w2's last dimension is I / 8 there).
    activated = torch.empty((ids.numel(), w13.shape[1] // 2), dtype=x.dtype, device=x.device)
    launch_pair_gate_up(
        x, w13, ids, activated, top_k, gate_up_tiles, w_scale=w13_scale, scale_block=scale_block,
        w_zeros=w13_zeros, group_size=group_size,
    )  # fmt: skip
    out = torch.empty_like(x)
    launch_token_down(
        activated, w2, ids, weights, out, top_k, down_tiles, w_scale=w2_scale, scale_block=scale_block,
        w_zeros=w2_zeros, group_size=group_size,
    )  # fmt: skip
    return out


def routed_fused_moe_gemv(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E], rows contiguous
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    round_to_logits_dtype: bool,
    gate_up_tiles: GemmTiles,
    down_tiles: GemmTiles,
    residual_norm_eps: float | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """Routing and experts for a few tokens in two launches: the gate/up kernel also routes
    (moe_routing.topk_of_row) and records each pair's expert and weight for the down kernel.

    With `residual_norm_eps`, x is the un-normalized residual stream and the router logits and
    w13 come from weights with the norm's weight folded in: returns x + the experts' output for
    RMSNorm(x) (eps `residual_norm_eps`), a new tensor (see the module docstring). FP8 weights
    come with `w13_scale` and `w2_scale`, INT4 ones with those, `w13_zeros`, `w2_zeros` and
    `group_size` (checked by the caller)."""
    num_pairs = x.shape[0] * top_k
    ids = torch.empty(num_pairs, dtype=torch.int32, device=x.device)
    weights = torch.empty(num_pairs, dtype=torch.float32, device=x.device)
    activated = torch.empty((num_pairs, w13.shape[1] // 2), dtype=x.dtype, device=x.device)
    launch_pair_gate_up(
        x, w13, ids, activated, top_k, gate_up_tiles, weights=weights, router_logits=router_logits,
        renormalize=renormalize, round_to_logits_dtype=round_to_logits_dtype, norm_eps=residual_norm_eps,
        w_scale=w13_scale, scale_block=scale_block, w_zeros=w13_zeros, group_size=group_size,
    )  # fmt: skip
    out = torch.empty_like(x)
    residual = x if residual_norm_eps is not None else None
    launch_token_down(
        activated, w2, ids, weights, out, top_k, down_tiles, residual=residual, w_scale=w2_scale,
        scale_block=scale_block, w_zeros=w2_zeros, group_size=group_size,
    )  # fmt: skip
    return out


def launch_pair_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    tiles: GemmTiles,
    *,
    weights: torch.Tensor | None = None,
    router_logits: torch.Tensor | None = None,
    renormalize: bool = False,
    round_to_logits_dtype: bool = False,
    norm_eps: float | None = None,
    w_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    w_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> None:
    """out [N, I] = silu(gate) * up of each pair p (token p // top_k); with `router_logits`, the
    kernel routes and writes `ids` and `weights` [N] itself. With `norm_eps`, x holds
    un-normalized rows whose 1/rms scales the logits and the gate and up sums. With `w_scale`,
    w13 is float8 e4m3 scaled per row ([E, 2I]) or per `scale_block`, or with `w_zeros` too INT4
    in groups of `group_size` columns (None: one group per row; see weight_scale_args)."""
    num_pairs, inter = out.shape
    hidden, num_experts = x.shape[1], w13.shape[0]
    route = router_logits is not None
    if route and (weights is None or router_logits.stride(-1) != 1):
        raise ValueError("routing in the gate/up launch needs `weights` and contiguous router logits")
    if norm_eps is not None and x.stride(-1) != 1:
        raise ValueError("the deferred norm needs x with contiguous rows")
    scale_args = _gemv_scale_args(w_scale, scale_block, tiles, w_zeros, group_size or hidden, hidden)
    _pair_gate_up_kernel[(num_pairs, triton.cdiv(inter, tiles.block_n))](
        x, w13, ids, weights if route else out, router_logits if route else x, out, hidden, inter, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), out.stride(0), router_logits.stride(0) if route else 0,
        norm_eps if norm_eps is not None else 0.0,
        TOP_K=top_k, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=hidden % tiles.block_k == 0,
        ROUTE=route, TOP_K_PAD=triton.next_power_of_2(top_k), EXPERTS_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, ROUND_TO_LOGITS_DTYPE=round_to_logits_dtype,
        NORM_SCALE=norm_eps is not None, HIDDEN_PAD=triton.next_power_of_2(hidden) if norm_eps is not None else 1,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **scale_args,
    )  # fmt: skip


def launch_token_down(
    activated: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
    top_k: int, tiles: GemmTiles, residual: torch.Tensor | None = None, *,
    w_scale: torch.Tensor | None = None, scale_block: tuple[int, int] | None = None,
    w_zeros: torch.Tensor | None = None, group_size: int | None = None,
) -> None:  # fmt: skip
    """out [T, H] = sum over each token's k pairs of weight * down(activated row) (+ residual,
    added in float32 before the one rounding; `out` must not be `residual`). With `w_scale`, w2
    is float8 e4m3 scaled per row ([E, H]) or per `scale_block`, or with `w_zeros` too INT4 in
    groups of `group_size` columns (None: one group per row; see weight_scale_args)."""
    num_tokens, hidden = out.shape
    inter = activated.shape[1]  # w2's last dimension is I / 8 for INT4
    if residual is not None and (residual.shape != out.shape or residual.data_ptr() == out.data_ptr()):
        raise ValueError(f"the residual must be another [T, H] = {tuple(out.shape)} tensor than out")
    scale_args = _gemv_scale_args(w_scale, scale_block, tiles, w_zeros, group_size or inter, inter)
    if "PACKS" in scale_args:  # INT4: steps of PACKS packs of 8 * CHUNK columns
        k_steps = triton.cdiv(inter // (8 * scale_args["CHUNK"]), scale_args["PACKS"])
    else:
        k_steps = triton.cdiv(inter, tiles.block_k)
    _token_down_kernel[(num_tokens, triton.cdiv(hidden, tiles.block_n))](
        activated, w2, ids, weights, out, residual if residual is not None else out, hidden, inter,
        activated.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        residual.stride(0) if residual is not None else 0,
        TOP_K=top_k, K_STEPS=k_steps, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=inter % tiles.block_k == 0, HAS_RESIDUAL=residual is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **scale_args,
    )  # fmt: skip


def _gemv_scale_args(
    w_scale: torch.Tensor | None, scale_block: tuple[int, int] | None, tiles: GemmTiles,
    w_zeros: torch.Tensor | None, group_size: int, columns: int,
) -> dict[str, Any]:  # fmt: skip
    """weight_scale_args for the GEMV kernels: INT4 ones also take PACKS (int4_packs_per_step)."""
    args = weight_scale_args(w_scale, scale_block, tiles, w_zeros, group_size, columns)
    if "CHUNK" in args:
        args["PACKS"] = int4_packs_per_step(tiles.block_k)
    return args


def int4_packs_per_step(block_k: int) -> int:
    """Packs an INT4 GEMV iteration loads: BLOCK_K / 256, at least 1 (a power of 2, as BLOCK_K is).
    An iteration waits for its loads, so more packs an iteration keep more bytes in flight; 256
    (one pack of the 32-word chunks of real shapes) is the default the H200 runs measured."""
    return max(1, block_k // 256)


def weight_scale_args(
    w_scale: torch.Tensor | None, scale_block: tuple[int, int] | None, tiles: GemmTiles,
    w_zeros: torch.Tensor | None = None, group_size: int | None = None, columns: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The quantized-weight arguments of the MoE kernels (here and in fused_moe.py). FP8: a float32
    `w_scale` of [E, rows] (one per output row, `scale_block` None) or [E, row blocks, K blocks]
    (`scale_block` = (rows, columns) of a block). INT4 (`w_zeros` given): `w_scale` and the uint8
    `w_zeros` [E, rows, K / group_size], `group_size` the columns of a group (resolved: K for one
    group per row) and `columns` the matrix's K (for moe_int4_layout.int4_chunk). None without a
    scale, so unscaled launches compile as they did before these arguments existed. The shapes are
    the caller's to check."""
    if w_scale is None:
        return {}
    args: dict[str, Any] = dict(ws_ptr=w_scale, stride_wse=w_scale.stride(0), stride_wsn=w_scale.stride(1))
    if w_zeros is not None:
        if group_size is None or group_size < 1:
            raise ValueError(
                f"INT4 weights need the columns per group resolved to a positive int, got {group_size}"
            )
        return {
            **args, "stride_wsk": w_scale.stride(2), "wz_ptr": w_zeros, "stride_wze": w_zeros.stride(0),
            "stride_wzn": w_zeros.stride(1), "stride_wzk": w_zeros.stride(2), "SCALE_MODE": 3,
            "GROUP_SIZE": group_size, "CHUNK": int4_chunk(columns or group_size, group_size),
        }  # fmt: skip
    if scale_block is None:
        return {**args, "SCALE_MODE": 1}
    block_n, block_k = scale_block
    if block_k % tiles.block_k:
        raise ValueError(
            f"block-scaled FP8 weights need BLOCK_K dividing the scale block's {block_k} columns, "
            f"got BLOCK_K {tiles.block_k} (clamp it, e.g. fused_moe.tiles_within_scale_block)"
        )
    args.update(stride_wsk=w_scale.stride(2), SCALE_MODE=2, SCALE_BN=block_n, SCALE_BK=block_k)
    return args


def compile_gemv(
    kernel: str, num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype, tiles: GemmTiles,
    *, renormalize: bool, round_to_logits_dtype: bool,
) -> None:  # fmt: skip
    """Compile one of the two kernels ("gate_up", routing in its launch as the engine runs it, or
    "down") for this shape without running it (the tuner's parallel warm-up; see
    fused_moe.compile_gemm)."""
    common = {
        "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages, "grid": (1, 1), "TOP_K": top_k,
    }  # fmt: skip
    if kernel == "gate_up":
        _pair_gate_up_kernel.warmup(
            dtype, dtype, torch.int32, torch.float32, dtype, dtype, hidden, inter, num_experts,
            hidden, 2 * inter * hidden, hidden, inter, num_experts, 0.0,
            EVEN_K=hidden % tiles.block_k == 0, ROUTE=True, TOP_K_PAD=triton.next_power_of_2(top_k),
            EXPERTS_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
            ROUND_TO_LOGITS_DTYPE=round_to_logits_dtype, NORM_SCALE=False, HIDDEN_PAD=1, **common,
        )  # fmt: skip
    elif kernel == "down":
        _token_down_kernel.warmup(
            dtype, dtype, torch.int32, torch.float32, dtype, dtype, hidden, inter, inter, hidden * inter, inter,
            hidden, 0, K_STEPS=triton.cdiv(inter, tiles.block_k), EVEN_K=inter % tiles.block_k == 0,
            HAS_RESIDUAL=False, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown MoE GEMV {kernel!r}; expected 'gate_up' or 'down'")
