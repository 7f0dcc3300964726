"""The routed experts of a mixture-of-experts layer on the GPU: two grouped Triton GEMMs.

For x [T, H], expert weights w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
w2 [E, H, I], and each token's top-k experts and weights:

1. the token-expert pairs are sorted into blocks of BLOCK_M rows of one expert (moe_align.py);
2. `_gate_up_kernel`: each program takes one block and BLOCK_N intermediate columns, gathers the
   block's token rows of x, multiplies them by the expert's gate and up columns (two
   accumulators over the same x tiles) and writes silu(gate) * up for each pair: [N, I];
3. `_down_kernel`: each program takes one block and BLOCK_N hidden columns of the pairs' rows
   of that, times the expert's w2, scaled by the pair's routing weight in the epilogue: [N, H];
4. the k rows of each token are summed (one torch reduction).

Every expert's weights are read once per block of its pairs, so a decode step reads top_k
experts and nothing else. Grid sizes are bounds (ExpertBlocks.max_blocks); programs past the
used blocks return at once, so nothing syncs with the host and a step can be a CUDA graph.
Rounding follows transformers' (gate/up rounded to the dtype, then the activation, then the
product; the down output rounded before the weight scales it).

gpt-oss's experts switch on compile-time flags of both GEMMs (off for every other model, whose
kernels stay as they were): per-expert biases added after each matmul, and its clamped SwiGLU in
place of silu(gate) * up in the gate/up epilogue.

FP8 experts (W8A16: `w13_scale` / `w2_scale`): float8 e4m3 weights with float32 scales per output
row or per (bn, bk) block, and 16- or 32-bit activations. Every e4m3 value is exact in bf16, fp16
and fp32, so the GEMMs convert each weight tile to the activations' dtype for tl.dot; per-row scales
multiply the float32 accumulator in the epilogue, block scales each K step's product (BLOCK_K
divides bk, so a step lies in one block: tiles_within_scale_block). The rounding after that is the
16-bit path's. Scaled launches switch on a compile-time SCALE_MODE; unscaled ones compile as before.

INT4 experts (W4A16: int32 w13 / w2 with `w13_scale`, `w2_scale`, `w13_zeros`, `w2_zeros` and
`group_size`; SCALE_MODE 3): 8 unsigned 4-bit weights per int32 word along K in
moe_int4_layout.py's packs, a scale and a zero per group of columns of a row (fused_moe_gemv.py's
module docstring). Where a pack row has at least 16 words (INT4_PLANE_MIN_CHUNK: K a multiple of
128 in real checkpoints) the GEMMs load a pack's words once and make each of its 8 nibble planes,
dequantized in float32 and rounded to the activations' dtype, the weight operand of one tl.dot with
the matching slice of the activations (INT4_PLANES); elsewhere each K step gathers and dequantizes
its tile weight by weight. Both compute what a 16-bit checkpoint of the dequantized weights would
(the GEMVs keep the float32 weights).

Tile shapes come per (E, I, H, dtype, batch) from moe_tile_configs.py, which may also send a
batch of a few tokens to fused_moe_gemv.py (two GEMV launches: no align, no sum). FP8 experts take
the tiles of their activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fused_moe_gemv import (
    dequantize_int4,
    fused_moe_gemv,
    int4_plane_minus_zero,
    int4_word_and_shift,
    int4_zero_magic,
    routed_fused_moe_gemv,
    weight_scale_args,
)
from tokenmill.kernels.triton.moe_align import ExpertBlocks, align_pairs
from tokenmill.kernels.triton.moe_int4_layout import INT4_PER_WORD, int4_chunk
from tokenmill.kernels.triton.moe_routing import topk_softmax
from tokenmill.kernels.triton.moe_tile_configs import GemmTiles, MoETiles, moe_tiles
from tokenmill.kernels.triton.rounding import round_like

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn  # the expert weights that come with scales (W8A16)
INT4_WEIGHT_DTYPE = torch.int32  # 8 packed 4-bit weights per word, with scales and zeros (W4A16)


@triton.jit
def _int4_group(row_scale_at, row_zero_at, group, stride_sk, stride_zk):
    """([N] float32 scales, [N] zeros as int4_zero_magic) of one group of N weight rows."""
    scale = tl.load(row_scale_at + group * stride_sk).to(tl.float32)
    return scale, int4_zero_magic(tl.load(row_zero_at + group * stride_zk))


# The grouped GEMMs' plane path multiplies W^T x^T from this many rows of pairs (BLOCK_M) up: the
# dequantized plane is then the left operand, which Hopper's wgmma takes from registers (a right
# one goes through shared memory first), and the pairs are its N. Below it the plain x W was the
# faster on an H200 (a Qwen3-30B-A3B layer's experts at 16 / 64 tokens, 16 rows: 278 / 462 us against
# 428 / 681 transposed; at 256-4096 tokens, 32-128 rows, transposed took 0.88-0.96x the time;
# moe-int4-grouped-h200.json, moe-int4-grouped-swapped-h200.json).
INT4_TRANSPOSED_MIN_BLOCK_M = tl.constexpr(32)


@triton.jit
def _int4_pack_at(expert_at, wcols, chunk, stride_wn, stride_wk, TRANSPOSED: tl.constexpr):
    """Pointers to the first pack's words of weight rows `wcols`: [N, CHUNK] if TRANSPOSED, else [CHUNK, N]."""
    if TRANSPOSED:  # one return: Triton wants the same type from every return, taken or not
        pack_at = expert_at + wcols[:, None] * stride_wn + chunk[None, :] * stride_wk
    else:
        pack_at = expert_at + wcols[None, :] * stride_wn + chunk[:, None] * stride_wk
    return pack_at


@triton.jit
def _int4_plane_activations(rows_at, column, chunk, is_pair, TRANSPOSED: tl.constexpr):
    """CHUNK columns from `column` of the pairs' activation rows: [CHUNK, M] if TRANSPOSED, else [M, CHUNK]."""
    if TRANSPOSED:
        x = tl.load(rows_at[None, :] + column + chunk[:, None], mask=is_pair[None, :], other=0.0)
    else:
        x = tl.load(rows_at[:, None] + column + chunk[None, :], mask=is_pair[:, None], other=0.0)
    return x


