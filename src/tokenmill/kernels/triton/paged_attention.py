"""Paged attention over the block pool, in place, for batches that mix prefill chunks and decodes.

One program handles a tile of query rows of one request against one KV head: the rows are
`BLOCK_Q` consecutive query tokens times the `GROUP` query heads that share the KV head (GQA), so
each K/V tile is loaded once for the whole group. Query token `j` of a request sits at position
`seq_len - query_len + j` and attends to every cached position <= it (the already-cached prefix
plus the causal part of this step's chunk).

The kernel is launched in two flavours. The decode flavour has one program column per request
and serves the requests whose query_len is 1 with 16-row tiles. The prefill flavour walks
q-blocks of up to 128 rows and skips those requests, so decodes in a mixed batch do not pay for
128-row matrix products on one useful row. A decode-only step launches only the first.

Split-KV (flash-decoding), decode flavour only: with `num_kv_splits > 1`, grid axis 2 cuts each
request's KV range into that many pieces; each writes a normalised partial output and its base-2
log-sum-exp, and the program of a (request, KV head) that finishes last combines them: each
program bumps a per-(request, KV head) counter after writing its partial, and the one that sees
the count complete merges the group's heads and resets the counter to 0 for the next launch (or
graph replay). That saves the separate merge launch per layer; without counters the separate
`_merge_splits_kernel` does the merge. The split boundaries come from the device-side seq_lens,
so the grid depends only on host-known sizes: no device sync, stable under CUDA graphs. A split
count planned for the longest context a graph may see leaves the later splits of a short
context without tiles: those programs exit at once, and the merge reads only the splits that
had work (`min_kv_per_split` also bounds how thin the pieces get at run time).

RoPE + KV store, decode flavour only (`rope` given): q and this step's k arrive un-rotated
straight from the qkv projection. Every program rotates its own q rows and the request's new
key in registers; the cache loop reads positions [0, seq_len - 1) from the pages and takes the
new token's key and value from registers; the one program whose split covers the last position
writes them to their cache slot. No program reads that slot in the same launch, so there is no
read-after-write race, and the separate RoPE/KV-store launch per layer goes away. With
`rope.norm_source`, q/k/v are projections of the un-normalized residual rows (the input
RMSNorm's weight folded into the qkv weight) and every program first scales them by 1/rms of
the token's row, so the norm needs no launch either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.rms import inverse_rms, scale_rounded
from tokenmill.kernels.triton.rounding import rope_rows

LOG2_E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr, SCAN_CHUNK: tl.constexpr):
    # Request r owns q-block slots from query_start_loc[r] // BLOCK_Q + r on: enough for
    # cdiv(query_len, BLOCK_Q) blocks whatever the alignment. The owner of q_block is the last
    # request whose first slot is <= q_block, i.e. (number of such requests) - 1. Counting with
    # vector loads takes one memory round trip per chunk where a binary search takes log2(num_reqs).
    num_before = q_block * 0
    for chunk_start in range(0, num_reqs, SCAN_CHUNK):
        reqs = chunk_start + tl.arange(0, SCAN_CHUNK)
        first_slot = (
            tl.load(query_start_loc_ptr + reqs, mask=reqs < num_reqs, other=1 << 30) // BLOCK_Q + reqs
        )
        num_before += tl.sum((first_slot <= q_block).to(tl.int32), axis=0)
    return num_before - 1


@triton.jit
def _split_plan(kv_end, num_kv_splits, min_tiles_per_split, BLOCK_N: tl.constexpr):
    """(tiles per split, splits that get at least one tile) for a KV range of kv_end tokens."""
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_kv_splits), min_tiles_per_split)
    return tiles_per_split, tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)


@triton.jit
def _load_tile(
    tile,
    cached_end,  # positions < cached_end are read from the pages
    block_table_row,
    key_cache_ptr,
    value_cache_ptr,
    kv_head,
    dims,
    dim_valid,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One KV tile's keys (transposed, [head_dim, BLOCK_N]) and values ([BLOCK_N, head_dim])."""
    kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cached = kv_pos < cached_end
    block = tl.load(block_table_row + kv_pos // PAGE_SIZE, mask=cached, other=0)
    kv_offset = (
        block.to(tl.int64) * stride_cache_block
        + (kv_pos % PAGE_SIZE) * stride_cache_slot
        + kv_head * stride_cache_head
    )
    key_t = tl.load(
        key_cache_ptr + kv_offset[None, :] + dims[:, None],
        mask=cached[None, :] & dim_valid[:, None],
        other=0.0,
    )
    value = tl.load(
        value_cache_ptr + kv_offset[:, None] + dims[None, :],
        mask=cached[:, None] & dim_valid[None, :],
        other=0.0,
    )
    return key_t, value


@triton.jit
def _attend_loaded(
    q,
    m_i,
    l_i,
    acc,
    key_t,
    value,
    tile,
    kv_end,  # positions < kv_end are visible
    q_pos,
    k_new,  # NEW_TOKEN: the key and value of position kv_end - 1, in registers
    v_new,
    scale_log2,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    NEW_TOKEN: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online-softmax update for one loaded KV tile: returns the new (m_i, l_i, acc)."""
    kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_valid = kv_pos < kv_end
    if NEW_TOKEN:
        is_new = kv_pos == kv_end - 1
        key_t = tl.where(is_new[None, :], k_new[:, None], key_t)
        value = tl.where(is_new[:, None], v_new[None, :], value)
    if UPCAST_DOT:
        key_t = key_t.to(tl.float32)
        value = value.to(tl.float32)
    scores = tl.dot(q, key_t, input_precision=DOT_PRECISION) * scale_log2
    if DECODE:
        visible = kv_valid[None, :]
    else:
        visible = kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.math.exp2(scores - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(value.dtype), value, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    tile,
    kv_end,  # positions < kv_end are visible
    cached_end,  # positions < cached_end are read from the pages
    q_pos,
    block_table_row,
    key_cache_ptr,
    value_cache_ptr,
    kv_head,
    dims,
    dim_valid,
    k_new,  # NEW_TOKEN: the key and value of position kv_end - 1, in registers
    v_new,
    scale_log2,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    NEW_TOKEN: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One KV tile of the online softmax: returns the updated (m_i, l_i, acc)."""
    key_t, value = _load_tile(
        tile, cached_end, block_table_row, key_cache_ptr, value_cache_ptr, kv_head, dims, dim_valid,
        stride_cache_block, stride_cache_slot, stride_cache_head, PAGE_SIZE, BLOCK_N,
    )  # fmt: skip
    return _attend_loaded(
        q, m_i, l_i, acc, key_t, value, tile, kv_end, q_pos, k_new, v_new, scale_log2, BLOCK_N, DECODE,
        NEW_TOKEN, UPCAST_DOT, DOT_PRECISION,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_reqs", "num_kv_splits", "min_tiles_per_split"])
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    split_counter_ptr,  # int32 [num_reqs, num_kv_heads], zero between launches (FUSED_MERGE)
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    # ROPE_KV only: this step's un-rotated keys and values, RoPE tables, positions and slots.
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    norm_source_ptr,  # NORM_SCALE only: the residual rows q/k/v were projected from, un-normalized
    stride_norm_source,
    hidden,
    norm_eps,
    scale_log2,  # softmax scale * log2(e): scores live in base 2 so exp2 does the softmax
    num_reqs,
    num_kv_splits,
    min_tiles_per_split,  # >= 1
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_table,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_partial_req,
    stride_partial_head,
    stride_partial_split,
    stride_lse_req,
    stride_lse_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD (at least 16 rows for tl.dot)
    BLOCK_N: tl.constexpr,  # KV tokens per tile
    DECODE: tl.constexpr,  # program axis 0 is the request; only requests with query_len == 1
    ALL_DECODE: tl.constexpr,  # DECODE, and every request has query_len 1 (no query_start_loc reads)
    USE_SPLITS: tl.constexpr,
    FUSED_MERGE: tl.constexpr,  # the last split program of a (request, KV head) merges
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,  # splits the merge reads per round
    ROPE_KV: tl.constexpr,  # DECODE only: rotate q and k here, store k/v, new token from registers
    NORM_SCALE: tl.constexpr,  # ROPE_KV only: q/k/v still need the input RMSNorm's 1/rms factor
    HIDDEN_PAD: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM // 2
    ON_GPU: tl.constexpr,  # a real GPU (not the CPU interpreter): emit the memory fence
    UPCAST_DOT: tl.constexpr,  # fp32 dots for bf16 inputs (the CPU interpreter mis-multiplies bf16)
    DOT_PRECISION: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE:
        req = pid_q
        q_block_local = 0
    else:
        req = _find_request(query_start_loc_ptr, pid_q, num_reqs, BLOCK_Q, SCAN_CHUNK=128)
        q_block_local = pid_q - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)
    if ALL_DECODE:
        q_start = req  # every request has one row: query_start_loc is 0, 1, 2, ...
        q_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if DECODE:
        if q_len != 1:  # a prefill chunk, or a CUDA-graph padding request with no rows
            return
    else:
        if q_len == 1:  # the decode launch serves it
            return
        if q_block_local * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # This q block sees KV positions [0, kv_end); split `split` takes its share of the tiles.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    tiles_per_split, num_active = _split_plan(kv_end, num_kv_splits, min_tiles_per_split, BLOCK_N)
    if split >= num_active:  # no tiles for this split (only decodes split): nothing to add
        return
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block_local * BLOCK_Q + rows // GROUP_PAD
    group_idx = rows % GROUP_PAD
    head = kv_head * GROUP + group_idx
    row_valid = (q_tok < q_len) & (group_idx < GROUP)
    token_row = (q_start + q_tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_block_table
    if ROPE_KV:
        # Start the first tile's page-table and K/V loads before anything else, so their memory
        # round trips overlap those of q/k/v, the 1/rms reduction and RoPE instead of following
        # them. Positions up to kv_end - 2 are in the pages; the new token comes from registers.
        first_key_t, first_value = _load_tile(
            tile_begin, kv_end - 1, block_table_row, key_cache_ptr, value_cache_ptr, kv_head, dims,
            dim_valid, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE_SIZE, BLOCK_N,
        )  # fmt: skip
    q = tl.load(
        q_ptr + token_row[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if ROPE_KV:
        # One decode token per request: its position, the RoPE table rows, the rotated q rows of
        # this KV head's group, and the rotated key and the value of this KV head.
        token = q_start.to(tl.int64)
        table_row = tl.load(positions_ptr + token).to(tl.int64) * stride_table
        cos = tl.load(cos_ptr + table_row + dims, mask=dim_valid, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + table_row + dims, mask=dim_valid, other=0.0).to(tl.float32)
        partner = tl.where(dims < HALF, dims + HALF, dims - HALF)  # rotate_half's source dims
        q_partner = tl.load(
            q_ptr + token_row[:, None] * stride_q_token + head[:, None] * stride_q_head + partner[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        k_row = k_ptr + token * stride_k_token + kv_head * stride_k_head
        k_raw = tl.load(k_row + dims, mask=dim_valid, other=0.0)
        k_partner = tl.load(k_row + partner, mask=dim_valid, other=0.0)
        v_raw = tl.load(
            v_ptr + token * stride_v_token + kv_head * stride_v_head + dims, mask=dim_valid, other=0.0
        )
        if NORM_SCALE:
            # q/k/v were projected from the un-normalized residual row with the norm weight folded
            # into the projection: scaling by 1/rms makes them the projection of the normed row,
            # rounded where the projection's output is rounded.
            inv_rms = inverse_rms(norm_source_ptr + token * stride_norm_source, hidden, norm_eps, HIDDEN_PAD)
            q = scale_rounded(q, inv_rms)
            q_partner = scale_rounded(q_partner, inv_rms)
            k_raw = scale_rounded(k_raw, inv_rms)
            k_partner = scale_rounded(k_partner, inv_rms)
            v_raw = scale_rounded(v_raw, inv_rms)
        q = rope_rows(q, q_partner, cos[None, :], sin[None, :])
        k_new = rope_rows(k_raw, k_partner, cos, sin).to(key_cache_ptr.dtype.element_ty)
        v_new = v_raw.to(value_cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = context_len + q_tok

    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined for rows with no key yet.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    loop_begin = tile_begin
    loop_end = tile_end
    if ROPE_KV:
        # The first tile was loaded up front; it takes the new token from registers if it is
        # also the last one. A split that ends at the last tile otherwise runs that tile after
        # the loop, likewise; the loop keeps plain loads (software-pipelined).
        m_i, l_i, acc = _attend_loaded(
            q, m_i, l_i, acc, first_key_t, first_value, tile_begin, kv_end, q_pos, k_new, v_new, scale_log2,
            BLOCK_N, DECODE, True, UPCAST_DOT, DOT_PRECISION,
        )  # fmt: skip
        owns_last = tile_end == num_tiles
        last_after_loop = owns_last & (tile_begin != num_tiles - 1)
        loop_begin = tile_begin + 1
        loop_end = tile_end - last_after_loop.to(tl.int32)
    else:
        k_new = dims  # (unused)
        v_new = dims
    for tile in range(loop_begin, loop_end):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, kv_end, kv_end, q_pos, block_table_row, key_cache_ptr, value_cache_ptr,
            kv_head, dims, dim_valid, k_new, v_new, scale_log2, stride_cache_block, stride_cache_slot,
            stride_cache_head, PAGE_SIZE, BLOCK_N, DECODE, False, UPCAST_DOT, DOT_PRECISION,
        )  # fmt: skip
    if ROPE_KV:  # noqa: SIM102 (owns_last exists only when ROPE_KV)
        if last_after_loop:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, num_tiles - 1, kv_end, kv_end - 1, q_pos, block_table_row, key_cache_ptr,
                value_cache_ptr, kv_head, dims, dim_valid, k_new, v_new, scale_log2, stride_cache_block,
                stride_cache_slot, stride_cache_head, PAGE_SIZE, BLOCK_N, DECODE, True, UPCAST_DOT, DOT_PRECISION,
            )  # fmt: skip
        if owns_last:  # exactly one split per (request, KV head)
            slot = tl.load(slot_mapping_ptr + q_start)
            if slot >= 0:  # -1: a CUDA-graph padding request, written nowhere
                slot_offset = (
                    (slot // PAGE_SIZE) * stride_cache_block
                    + (slot % PAGE_SIZE) * stride_cache_slot
                    + kv_head * stride_cache_head
                )
                tl.store(key_cache_ptr + slot_offset + dims, k_new, mask=dim_valid)
                tl.store(value_cache_ptr + slot_offset + dims, v_new, mask=dim_valid)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if USE_SPLITS:
        # Partials are per request (only decodes split): [num_reqs, heads, splits, head_dim].
        req64 = req.to(tl.int64)
        partial_row = req64 * stride_partial_req + head * stride_partial_head + split * stride_partial_split
        tl.store(partial_out_ptr + partial_row[:, None] + dims[None, :], result, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(
            partial_lse_ptr + req64 * stride_lse_req + head * stride_lse_head + split,
            lse,
            mask=row_valid,
        )
        if FUSED_MERGE:
            if ON_GPU:
                # Every thread's partial stores are ordered before the count, GPU-wide.
                tl.inline_asm_elementwise(
                    "fence.acq_rel.gpu;\n\tmov.u32 $0, 0;",
                    "=r,r",
                    [split],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            tl.debug_barrier()
            counter = split_counter_ptr + req64 * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == num_active - 1:
                _merge_group(
                    out_ptr,
                    partial_out_ptr,
                    partial_lse_ptr,
                    q_start.to(tl.int64),
                    req64,
                    kv_head,
                    num_active,
                    stride_out_token,
                    stride_out_head,
                    stride_partial_req,
                    stride_partial_head,
                    stride_partial_split,
                    stride_lse_req,
                    stride_lse_head,
                    GROUP,
                    GROUP_PAD,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                    SPLITS_PAD,
                    MERGE_CHUNK,
                )
                tl.atomic_xchg(counter, 0)
    else:
        out_offset = token_row[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offset, result.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_group(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    token,  # int64 row of the decode token in out
    req64,
    kv_head,
    num_active,  # the splits that had tiles (the first num_active of them)
    stride_out_token,
    stride_out_head,
    stride_partial_req,
    stride_partial_head,
    stride_partial_split,
    stride_lse_req,
    stride_lse_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):
    """Combine the split partials of the GROUP query heads of one KV head of one decode request.

    The partials are read MERGE_CHUNK splits at a time ([group, chunk, head_dim] per load), so
    a merge costs a few memory round trips rather than one per split."""
    g = tl.arange(0, GROUP_PAD)
    g_valid = g < GROUP
    heads = kv_head * GROUP + g
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    lse_base = partial_lse_ptr + req64 * stride_lse_req + heads * stride_lse_head
    # .cg: written by other SMs; read through L2, never a stale L1 line.
    lse = tl.load(
        lse_base[:, None] + splits[None, :],
        mask=g_valid[:, None] & (splits < num_active)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a row with no keys at all
    denom = tl.sum(tl.math.exp2(lse - lse_max[:, None]), axis=1)
    denom = tl.where(denom == 0.0, 1.0, denom)
    merged = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    partial_base = partial_out_ptr + req64 * stride_partial_req + heads * stride_partial_head
    chunk = tl.arange(0, MERGE_CHUNK)
    for s0 in range(0, num_active, MERGE_CHUNK):
        s = s0 + chunk
        gs_valid = g_valid[:, None] & (s < num_active)[None, :]
        weight = tl.math.exp2(
            tl.load(lse_base[:, None] + s[None, :], mask=gs_valid, other=float("-inf"), cache_modifier=".cg")
            - lse_max[:, None]
        )
        part = tl.load(
            partial_base[:, None, None] + s[None, :, None] * stride_partial_split + dims[None, None, :],
            mask=gs_valid[:, :, None] & dim_valid[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        merged += tl.sum(part * weight[:, :, None], axis=1)
    merged = merged / denom[:, None]
    tl.store(
        out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=g_valid[:, None] & dim_valid[None, :],
    )


@triton.jit(do_not_specialize=["num_kv_splits", "min_tiles_per_split"])
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_kv_splits,
    min_tiles_per_split,
    stride_out_token,
    stride_out_head,
    stride_partial_req,
    stride_partial_head,
    stride_partial_split,
    stride_lse_req,
    stride_lse_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the attention launch's, for its split plan
):
    """The merge as a launch of its own, one program per (request, KV head), for callers that
    pass no split counters; the same `_merge_group` the attention launch runs otherwise."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1:  # not served by the decode launch
        return
    _, num_active = _split_plan(tl.load(seq_lens_ptr + req), num_kv_splits, min_tiles_per_split, BLOCK_N)
    _merge_group(
        out_ptr,
        partial_out_ptr,
        partial_lse_ptr,
        q_start.to(tl.int64),
        req.to(tl.int64),
        kv_head,
        num_active,
        stride_out_token,
        stride_out_head,
        stride_partial_req,
        stride_partial_head,
        stride_partial_split,
        stride_lse_req,
        stride_lse_head,
        GROUP,
        GROUP_PAD,
        HEAD_DIM,
        HEAD_DIM_PAD,
        SPLITS_PAD,
        MERGE_CHUNK,
    )


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    merge_chunk: int = 8  # decode: split partials read per round of the merge


def decode_tile_config(group_pad: int, head_dim_pad: int, num_reqs: int = 0) -> TileConfig:
    """The decode launch's tiles. They must not depend on whether the RoPE + KV store is fused
    in: the fused and the plain launch of one batch take the same tiles in the same order, so
    they agree bit for bit. The merge reads up to 32 splits per round while that stays within
    16K fp32 values.

    Single-request steps take 32-token tiles with 2 stages: on an H200 (Llama-3.1-8B shapes,
    `bench latency`, same machine) 224.5 against 223.2 tok/s with 64-token / 3-stage tiles, and
    8.1-8.2 against 9.4-9.5 us a layer in benchmarks/decode_layer_microbench.py. (With them at
    batches up to 8, the tiny Qwen3 checkpoint's bf16 greedy output once differed from
    transformers' in the 4-request test of tests/gpu/test_engine_gpu.py; larger batches keep
    64-token tiles, which also measured faster from batch 8 on.)"""
    small = num_reqs == 1 and head_dim_pad <= 128
    block_n = 64 if head_dim_pad <= 128 else 32
    merge_chunk = max(1, min(32, 16384 // (group_pad * head_dim_pad)))
    return TileConfig(
        block_q=1,
        block_m=max(16, group_pad),
        block_n=32 if small else block_n,
        num_warps=4,
        num_stages=2 if small else 3,
        merge_chunk=merge_chunk,
    )


def prefill_tile_config(group_pad: int, head_dim_pad: int, max_query_len: int) -> TileConfig:
    """Enough rows to cover the longest chunk's group, capped where registers and shared memory run out."""
    block_n = 64 if head_dim_pad <= 128 else 32
    cap = 128 if head_dim_pad <= 128 else 64
    block_m = max(16, group_pad, min(cap, triton.next_power_of_2(max(1, max_query_len) * group_pad)))
    num_warps = 8 if block_m >= 128 else 4
    return TileConfig(
        block_q=block_m // group_pad, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=2
    )


@dataclass(frozen=True, slots=True)
class DecodeRope:
    """What a decode-only launch needs to rotate q and k itself and store this step's K/V.

    q passed to `paged_attention` is then un-rotated too. k and v may be strided views of the
    qkv projection (head_dim contiguous); the tables are RotaryEmbedding's [max_positions,
    head_dim] cos ([cos, cos]) and sin ([-sin, sin]).
    """

    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], un-rotated
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor  # [num_tokens] int64
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = write nowhere
    # Set when q/k/v are projections of the un-normalized residual rows [num_tokens, hidden]
    # through weights with the input RMSNorm's weight folded in: the launch scales them by
    # 1/rms(row) (with this eps) before anything else, so the norm needs no launch of its own.
    norm_source: torch.Tensor | None = None
    norm_eps: float = 0.0


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    num_reqs: int,
    max_query_len: int,
    decode_only: bool,
    scale: float,
    num_kv_splits: int = 1,
    partial_out: torch.Tensor | None = None,  # [num_reqs, num_heads, num_kv_splits, head_dim] fp32
    partial_lse: torch.Tensor | None = None,  # [num_reqs, num_heads, num_kv_splits] fp32
    split_counters: torch.Tensor | None = None,  # int32, >= num_reqs * num_kv_heads, all zero
    decode_config: TileConfig | None = None,  # overrides (benchmarks)
    prefill_config: TileConfig | None = None,
    min_kv_per_split: int = 0,
    rope: DecodeRope | None = None,
    all_decode: bool = False,
) -> None:
    """Attention for every query row into `out`; launches only, never syncs or allocates.

    `num_kv_splits` applies to the rows of requests with query_len 1 (decodes); at run time a
    split gets at least `min_kv_per_split` KV tokens (rounded down to whole tiles), so short
    contexts use fewer of the splits. With `split_counters` the split partials are merged inside
    the attention launch (the counters are left at zero again); without, by a second launch.
    With `rope` (decode-only batches), q and rope.k are un-rotated: the launch applies RoPE and
    writes this step's keys and values into kv_cache itself (see the module docstring).
    `all_decode` promises that query_start_loc is 0, 1, ..., num_reqs (every request one row), so
    the decode launch need not read it; the caller knows that from the host copy.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_tokens == 0 or num_reqs == 0:
        return
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    use_splits = num_kv_splits > 1
    if use_splits and (partial_out is None or partial_lse is None):
        raise ValueError("num_kv_splits > 1 needs partial_out and partial_lse scratch buffers")
    fused_merge = use_splits and split_counters is not None
    if fused_merge and (
        split_counters.dtype != torch.int32 or split_counters.numel() < num_reqs * num_kv_heads
    ):
        raise ValueError(
            f"split_counters must be int32 with at least {num_reqs * num_kv_heads} entries "
            f"(requests x KV heads), got {split_counters.dtype} x {split_counters.numel()}"
        )
    if rope is not None:
        _check_rope(rope, q, kv_cache, decode_only)
    if not use_splits:
        partial_out, partial_lse = out, out  # unused by the kernel; any tensor will do
    launch = _Launch(
        out,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_reqs,
        scale,
        partial_out,
        partial_lse,
        split_counters if fused_merge else seq_lens,  # (unused without the fused merge)
        fused_merge,
    )
    if not decode_only:
        config = prefill_config or prefill_tile_config(group_pad, head_dim_pad, max_query_len)
        launch.attention(config, num_tokens // config.block_q + num_reqs, decode=False, num_kv_splits=1)
    # In a mixed batch this also runs when no request decodes; its programs then exit at once.
    config = decode_config or decode_tile_config(group_pad, head_dim_pad, num_reqs)
    min_tiles = max(1, min_kv_per_split // config.block_n)
    launch.attention(
        config,
        num_reqs,
        decode=True,
        num_kv_splits=num_kv_splits,
        min_tiles=min_tiles,
        rope=rope,
        all_decode=decode_only and all_decode,
    )
    if use_splits and not fused_merge:
        launch.merge(num_kv_splits, min_tiles, config)


def _check_rope(rope: DecodeRope, q: torch.Tensor, kv_cache: torch.Tensor, decode_only: bool) -> None:
    if not decode_only:
        raise ValueError("the in-kernel RoPE + KV store serves decode-only batches (every query_len 1)")
    num_tokens, _, head_dim = q.shape
    kv_shape = (num_tokens, kv_cache.shape[3], head_dim)
    if head_dim % 2 or tuple(rope.k.shape) != kv_shape or tuple(rope.v.shape) != kv_shape:
        raise ValueError(
            f"k and v must be {list(kv_shape)} with an even head_dim, got {list(rope.k.shape)} and {list(rope.v.shape)}"
        )
    if rope.k.stride(-1) != 1 or rope.v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in head_dim")
    if rope.slot_mapping.shape != (num_tokens,) or rope.positions.shape != (num_tokens,):
        raise ValueError(f"slot_mapping and positions must be ({num_tokens},), one per token")
    if rope.cos_cache.shape[-1] != head_dim or rope.cos_cache.stride() != rope.sin_cache.stride():
        raise ValueError("cos_cache and sin_cache must be [max_positions, head_dim] with equal strides")
    source = rope.norm_source
    if source is not None and (source.dim() != 2 or source.shape[0] != num_tokens or source.stride(-1) != 1):
        raise ValueError(
            f"norm_source must be [{num_tokens}, hidden] with contiguous rows, got {tuple(source.shape)}"
        )


@dataclass(slots=True)
class _Launch:
    out: torch.Tensor
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_reqs: int
    scale: float
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    split_counters: torch.Tensor
    fused_merge: bool

    def attention(
        self,
        config: TileConfig,
        num_q_programs: int,
        decode: bool,
        num_kv_splits: int,
        min_tiles: int = 1,
        rope: DecodeRope | None = None,
        all_decode: bool = False,
    ) -> None:
        q, out, kv_cache = self.q, self.out, self.kv_cache
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if rope is not None:
            k, v, positions, cos, sin, slots = (
                rope.k, rope.v, rope.positions, rope.cos_cache, rope.sin_cache, rope.slot_mapping
            )  # fmt: skip
        else:  # unused by the kernel
            k, v, positions, cos, sin, slots = q, q, self.seq_lens, q, q, self.seq_lens
        norm_source = rope.norm_source if rope is not None else None
        hidden = norm_source.shape[1] if norm_source is not None else 1
        _paged_attention_kernel[(num_q_programs, num_kv_heads, num_kv_splits)](
            out,
            self.partial_out,
            self.partial_lse,
            self.split_counters,
            q,
            key_cache,
            value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            k,
            v,
            positions,
            cos,
            sin,
            slots,
            norm_source if norm_source is not None else q,
            norm_source.stride(0) if norm_source is not None else 0,
            hidden,
            rope.norm_eps if rope is not None else 0.0,
            self.scale * LOG2_E,
            self.num_reqs,
            num_kv_splits,
            min_tiles,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos.stride(0),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            self.partial_out.stride(0),
            self.partial_out.stride(1),
            self.partial_out.stride(2),
            self.partial_lse.stride(0),
            self.partial_lse.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            self.block_tables.stride(0),
            GROUP=num_heads // num_kv_heads,
            GROUP_PAD=triton.next_power_of_2(num_heads // num_kv_heads),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            PAGE_SIZE=kv_cache.shape[2],
            BLOCK_Q=config.block_q,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            DECODE=decode,
            ALL_DECODE=decode and all_decode,
            USE_SPLITS=num_kv_splits > 1,
            FUSED_MERGE=decode and num_kv_splits > 1 and self.fused_merge,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
            MERGE_CHUNK=min(config.merge_chunk, triton.next_power_of_2(num_kv_splits)),
            ROPE_KV=rope is not None,
            NORM_SCALE=norm_source is not None,
            HIDDEN_PAD=triton.next_power_of_2(hidden),
            HALF=head_dim // 2,
            ON_GPU=q.device.type == "cuda",
            # The CPU interpreter multiplies bf16 wrongly (Triton 3.9): do those dots in fp32 there.
            UPCAST_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )

    def merge(self, num_kv_splits: int, min_tiles: int, config: TileConfig) -> None:
        out = self.out
        num_heads, num_kv_heads = out.shape[1], self.kv_cache.shape[3]
        _merge_splits_kernel[(self.num_reqs, num_kv_heads)](
            out,
            self.partial_out,
            self.partial_lse,
            self.query_start_loc,
            self.seq_lens,
            num_kv_splits,
            min_tiles,
            out.stride(0),
            out.stride(1),
            self.partial_out.stride(0),
            self.partial_out.stride(1),
            self.partial_out.stride(2),
            self.partial_lse.stride(0),
            self.partial_lse.stride(1),
            GROUP=num_heads // num_kv_heads,
            GROUP_PAD=triton.next_power_of_2(num_heads // num_kv_heads),
            HEAD_DIM=out.shape[2],
            HEAD_DIM_PAD=max(16, triton.next_power_of_2(out.shape[2])),
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
            MERGE_CHUNK=min(config.merge_chunk, triton.next_power_of_2(num_kv_splits)),
            BLOCK_N=config.block_n,
            num_warps=4,
        )