@triton.jit
def _int4_plane_operand(
    words, j: tl.constexpr, zero_magic, scale, dtype: tl.constexpr, TRANSPOSED: tl.constexpr,
    CAST_ROUNDS: tl.constexpr,
):  # fmt: skip
    """Nibble plane j of a pack's words (_int4_pack_at's orientation; moe_int4_layout.py),
    dequantized ((q - zero) * scale in float32, `scale` and `zero_magic` [N] per weight row) and
    rounded to `dtype` to nearest even, as a 16-bit checkpoint of the dequantized weights would be:
    a dot operand with the activations' CHUNK columns j * CHUNK.. of the pack. CAST_ROUNDS: the
    float32 -> dtype cast rounds so (on a GPU); else (the interpreter's cast truncates to bf16)
    round_like first, a few integer operations a weight the GPU does without."""
    if TRANSPOSED:
        w = int4_plane_minus_zero(words, j, zero_magic[:, None]) * scale[:, None]
    else:
        w = int4_plane_minus_zero(words, j, zero_magic[None, :]) * scale[None, :]
    if not CAST_ROUNDS:
        w = round_like(w, dtype)
    return w.to(dtype)


@triton.jit
def _int4_plane_dot(acc, x, w, TRANSPOSED: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x W ([M, N]), or acc + W^T x^T ([N, M]) if TRANSPOSED (operands as oriented there)."""
    if UPCAST_DOT:
        x, w = x.to(tl.float32), w.to(tl.float32)
    if TRANSPOSED:
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _block_coordinates(num_blocks_m, num_blocks_n, GROUP_M: tl.constexpr):
    """(block of pairs, block of columns) of this program: GROUP_M row blocks share column blocks
    back to back, so their weight tiles are still in L2 for the next row block."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    return pid_m, pid_n


# The batch-dependent sizes are not specialized on (divisible by 16 or not): one compiled variant
# serves every batch size, so serving never compiles after start-up.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]
    out_ptr,  # [N, I]: silu(gate) * up of each pair
    bias_ptr,  # HAS_BIAS only: [E, 2I] (gate, then up, like w's rows)
    sorted_ptr,  # ExpertBlocks.sorted_pair_ids
    block_expert_ptr,  # ExpertBlocks.block_expert_ids
    num_padded_ptr,  # ExpertBlocks.num_padded
    num_pairs,
    inter,  # I
    hidden,  # H
    top_k,
    num_blocks_m,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_be,  # bias_ptr's expert stride (HAS_BIAS only)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" for float32, else "tf32" (ignored for 16-bit)
    UPCAST_DOT: tl.constexpr,  # float32 dots for bf16 inputs (the CPU interpreter mis-multiplies bf16)
    HAS_BIAS: tl.constexpr = False,  # add the expert's gate/up bias (gpt-oss)
    # gpt-oss's clamped SwiGLU instead of silu(gate) * up: g = min(gate, LIMIT),
    # u = clamp(up, -LIMIT, LIMIT), (u + 1) * g * sigmoid(ALPHA * g).
    CLAMPED_SWIGLU: tl.constexpr = False,
    ALPHA: tl.constexpr = 0.0,
    LIMIT: tl.constexpr = 0.0,
    # FP8 weights (fused_moe_gemv.weight_scale_args). Unscaled launches leave the defaults: None is a
    # compile-time constant, so the 16-bit kernel keeps its parameters and code.
    ws_ptr=None,  # SCALE_MODE 1: float32 [E, 2I]; 2: [E, cdiv(2I, SCALE_BN), cdiv(H, SCALE_BK)]
    stride_wse=None,
    stride_wsn=None,
    stride_wsk=None,
    # 0: w unscaled, 1: e4m3 with a scale per row, 2: per block; 3: INT4, w int32 [E, 2I, H / 8]
    # with scales (x's dtype or float32) and uint8 zeros [E, 2I, H / GROUP_SIZE].
    SCALE_MODE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,  # BLOCK_K divides it
    wz_ptr=None,  # SCALE_MODE 3: the zero points, strides below
    stride_wze=None,
    stride_wzn=None,
    stride_wzk=None,
    GROUP_SIZE: tl.constexpr = 1,  # SCALE_MODE 3: columns per scale and zero
    CHUNK: tl.constexpr = 1,  # SCALE_MODE 3: words per pack row (moe_int4_layout.int4_chunk)
    INT4_PLANES: tl.constexpr = False,  # SCALE_MODE 3: whole packs, nibble planes as dot operands
    CAST_ROUNDS: tl.constexpr = False,  # INT4_PLANES: float32 -> x's dtype rounds to nearest even (_int4_plane_operand)
):
    pid_m, pid_n = _block_coordinates(num_blocks_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < inter
    # Out-of-range columns read a valid column (wrapped) and are never stored: no mask in the loop.
    wcols = (cols % inter).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_at = x_ptr + tokens[:, None] * stride_xm + ks[None, :]
    gate_at = w_ptr + expert * stride_we + wcols[None, :] * stride_wn + ks[:, None] * stride_wk
    up_at = gate_at + inter * stride_wn
    if SCALE_MODE == 1:
        gate_scale_at = ws_ptr + expert * stride_wse + wcols * stride_wsn
        up_scale_at = gate_scale_at + inter * stride_wsn
    elif SCALE_MODE == 2:
        # The up rows start a row of scale blocks (inter % SCALE_BN == 0, checked by fused_moe).
        gate_scale_at = ws_ptr + expert * stride_wse + (wcols // SCALE_BN) * stride_wsn
        up_scale_at = gate_scale_at + (inter // SCALE_BN) * stride_wsn
    elif SCALE_MODE == 3:  # columns of words, scales and zeros; the rows (K) are added each step
        gate_words_at = w_ptr + expert * stride_we + wcols[None, :] * stride_wn
        up_words_at = gate_words_at + inter * stride_wn
        gate_scale_at = ws_ptr + expert * stride_wse + wcols[None, :] * stride_wsn
        up_scale_at = gate_scale_at + inter * stride_wsn
        gate_zero_at = wz_ptr + expert * stride_wze + wcols[None, :] * stride_wzn
        up_zero_at = gate_zero_at + inter * stride_wzn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_MODE == 3 and INT4_PLANES:
        # A pack's words loaded once per matrix; each of its 8 column slices of x is loaded once and
        # multiplies the gate and the up plane (_int4_plane_operand). BLOCK_K does not apply.
        TRANSPOSED: tl.constexpr = BLOCK_M >= INT4_TRANSPOSED_MIN_BLOCK_M
        chunk = tl.arange(0, CHUNK)
        x_rows = x_ptr + tokens * stride_xm
        gate_pack_at = _int4_pack_at(
            w_ptr + expert * stride_we, wcols, chunk, stride_wn, stride_wk, TRANSPOSED
        )
        up_pack_at = gate_pack_at + inter * stride_wn
        gate_row_scale_at = ws_ptr + expert * stride_wse + wcols * stride_wsn
        up_row_scale_at = gate_row_scale_at + inter * stride_wsn
        gate_row_zero_at = wz_ptr + expert * stride_wze + wcols * stride_wzn
        up_row_zero_at = gate_row_zero_at + inter * stride_wzn
        if TRANSPOSED:
            acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for pack in range(hidden // (8 * CHUNK)):
            gate_words = tl.load(gate_pack_at + pack * CHUNK * stride_wk)
            up_words = tl.load(up_pack_at + pack * CHUNK * stride_wk)
            for j in tl.static_range(8):
                column = pack * 8 * CHUNK + j * CHUNK
                if (j * CHUNK) % GROUP_SIZE == 0:  # a group starts here (at j = 0 only, for groups >= a pack)
                    group = column // GROUP_SIZE
                    gate_scale, gate_zero = _int4_group(
                        gate_row_scale_at, gate_row_zero_at, group, stride_wsk, stride_wzk
                    )
                    up_scale, up_zero = _int4_group(
                        up_row_scale_at, up_row_zero_at, group, stride_wsk, stride_wzk
                    )
                x = _int4_plane_activations(x_rows, column, chunk, is_pair, TRANSPOSED)
                gate = _int4_plane_operand(
                    gate_words, j, gate_zero, gate_scale, x_ptr.dtype.element_ty, TRANSPOSED, CAST_ROUNDS
                )
                up = _int4_plane_operand(
                    up_words, j, up_zero, up_scale, x_ptr.dtype.element_ty, TRANSPOSED, CAST_ROUNDS
                )
                acc_gate = _int4_plane_dot(acc_gate, x, gate, TRANSPOSED, UPCAST_DOT, PRECISION)
                acc_up = _int4_plane_dot(acc_up, x, up, TRANSPOSED, UPCAST_DOT, PRECISION)
        if TRANSPOSED:
            acc_gate = tl.trans(acc_gate)
            acc_up = tl.trans(acc_up)
    else:
        for k0 in range(0, hidden, BLOCK_K):
            if SCALE_MODE == 3:
                in_k = (k0 + ks) < hidden
                if EVEN_K:
                    x = tl.load(x_at, mask=is_pair[:, None], other=0.0)
                else:
                    x = tl.load(x_at, mask=is_pair[:, None] & in_k[None, :], other=0.0)
                kk, k_ok = (k0 + ks)[:, None], in_k[:, None]
                word, shifts = int4_word_and_shift(kk, CHUNK)
                word *= stride_wk
                group = kk // GROUP_SIZE
                gate = dequantize_int4(
                    gate_words_at + word, gate_scale_at + group * stride_wsk, gate_zero_at + group * stride_wzk,
                    shifts, k_ok, EVEN_K,
                )  # fmt: skip
                up = dequantize_int4(
                    up_words_at + word, up_scale_at + group * stride_wsk, up_zero_at + group * stride_wzk,
                    shifts, k_ok, EVEN_K,
                )  # fmt: skip
                # Rounded to x's dtype as a 16-bit checkpoint of the dequantized weights would be; by
                # round_like, as the interpreter's float32 -> bf16 cast truncates (Triton 3.9), after
                # which the cast is exact.
                gate = round_like(gate, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
                up = round_like(up, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
            elif EVEN_K:
                x = tl.load(x_at, mask=is_pair[:, None], other=0.0)
                gate = tl.load(gate_at)
                up = tl.load(up_at)
            else:
                k_ok = (k0 + ks) < hidden
                x = tl.load(x_at, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
                gate = tl.load(gate_at, mask=k_ok[:, None], other=0.0)
                up = tl.load(up_at, mask=k_ok[:, None], other=0.0)
            if UPCAST_DOT:
                x, gate, up = x.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
            elif SCALE_MODE != 0:  # e4m3 -> x's dtype is exact
                gate, up = gate.to(x.dtype), up.to(x.dtype)
            if SCALE_MODE == 2:  # this K step's product times its block's scales
                k_block = (k0 // SCALE_BK) * stride_wsk
                part = tl.dot(x, gate, input_precision=PRECISION)
                acc_gate += part * tl.load(gate_scale_at + k_block)[None, :]
                part = tl.dot(x, up, input_precision=PRECISION)
                acc_up += part * tl.load(up_scale_at + k_block)[None, :]
            else:
                acc_gate = tl.dot(x, gate, acc_gate, input_precision=PRECISION)
                acc_up = tl.dot(x, up, acc_up, input_precision=PRECISION)
            x_at += BLOCK_K
            gate_at += BLOCK_K * stride_wk
            up_at += BLOCK_K * stride_wk
    if SCALE_MODE == 1:
        acc_gate *= tl.load(gate_scale_at)[None, :]
        acc_up *= tl.load(up_scale_at)[None, :]
    dtype = out_ptr.dtype.element_ty
    g = round_like(acc_gate, dtype)
    u = round_like(acc_up, dtype)
    if HAS_BIAS:  # rounded after the matmul, then after the add (transformers' order)
        bias_at = bias_ptr + expert * stride_be + wcols
        g = round_like(g + tl.load(bias_at).to(tl.float32)[None, :], dtype)
        u = round_like(u + tl.load(bias_at + inter).to(tl.float32)[None, :], dtype)
    if CLAMPED_SWIGLU:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        scaled = round_like(g * ALPHA, dtype)
        glu = round_like(g * round_like(1.0 / (1.0 + tl.exp(-scaled)), dtype), dtype)
        act = round_like(u + 1.0, dtype) * glu
    else:
        act = round_like(g / (1.0 + tl.exp(-g)), dtype) * u
    out_at = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_at, act.to(dtype), mask=is_pair[:, None] & is_col[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _down_kernel(
    a_ptr,  # [N, I]: _gate_up_kernel's output
    w_ptr,  # [E, H, I]
    out_ptr,  # [N, H]: each pair's expert output times its routing weight
    weights_ptr,  # [N] float32 routing weight of each pair
    bias_ptr,  # HAS_BIAS only: [E, H]
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    hidden,  # H: output columns
    inter,  # I: the reduction
    num_blocks_m,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_be,  # bias_ptr's expert stride (HAS_BIAS only)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,  # add the expert's down bias before the routing weight scales it
    # FP8 weights, as in _gate_up_kernel: [E, H] or [E, cdiv(H, SCALE_BN), cdiv(I, SCALE_BK)].
    ws_ptr=None,
    stride_wse=None,
    stride_wsn=None,
    stride_wsk=None,
    SCALE_MODE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
    wz_ptr=None,  # SCALE_MODE 3 (INT4), as in _gate_up_kernel: w [E, H, I / 8], [E, H, I / G]
    stride_wze=None,
    stride_wzn=None,
    stride_wzk=None,
    GROUP_SIZE: tl.constexpr = 1,
    CHUNK: tl.constexpr = 1,
    INT4_PLANES: tl.constexpr = False,
    CAST_ROUNDS: tl.constexpr = False,
):
    pid_m, pid_n = _block_coordinates(num_blocks_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    rows = pairs.to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < hidden
    wcols = (cols % hidden).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_at = a_ptr + rows[:, None] * stride_am + ks[None, :]
    w_at = w_ptr + expert * stride_we + wcols[None, :] * stride_wn + ks[:, None] * stride_wk
    if SCALE_MODE == 1:
        scale_at = ws_ptr + expert * stride_wse + wcols * stride_wsn
    elif SCALE_MODE == 2:
        scale_at = ws_ptr + expert * stride_wse + (wcols // SCALE_BN) * stride_wsn
    elif SCALE_MODE == 3:
        words_at = w_ptr + expert * stride_we + wcols[None, :] * stride_wn
        scale_at = ws_ptr + expert * stride_wse + wcols[None, :] * stride_wsn
        zero_at = wz_ptr + expert * stride_wze + wcols[None, :] * stride_wzn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_MODE == 3 and INT4_PLANES:  # as in _gate_up_kernel
        TRANSPOSED: tl.constexpr = BLOCK_M >= INT4_TRANSPOSED_MIN_BLOCK_M
        chunk = tl.arange(0, CHUNK)
        a_rows = a_ptr + rows * stride_am
        pack_at = _int4_pack_at(w_ptr + expert * stride_we, wcols, chunk, stride_wn, stride_wk, TRANSPOSED)
        row_scale_at = ws_ptr + expert * stride_wse + wcols * stride_wsn
        row_zero_at = wz_ptr + expert * stride_wze + wcols * stride_wzn
        if TRANSPOSED:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for pack in range(inter // (8 * CHUNK)):
            words = tl.load(pack_at + pack * CHUNK * stride_wk)
            for j in tl.static_range(8):
                column = pack * 8 * CHUNK + j * CHUNK
                if (j * CHUNK) % GROUP_SIZE == 0:
                    w_scale, w_zero = _int4_group(
                        row_scale_at, row_zero_at, column // GROUP_SIZE, stride_wsk, stride_wzk
                    )
                a = _int4_plane_activations(a_rows, column, chunk, is_pair, TRANSPOSED)
                w = _int4_plane_operand(
                    words, j, w_zero, w_scale, a_ptr.dtype.element_ty, TRANSPOSED, CAST_ROUNDS
                )
                acc = _int4_plane_dot(acc, a, w, TRANSPOSED, UPCAST_DOT, PRECISION)
        if TRANSPOSED:
            acc = tl.trans(acc)
    else:
        for k0 in range(0, inter, BLOCK_K):
            if SCALE_MODE == 3:
                in_k = (k0 + ks) < inter
                if EVEN_K:
                    a = tl.load(a_at, mask=is_pair[:, None], other=0.0)
                else:
                    a = tl.load(a_at, mask=is_pair[:, None] & in_k[None, :], other=0.0)
                kk, k_ok = (k0 + ks)[:, None], in_k[:, None]
                word, shifts = int4_word_and_shift(kk, CHUNK)
                w = dequantize_int4(
                    words_at + word * stride_wk, scale_at + (kk // GROUP_SIZE) * stride_wsk,
                    zero_at + (kk // GROUP_SIZE) * stride_wzk, shifts, k_ok, EVEN_K,
                )  # fmt: skip
                w = round_like(w, a_ptr.dtype.element_ty).to(a_ptr.dtype.element_ty)  # as in _gate_up_kernel
            elif EVEN_K:
                a = tl.load(a_at, mask=is_pair[:, None], other=0.0)
                w = tl.load(w_at)
            else:
                k_ok = (k0 + ks) < inter
                a = tl.load(a_at, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_at, mask=k_ok[:, None], other=0.0)
            if UPCAST_DOT:
                a, w = a.to(tl.float32), w.to(tl.float32)
            elif SCALE_MODE != 0:  # e4m3 -> a's dtype is exact
                w = w.to(a.dtype)
            if SCALE_MODE == 2:
                part = tl.dot(a, w, input_precision=PRECISION)
                acc += part * tl.load(scale_at + (k0 // SCALE_BK) * stride_wsk)[None, :]
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_at += BLOCK_K
            w_at += BLOCK_K * stride_wk
    if SCALE_MODE == 1:
        acc *= tl.load(scale_at)[None, :]
    dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + rows, mask=is_pair, other=0.0)
    y = round_like(acc, dtype)
    if HAS_BIAS:
        y = round_like(y + tl.load(bias_ptr + expert * stride_be + wcols).to(tl.float32)[None, :], dtype)
    y = y * routing[:, None]
    out_at = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_at, y.to(dtype), mask=is_pair[:, None] & is_col[None, :])


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoETiles | None = None,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    clamped_swiglu: tuple[float, float] | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), each expert a SwiGLU
    MLP (down(silu(gate(x)) * up(x))): [T, H] in x's dtype.

    x [T, H]; w13 [E, 2I, H] and w2 [E, H, I] with contiguous last dimensions; topk_weights
    [T, k] (float32) and topk_ids [T, k] (int32 or int64). `tiles` defaults to the tuned (or
    default) tiles for this shape and batch.

    gpt-oss's experts: `gate_up_bias` [E, 2I] and `down_bias` [E, H] (the latter added before the
    routing weight scales the output), and `clamped_swiglu` = (alpha, limit) for its activation
    (see _gate_up_kernel). These switch the kernels' compile-time flags; without them the kernels
    are the plain ones. They run on the grouped path only (the GEMV kernels have no epilogue
    for them): a batch the tiles send to the GEMVs takes the smallest grouped tiles instead.

    FP8 experts (W8A16): w13 and w2 float8_e4m3fn (x bf16, fp16 or fp32) with float32 scales,
    `w13_scale` [E, 2I] and `w2_scale` [E, H] (one per output row: gate rows, then up rows), or
    with `scale_block` = (bn, bk) one per block of bn rows and bk columns: [E, cdiv(2I, bn),
    cdiv(H, bk)] and [E, cdiv(H, bn), cdiv(I, bk)] (I a multiple of bn). The result is that of
    the weights dequantized (q * scale in float32), rounded as the 16-bit path rounds. Not with
    gpt-oss's epilogue.

    INT4 experts (W4A16): w13 int32 [E, 2I, H / 8] and w2 int32 [E, H, I / 8], each row packed
    along K in moe_int4_layout.py's packs (`pack_int4_experts`; unsigned 0..15), with `w13_scale`
    [E, 2I, H / G] and `w2_scale` [E, H, I / G] (x's dtype or float32) and uint8 `w13_zeros` / `w2_zeros`
    of the same shapes (0..15; 8 for symmetric checkpoints), G = `group_size` (a multiple of 8
    dividing H and I; None: one group per row, G = H for w13 and I for w2). W[e, n, k] =
    (q[e, n, k] - zeros[e, n, k // G]) * scale[e, n, k // G] in float32; the grouped GEMMs round it
    to x's dtype (as a 16-bit checkpoint of W), the GEMVs keep it in float32. Not with gpt-oss's
    epilogue, nor the deferred norm.
    """
    top_k = topk_ids.shape[1]
    _check_shapes(x, w13, w2)
    if tuple(topk_weights.shape) != (x.shape[0], top_k):
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} differ"
        )
    epilogue = _ExpertEpilogue.check(w13, w2, gate_up_bias, down_bias, clamped_swiglu)
    scales = _ExpertScales.check(
        x, w13, w2, w13_scale, w2_scale, scale_block, w13_zeros=w13_zeros, w2_zeros=w2_zeros,
        group_size=group_size,
    )  # fmt: skip
    if scales is not None and not epilogue.is_plain:
        kind = "INT4" if scales.is_int4 else "FP8"
        raise ValueError(
            f"{kind} experts (w13_scale / w2_scale) with gpt-oss's biases or clamped SwiGLU are not supported; "
            "pass 16-bit weights for those"
        )
    if x.shape[0] == 0:
        return torch.empty_like(x)
    given = tiles is not None
    tiles = tiles or moe_tiles(w13.shape[0], w13.shape[1] // 2, x.shape[1], x.dtype, x.shape[0], top_k)
    if scales is not None:
        tiles = tiles_within_scale_block(tiles, scales.block)
        if scales.is_int4:
            tiles = tiles_for_int4(
                tiles, x.shape[0], given, hidden=x.shape[1], inter=w13.shape[1] // 2,
                group_size=scales.group_size,
            )  # fmt: skip
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32:
        weights = weights.float()
    if tiles.method == "gemv":
        if epilogue.is_plain:
            quantized = _gemv_scale_kwargs(scales)
            return fused_moe_gemv(x, w13, w2, weights, topk_ids, tiles.gate_up, tiles.down, **quantized)
        tiles = _smallest_grouped_tiles(x.dtype)
    return _grouped(x, w13, w2, weights, topk_ids, tiles, epilogue, scales)


@dataclass(frozen=True, slots=True)
class _ExpertEpilogue:
    """What the two GEMMs add to plain SwiGLU experts (gpt-oss): biases, the clamped SwiGLU."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    clamped_swiglu: tuple[float, float] | None = None

    @property
    def is_plain(self) -> bool:
        return self.gate_up_bias is None and self.down_bias is None and self.clamped_swiglu is None

    @staticmethod
    def check(
        w13: torch.Tensor, w2: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
        clamped_swiglu: tuple[float, float] | None,
    ) -> _ExpertEpilogue:  # fmt: skip
        for name, bias, shape in (
            ("gate_up_bias", gate_up_bias, (w13.shape[0], w13.shape[1])),
            ("down_bias", down_bias, (w2.shape[0], w2.shape[1])),
        ):
            if bias is not None and (tuple(bias.shape) != shape or bias.stride(-1) != 1):
                raise ValueError(f"{name} must be a {list(shape)} tensor with a contiguous last dimension, "
                                 f"got {tuple(bias.shape)}")  # fmt: skip
        if clamped_swiglu is not None:
            alpha, limit = clamped_swiglu
            clamped_swiglu = (float(alpha), float(limit))
        return _ExpertEpilogue(gate_up_bias, down_bias, clamped_swiglu)


@dataclass(frozen=True, slots=True)
class _ExpertScales:
    """The float32 scales of FP8 expert weights: per output row, or per `block` (bn, bk); or the
    scales and uint8 zeros of INT4 weights per `group_size` columns (None: per row); none for
    16/32-bit weights."""

    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    block: tuple[int, int] | None = None
    w13_zeros: torch.Tensor | None = None
    w2_zeros: torch.Tensor | None = None
    group_size: int | None = None

    @property
    def is_int4(self) -> bool:
        return self.w13_zeros is not None

    @staticmethod
    def check(
        x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
        w2_scale: torch.Tensor | None, scale_block: tuple[int, int] | None, *,
        w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None,
        group_size: int | None = None,
    ) -> _ExpertScales | None:  # fmt: skip
        """The scales, checked against the weights' shapes (_check_shapes already passed); None for
        unscaled (16/32-bit) weights."""
        weight_dtypes = f"w13 {w13.dtype} and w2 {w2.dtype}"
        if w13.dtype == INT4_WEIGHT_DTYPE:  # _check_shapes made w2 int32 too
            return _ExpertScales._check_int4(
                x, w2, w13_scale, w2_scale, scale_block, w13_zeros, w2_zeros, group_size
            )
        if w13_zeros is not None or w2_zeros is not None or group_size is not None:
            raise ValueError(f"w13_zeros, w2_zeros and group_size go with INT4 experts (int32-packed w13 and w2); "
                             f"got {weight_dtypes}")  # fmt: skip
        if w13_scale is None and w2_scale is None:
            if scale_block is not None:
                raise ValueError(f"scale_block {scale_block} needs w13_scale and w2_scale; got neither")
            if FP8_WEIGHT_DTYPE in (w13.dtype, w2.dtype):
                raise ValueError(f"float8_e4m3fn expert weights need w13_scale and w2_scale; got "
                                 f"{weight_dtypes} without scales")  # fmt: skip
            return None
        if w13_scale is None or w2_scale is None:
            given = "w13_scale" if w13_scale is not None else "w2_scale"
            raise ValueError(f"FP8 experts need both w13_scale and w2_scale; got only {given}")
        if w13.dtype != FP8_WEIGHT_DTYPE or w2.dtype != FP8_WEIGHT_DTYPE:
            raise ValueError(f"w13_scale and w2_scale scale float8_e4m3fn weights; got {weight_dtypes}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"FP8 experts take bfloat16, float16 or float32 activations; got x {x.dtype}")
        num_experts, hidden, inter = w2.shape
        if scale_block is None:
            w13_shape, w2_shape = (num_experts, 2 * inter), (num_experts, hidden)
            layout = "one scale per output row"
        else:
            if len(scale_block) != 2 or any(b < 16 or b & (b - 1) for b in scale_block):
                raise ValueError(f"scale_block must be (rows, columns), powers of 2 >= 16; got {scale_block}")
            block_n, block_k = scale_block = (int(scale_block[0]), int(scale_block[1]))
            if inter % block_n:
                raise ValueError(f"block-scaled FP8 experts need the intermediate size I = {inter} to be a "
                                 f"multiple of the scale block's {block_n} rows (so the up rows start a "
                                 "block)")  # fmt: skip
            w13_shape = (num_experts, triton.cdiv(2 * inter, block_n), triton.cdiv(hidden, block_k))
            w2_shape = (num_experts, triton.cdiv(hidden, block_n), triton.cdiv(inter, block_k))
            layout = f"one scale per {block_n}x{block_k} block"
        expected = (("w13_scale", w13_scale, w13_shape, w13), ("w2_scale", w2_scale, w2_shape, w2))
        for name, scale, shape, weight in expected:
            if scale.dtype != torch.float32 or tuple(scale.shape) != shape:
                raise ValueError(f"{name} must be a float32 {list(shape)} tensor ({layout}); got "
                                 f"{scale.dtype} {list(scale.shape)}")  # fmt: skip
            if scale.device != weight.device:
                raise ValueError(f"{name} is on {scale.device}, its weights on {weight.device}")
        return _ExpertScales(w13_scale, w2_scale, scale_block)

    @staticmethod
    def _check_int4(
        x: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
        scale_block: tuple[int, int] | None, w13_zeros: torch.Tensor | None, w2_zeros: torch.Tensor | None,
        group_size: int | None,
    ) -> _ExpertScales:  # fmt: skip
        given = {"w13_scale": w13_scale, "w2_scale": w2_scale, "w13_zeros": w13_zeros, "w2_zeros": w2_zeros}
        missing = [name for name, tensor in given.items() if tensor is None]
        if missing:
            raise ValueError(f"INT4 experts (int32 w13 and w2) need w13_scale, w2_scale, w13_zeros and w2_zeros; "
                             f"missing {', '.join(missing)}")  # fmt: skip
        assert (
            w13_scale is not None and w2_scale is not None and w13_zeros is not None and w2_zeros is not None
        )
        if scale_block is not None:
            raise ValueError(f"scale_block is for block-scaled FP8 experts; INT4 experts take group_size, "
                             f"got scale_block {scale_block}")  # fmt: skip
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"INT4 experts take bfloat16, float16 or float32 activations; got x {x.dtype}")
        num_experts, hidden, packed_inter = w2.shape
        inter = packed_inter * INT4_PER_WORD
        # Whole words per group: a faster kernel can then load a group's words as one block.
        bad_group = group_size is not None and (
            not isinstance(group_size, int) or group_size < INT4_PER_WORD or group_size % INT4_PER_WORD
            or hidden % group_size or inter % group_size
        )  # fmt: skip
        if bad_group:
            raise ValueError(f"group_size must be a multiple of 8 dividing the hidden size H = {hidden} and the "
                             f"intermediate size I = {inter} (or None: one group per row); got {group_size!r}")  # fmt: skip
        w13_groups = hidden // (group_size or hidden)
        w2_groups = inter // (group_size or inter)
        layout = f"one per {group_size} columns" if group_size else "one per row (group_size None)"
        expected = (
            ("w13_scale", w13_scale, "w13_zeros", w13_zeros, (num_experts, 2 * inter, w13_groups)),
            ("w2_scale", w2_scale, "w2_zeros", w2_zeros, (num_experts, hidden, w2_groups)),
        )
        for scale_name, scale, zeros_name, zeros, shape in expected:
            scale_dtypes = (x.dtype, torch.float32)
            if scale.dtype not in scale_dtypes or tuple(scale.shape) != shape:
                raise ValueError(f"{scale_name} must be a {list(shape)} tensor of x's dtype {x.dtype} or float32 "
                                 f"({layout}); got {scale.dtype} {list(scale.shape)}")  # fmt: skip
            if zeros.dtype != torch.uint8 or tuple(zeros.shape) != shape:
                raise ValueError(f"{zeros_name} must be a uint8 {list(shape)} tensor ({layout}, values 0..15); "
                                 f"got {zeros.dtype} {list(zeros.shape)}")  # fmt: skip
            for name, tensor in ((scale_name, scale), (zeros_name, zeros)):
                if tensor.device != w2.device:
                    raise ValueError(f"{name} is on {tensor.device}, the expert weights on {w2.device}")
        return _ExpertScales(w13_scale, w2_scale, None, w13_zeros, w2_zeros, group_size)


def tiles_within_scale_block(tiles: MoETiles, scale_block: tuple[int, int] | None) -> MoETiles:
    """`tiles` with each kernel's block_k at most the scale block's bk columns, so a K step lies
    in one block of scales (both powers of two: the smaller divides the larger)."""
    if scale_block is None:
        return tiles
    block_k = scale_block[1]
    gate_up = replace(tiles.gate_up, block_k=min(tiles.gate_up.block_k, block_k))
    down = replace(tiles.down, block_k=min(tiles.down.block_k, block_k))
    return replace(tiles, gate_up=gate_up, down=down)


# The INT4 GEMVs' (gate/up, down) tiles for one token and for more (gate/up BLOCK_N counts gate
# rows: the tile holds as many up rows too). The fastest of benchmarks/moe_fp8_tiles.py --weights
# int4 on an H200 at Qwen3-30B-A3B expert shapes at 1, 4 and 8 tokens (BENCHMARKS.md); the 16-bit
# tuner's tiles took 1.4-1.8x as long. One token: two packs an iteration (BLOCK_K 512) with 4 warps,
# 26.8 us a layer against 29.6 with one pack (moe-int4-tiles-packs-h200.json); at 4 and 8 tokens
# more packs were slower (one pack, 2 warps stays).
INT4_GEMV_TILES = {
    "one token": (GemmTiles(block_n=16, block_k=512, num_warps=4, num_stages=2),
                  GemmTiles(block_n=4, block_k=512, num_warps=4, num_stages=2)),
    "more": (GemmTiles(block_n=16, block_k=256, num_warps=2, num_stages=2),
             GemmTiles(block_n=8, block_k=256, num_warps=2, num_stages=2)),
}  # fmt: skip


# The grouped INT4 GEMMs' plane path (_int4_plane_operand): packs of at least 16 words, a tl.dot's
# K. Smaller packs (K not a multiple of 128, tiny models) gather a word, a scale and a zero per weight.
INT4_PLANE_MIN_CHUNK = 16


def int4_planes(columns: int, group_size: int | None) -> bool:
    """Whether a grouped INT4 GEMM over `columns` (K) in groups of `group_size` takes the plane path."""
    return int4_chunk(columns, group_size or columns) >= INT4_PLANE_MIN_CHUNK


def int4_plane_stages(tiles: GemmTiles, block_m: int) -> int:
    """Pipeline stages for the plane path: the tiles' own, at most 2 from 64 rows of pairs up and 3
    below. Measured on an H200 at Qwen3-30B-A3B shapes (moe-int4-grouped-*-h200.json): at 128 x 128
    tiles 3 stages asked 266-283 KB of shared memory (227 KiB there); 2 were the fastest at 64-128
    rows (512-4096 tokens; 3 took 1.2x as long at 512), 3 at 16-32 rows (16-256 tokens)."""
    return max(1, min(tiles.num_stages, 2 if block_m >= 64 else 3))


def tiles_for_int4(
    tiles: MoETiles, num_tokens: int, keep_gemv_tiles: bool = False, *, hidden: int, inter: int,
    group_size: int | None,
) -> MoETiles:  # fmt: skip
    """INT4 tiles for experts of `hidden` (H) and `inter` (I) in groups of `group_size` columns
    (None: one per row). The GEMVs (which load each word once, BLOCK_K / 256 packs an iteration:
    fused_moe_gemv.int4_packs_per_step) take INT4_GEMV_TILES unless `keep_gemv_tiles` (tiles the
    caller chose). The grouped GEMMs keep the 16-bit tiles with, per kernel: on the plane path
    (int4_planes) at most int4_plane_stages stages; gathering, block_k at most 64 and one stage
    (pipelining those [BLOCK_N, BLOCK_K] gathers staged several times the H200's 227 KiB of shared
    memory at the 16-bit tiles: 0.3-0.6 MB asked)."""
    if tiles.method == "gemv":
        if keep_gemv_tiles:
            return tiles
        gate_up, down = INT4_GEMV_TILES["one token" if num_tokens == 1 else "more"]
        return replace(tiles, gate_up=gate_up, down=down)

    def grouped(kernel_tiles: GemmTiles, columns: int) -> GemmTiles:
        if int4_planes(columns, group_size):
            return replace(kernel_tiles, num_stages=int4_plane_stages(kernel_tiles, tiles.block_m))
        return replace(kernel_tiles, block_k=min(kernel_tiles.block_k, 64), num_stages=1)

    return replace(tiles, gate_up=grouped(tiles.gate_up, hidden), down=grouped(tiles.down, inter))


def _gemv_scale_kwargs(scales: _ExpertScales | None) -> dict[str, Any]:
    """The GEMV functions' FP8 or INT4 keyword arguments: none for unscaled weights."""
    if scales is None:
        return {}
    if scales.is_int4:
        return {
            "w13_scale": scales.w13, "w2_scale": scales.w2, "w13_zeros": scales.w13_zeros,
            "w2_zeros": scales.w2_zeros, "group_size": scales.group_size,
        }  # fmt: skip
    return {"w13_scale": scales.w13, "w2_scale": scales.w2, "scale_block": scales.block}


def _smallest_grouped_tiles(dtype: torch.dtype) -> MoETiles:
    """Grouped tiles for a few tokens (default_tiles' smallest grouped ones)."""
    if dtype == torch.float32:
        tiles = GemmTiles(block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2)
    else:
        tiles = GemmTiles(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    return MoETiles(16, tiles, tiles)


def routed_fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    round_to_logits_dtype: bool,
    tiles: MoETiles | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """The experts' output for router logits [T, E]: top-k of their softmax (moe_routing.py),
    then fused_moe. On the few-token path the routing happens inside the gate/up launch. FP8
    and INT4 experts come with their scales (and zeros, group size), as in fused_moe."""
    _check_shapes(x, w13, w2)
    scales = _ExpertScales.check(
        x, w13, w2, w13_scale, w2_scale, scale_block, w13_zeros=w13_zeros, w2_zeros=w2_zeros,
        group_size=group_size,
    )  # fmt: skip
    if x.shape[0] == 0:
        return torch.empty_like(x)
    given = tiles is not None
    tiles = tiles or moe_tiles(w13.shape[0], w13.shape[1] // 2, x.shape[1], x.dtype, x.shape[0], top_k)
    if scales is not None:
        tiles = tiles_within_scale_block(tiles, scales.block)
        if scales.is_int4:
            tiles = tiles_for_int4(
                tiles, x.shape[0], given, hidden=x.shape[1], inter=w13.shape[1] // 2,
                group_size=scales.group_size,
            )  # fmt: skip
    if tiles.method == "gemv":
        return routed_fused_moe_gemv(
            x, router_logits, w13, w2, top_k, renormalize, round_to_logits_dtype, tiles.gate_up, tiles.down,
            **_gemv_scale_kwargs(scales),
        )  # fmt: skip
    weights, ids = topk_softmax(router_logits, top_k, renormalize, round_to_logits_dtype)
    return _grouped(x, w13, w2, weights.reshape(-1), ids, tiles, scales=scales)


def takes_residual(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> bool:
    """Whether routed_fused_moe_from_residual serves `num_tokens` tokens: where the tile configs
    pick the few-token GEMV path, whose launches apply the deferred norm. Never for FP8 or INT4
    experts: the model does not fold the norm into quantized weights."""
    if FP8_WEIGHT_DTYPE in (w13.dtype, w2.dtype) or INT4_WEIGHT_DTYPE in (w13.dtype, w2.dtype):
        return False
    return moe_tiles(w13.shape[0], w2.shape[2], w13.shape[2], w13.dtype, num_tokens, top_k).method == "gemv"


def routed_fused_moe_from_residual(
    x: torch.Tensor,  # [T, H] the un-normalized residual stream
    router_logits: torch.Tensor,  # [T, E] of x through the router with the norm weight folded in
    w13: torch.Tensor,  # the norm weight folded in along H
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    round_to_logits_dtype: bool,
    eps: float,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """x + routed_fused_moe(RMSNorm(x)) without a norm launch (fused_moe_gemv.py's deferred
    norm); only where takes_residual says so."""
    _check_shapes(x, w13, w2)
    for quantized in (FP8_WEIGHT_DTYPE, INT4_WEIGHT_DTYPE):
        if quantized in (w13.dtype, w2.dtype):
            raise ValueError(f"the deferred norm takes 16/32-bit experts, not {str(quantized).removeprefix('torch.')}"
                             f" (got w13 {w13.dtype}, w2 {w2.dtype}; see takes_residual)")  # fmt: skip
    tiles = tiles or moe_tiles(w13.shape[0], w2.shape[2], x.shape[1], x.dtype, x.shape[0], top_k)
    if tiles.method != "gemv":
        raise ValueError(f"{x.shape[0]} tokens take the grouped path, which has no deferred norm")
    return routed_fused_moe_gemv(
        x, router_logits, w13, w2, top_k, renormalize, round_to_logits_dtype, tiles.gate_up, tiles.down,
        residual_norm_eps=eps,
    )  # fmt: skip


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    hidden = x.shape[1]
    num_experts, two_inter, w13_hidden = w13.shape
    inter = two_inter // 2
    if INT4_WEIGHT_DTYPE in (w13.dtype, w2.dtype):
        if w13.dtype != w2.dtype:
            raise ValueError(
                f"INT4 experts need both w13 and w2 packed in int32; got w13 {w13.dtype}, w2 {w2.dtype}"
            )
        for name, size in (("hidden size H", hidden), ("intermediate size I", inter)):
            if size % INT4_PER_WORD:
                raise ValueError(f"INT4 experts need the {name} = {size} to be a multiple of 8 (8 weights per "
                                 "int32 word)")  # fmt: skip
        w13_shape = (num_experts, two_inter, hidden // INT4_PER_WORD)
        w2_shape = (num_experts, hidden, inter // INT4_PER_WORD)
        if tuple(w13.shape) != w13_shape or tuple(w2.shape) != w2_shape or two_inter % 2:
            raise ValueError(
                f"INT4 expert weights must be int32 [E, 2I, H / 8] and [E, H, I / 8] (8 weights a word along "
                f"K) for hidden {hidden}: {w13_shape} and {w2_shape}; got {tuple(w13.shape)} and {tuple(w2.shape)}"
            )
    elif w13_hidden != hidden or tuple(w2.shape) != (num_experts, hidden, inter) or two_inter % 2:
        raise ValueError(
            f"expert weights must be [E, 2I, H] and [E, H, I] for hidden {hidden}; got "
            f"{tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe needs x, w13 and w2 with contiguous last dimensions")


def _grouped(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, topk_ids: torch.Tensor,
    tiles: MoETiles, epilogue: _ExpertEpilogue | None = None, scales: _ExpertScales | None = None,
) -> torch.Tensor:  # fmt: skip
    """Align, the two grouped GEMMs, the sum over k (weights: [T * k] float32; with `scales`,
    tiles whose block_k fits their scale blocks: tiles_within_scale_block)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    blocks = align_pairs(topk_ids, w13.shape[0], tiles.block_m)
    num_pairs = num_tokens * top_k
    activated = torch.empty((num_pairs, w13.shape[1] // 2), dtype=x.dtype, device=x.device)
    epilogue = epilogue or _ExpertEpilogue()
    scales = scales or _ExpertScales()
    _launch_gate_up(
        x, w13, activated, blocks, top_k, tiles.gate_up, epilogue, scales.w13, scales.block, scales.w13_zeros,
        scales.group_size,
    )  # fmt: skip
    expert_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _launch_down(
        activated, w2, expert_out, weights, blocks, tiles.down, epilogue.down_bias, scales.w2, scales.block,
        scales.w2_zeros, scales.group_size,
    )  # fmt: skip
    if top_k == 1:
        return expert_out
    return torch.sum(expert_out.view(num_tokens, top_k, hidden), dim=1)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _cast_rounds(x: torch.Tensor) -> bool:
    """Whether a kernel's float32 -> x.dtype cast rounds to nearest even: on a GPU; the CPU
    interpreter truncates to bf16 (Triton 3.9)."""
    return x.device.type == "cuda"


def _upcast_dot(x: torch.Tensor) -> bool:
    """The CPU interpreter multiplies bf16 tiles wrongly (Triton 3.9): float32 dots there."""
    return x.device.type != "cuda" and x.dtype == torch.bfloat16


def _launch_gate_up(
    x: torch.Tensor, w13: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, top_k: int, tiles: GemmTiles,
    epilogue: _ExpertEpilogue, w_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None, w_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> None:  # fmt: skip
    inter, hidden = w13.shape[1] // 2, x.shape[1]  # w13's last dimension is H / 8 for INT4
    grid = (blocks.max_blocks * triton.cdiv(inter, tiles.block_n),)
    bias = epilogue.gate_up_bias
    # Flags off (plain MoE models): the same compiled kernel as without these arguments.
    flags = {}
    if bias is not None:
        flags["HAS_BIAS"] = True
    if epilogue.clamped_swiglu is not None:
        alpha, limit = epilogue.clamped_swiglu
        flags.update(CLAMPED_SWIGLU=True, ALPHA=alpha, LIMIT=limit)
    flags.update(weight_scale_args(w_scale, scale_block, tiles, w_zeros, group_size or hidden, hidden))
    if w_zeros is not None and int4_planes(hidden, group_size):
        flags.update(INT4_PLANES=True, CAST_ROUNDS=_cast_rounds(x))
    _gate_up_kernel[grid](
        x, w13, out, x if bias is None else bias, blocks.sorted_pair_ids, blocks.block_expert_ids,
        blocks.num_padded, blocks.num_pairs, inter, hidden, top_k, blocks.max_blocks,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), out.stride(0),
        0 if bias is None else bias.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        EVEN_K=hidden % tiles.block_k == 0, PRECISION=_precision(x.dtype), UPCAST_DOT=_upcast_dot(x),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **flags,
    )  # fmt: skip


def _launch_down(
    a: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, blocks: ExpertBlocks,
    tiles: GemmTiles, bias: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None, w_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> None:  # fmt: skip
    hidden, inter = w2.shape[1], a.shape[1]  # w2's last dimension is I / 8 for INT4
    grid = (blocks.max_blocks * triton.cdiv(hidden, tiles.block_n),)
    flags = {} if bias is None else {"HAS_BIAS": True}
    flags.update(weight_scale_args(w_scale, scale_block, tiles, w_zeros, group_size or inter, inter))
    if w_zeros is not None and int4_planes(inter, group_size):
        flags.update(INT4_PLANES=True, CAST_ROUNDS=_cast_rounds(a))
    _down_kernel[grid](
        a, w2, out, weights, weights if bias is None else bias, blocks.sorted_pair_ids,
        blocks.block_expert_ids, blocks.num_padded, blocks.num_pairs, hidden, inter, blocks.max_blocks,
        a.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        0 if bias is None else bias.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        EVEN_K=inter % tiles.block_k == 0, PRECISION=_precision(a.dtype), UPCAST_DOT=_upcast_dot(a),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **flags,
    )  # fmt: skip


def compile_gemm(
    kernel: str, num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype, block_m: int,
    tiles: GemmTiles,
) -> None:  # fmt: skip
    """Compile one GEMM ("gate_up" or "down") for this shape and tiles without running it, with
    the specializations a launch on contiguous tensors of that shape gets (for the tuner, which
    compiles its candidates in parallel processes that fill Triton's on-disk cache)."""
    index, weights = torch.int32, torch.float32
    common = {
        "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_M": tiles.group_m,
        "PRECISION": _precision(dtype), "UPCAST_DOT": False, "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages, "grid": (1,),
    }  # fmt: skip
    if kernel == "gate_up":
        _gate_up_kernel.warmup(
            dtype, dtype, dtype, dtype, index, index, index, 1, inter, hidden, top_k, 1,
            hidden, 2 * inter * hidden, hidden, 1, inter, 0, EVEN_K=hidden % tiles.block_k == 0, **common,
        )  # fmt: skip
    elif kernel == "down":
        _down_kernel.warmup(
            dtype, dtype, dtype, weights, weights, index, index, index, 1, hidden, inter, 1,
            inter, hidden * inter, inter, 1, hidden, 0, EVEN_K=inter % tiles.block_k == 0, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown MoE GEMM {kernel!r}; expected 'gate_up' or 'down'")
