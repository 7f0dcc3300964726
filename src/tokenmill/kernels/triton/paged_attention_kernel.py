"""The paged attention kernel itself; paged_attention.py launches it and describes what it does."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.kv_fp8 import quantize_kv
from tokenmill.kernels.triton.paged_attention_merge import _merge_group
from tokenmill.kernels.triton.paged_attention_tiles import (
    _attend_loaded,
    _attend_tile,
    _find_request,
    _load_tile,
    _split_plan,
    _window_first_tile,
)
from tokenmill.kernels.triton.rms import head_rms_norm, inverse_rms, scale_rounded
from tokenmill.kernels.triton.rounding import rope_rows


# Integers that change from step to step are not specialized on (Triton would compile a variant
# for each of == 1, a multiple of 16, and other): the batch size, the split plan, and the block
# table's row stride (an eager step's table is as wide as its longest request needs). The model's
# strides are kept: they are constant for a model and let loads and stores vectorize.
@triton.jit(
    do_not_specialize=[
        "num_reqs", "num_kv_splits", "min_tiles_per_split", "stride_block_table", "sliding_window"
    ]
)  # fmt: skip
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
    q_norm_ptr,  # QK_NORM only: the per-head RMSNorm weights of q and k [head_dim] (Qwen3, Gemma 3)
    k_norm_ptr,
    qk_norm_eps,
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
    sinks_ptr,  # SINKS only: one logit per query head [num_heads] (natural-log units)
    k_scale_ptr,  # KV_FP8 only: the cache's scales, float32 [num_kv_heads]
    v_scale_ptr,
    sliding_window,  # SLIDING only: a query at p sees keys p - sliding_window < k <= p
    soft_cap_log2,  # SOFT_CAP only: the logit soft cap times log2(e)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program (DECODE: per request, DECODE_MAX_Q)
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD (at least 16 rows for tl.dot)
    BLOCK_N: tl.constexpr,  # KV tokens per tile
    DECODE: tl.constexpr,  # program axis 0 is the request; only requests with 1..DECODE_MAX_Q rows
    DECODE_MAX_Q: tl.constexpr,  # the longest query the decode launch serves (1, or a verify step's 1+k)
    ONE_ROW: tl.constexpr,  # DECODE with DECODE_MAX_Q == 1: one query position per request
    ALL_DECODE: tl.constexpr,  # DECODE, and every request has query_len 1 (no query_start_loc reads)
    USE_SPLITS: tl.constexpr,
    FUSED_MERGE: tl.constexpr,  # the last split program of a (request, KV head) merges
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,  # splits the merge reads per round
    ROPE_KV: tl.constexpr,  # DECODE only: rotate q and k here, store k/v, new token from registers
    NORM_SCALE: tl.constexpr,  # ROPE_KV only: q/k/v still need the input RMSNorm's 1/rms factor
    QK_NORM: tl.constexpr,  # ROPE_KV only: q and k get their per-head RMSNorm before RoPE
    HIDDEN_PAD: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM // 2
    SLIDING: tl.constexpr,  # the layer has a sliding window
    SOFT_CAP: tl.constexpr,  # the layer soft-caps its scores
    SINKS: tl.constexpr,  # the layer has attention sinks
    ON_GPU: tl.constexpr,  # a real GPU (not the CPU interpreter): emit the memory fence
    UPCAST_DOT: tl.constexpr,  # fp32 dots for bf16 inputs (the CPU interpreter mis-multiplies bf16)
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds e4m3 of value / scale (kernels/kv_fp8.py)
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
        if (q_len < 1) | (q_len > DECODE_MAX_Q):  # a prefill chunk, or a CUDA-graph padding request with no rows
            return
    else:
        if q_len <= DECODE_MAX_Q:  # the decode launch serves it (or a padding request with no rows)
            return
        if q_block_local * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # This q block sees KV positions [0, kv_end); split `split` takes its share of the tiles.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    if SLIDING:
        # [kv_begin, kv_end) with a window: the tiles from the earliest row's first key on.
        kv_begin, first_tile = _window_first_tile(context_len + q_block_local * BLOCK_Q, sliding_window, BLOCK_N)
        tiles_per_split, num_active = _split_plan(
            kv_end - first_tile * BLOCK_N, num_kv_splits, min_tiles_per_split, BLOCK_N
        )
    else:
        kv_begin = 0
        first_tile = 0
        tiles_per_split, num_active = _split_plan(kv_end, num_kv_splits, min_tiles_per_split, BLOCK_N)
    if split >= num_active:  # no tiles for this split (only decodes split): nothing to add
        return
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tile_begin = first_tile + split * tiles_per_split
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
    compute_dtype = q_ptr.dtype.element_ty
    if KV_FP8:
        # Tiles are widened to q's dtype exactly (every e4m3 value is a bf16 / fp16 value) and the
        # dots accumulate in fp32; the scales apply once per program: K's folds into the score
        # scale, V's multiplies the normalised output.
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
        scale_log2 = scale_log2 * k_scale
    if ROPE_KV:
        # Start the first tile's page-table and K/V loads before anything else, so their memory
        # round trips overlap those of q/k/v, the 1/rms reduction and RoPE instead of following
        # them. Positions up to kv_end - 2 are in the pages; the new token comes from registers.
        first_key_t, first_value = _load_tile(
            tile_begin, kv_end - 1, kv_begin, block_table_row, key_cache_ptr, value_cache_ptr, kv_head, dims,
            dim_valid, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE_SIZE, BLOCK_N, SLIDING,
            KV_FP8, compute_dtype,
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
        if QK_NORM:
            # Per-head RMSNorm of q and k (the model's q_norm / k_norm), before RoPE as the model
            # applies it. The partner values belong to the same head, so they share its 1/rms.
            q_w = tl.load(q_norm_ptr + dims, mask=dim_valid, other=0.0)
            q_w_partner = tl.load(q_norm_ptr + partner, mask=dim_valid, other=0.0)
            k_w = tl.load(k_norm_ptr + dims, mask=dim_valid, other=0.0)
            k_w_partner = tl.load(k_norm_ptr + partner, mask=dim_valid, other=0.0)
            q_f = q.to(tl.float32)
            q_inv = 1.0 / tl.sqrt_rn(tl.sum(q_f * q_f, axis=1) / HEAD_DIM + qk_norm_eps)
            q = head_rms_norm(q, q_inv[:, None], q_w[None, :])
            q_partner = head_rms_norm(q_partner, q_inv[:, None], q_w_partner[None, :])
            k_f = k_raw.to(tl.float32)
            k_inv = 1.0 / tl.sqrt_rn(tl.sum(k_f * k_f, axis=0) / HEAD_DIM + qk_norm_eps)
            k_raw = head_rms_norm(k_raw, k_inv, k_w)
            k_partner = head_rms_norm(k_partner, k_inv, k_w_partner)
        q = rope_rows(q, q_partner, cos[None, :], sin[None, :])
        k_new = rope_rows(k_raw, k_partner, cos, sin)
        if KV_FP8:
            # Stored as store_kv stores it; attended as read back from the cache.
            k_store = quantize_kv(k_new, k_scale, key_cache_ptr.dtype.element_ty)
            v_store = quantize_kv(v_raw, v_scale, value_cache_ptr.dtype.element_ty)
            k_new = k_store.to(compute_dtype)
            v_new = v_store.to(compute_dtype)
        else:
            k_store = k_new.to(key_cache_ptr.dtype.element_ty)
            v_store = v_raw.to(value_cache_ptr.dtype.element_ty)
            k_new = k_store
            v_new = v_store
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
            q, m_i, l_i, acc, first_key_t, first_value, tile_begin, kv_begin, kv_end, q_pos, k_new, v_new,
            scale_log2, sliding_window, soft_cap_log2, BLOCK_N, ONE_ROW, True, SLIDING, SOFT_CAP, UPCAST_DOT,
            DOT_PRECISION,
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
            q, m_i, l_i, acc, tile, kv_begin, kv_end, kv_end, q_pos, block_table_row, key_cache_ptr,
            value_cache_ptr, kv_head, dims, dim_valid, k_new, v_new, scale_log2, sliding_window, soft_cap_log2,
            stride_cache_block, stride_cache_slot, stride_cache_head, PAGE_SIZE, BLOCK_N, ONE_ROW, False, SLIDING,
            SOFT_CAP, UPCAST_DOT, DOT_PRECISION, KV_FP8, compute_dtype,
        )  # fmt: skip
    if ROPE_KV:  # noqa: SIM102 (owns_last exists only when ROPE_KV)
        if last_after_loop:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, num_tiles - 1, kv_begin, kv_end, kv_end - 1, q_pos, block_table_row,
                key_cache_ptr, value_cache_ptr, kv_head, dims, dim_valid, k_new, v_new, scale_log2,
                sliding_window, soft_cap_log2, stride_cache_block, stride_cache_slot, stride_cache_head,
                PAGE_SIZE, BLOCK_N, ONE_ROW, True, SLIDING, SOFT_CAP, UPCAST_DOT, DOT_PRECISION, KV_FP8,
                compute_dtype,
            )  # fmt: skip
        if owns_last:  # exactly one split per (request, KV head)
            slot = tl.load(slot_mapping_ptr + q_start)
            if slot >= 0:  # -1: a CUDA-graph padding request, written nowhere
                slot_offset = (
                    (slot // PAGE_SIZE) * stride_cache_block
                    + (slot % PAGE_SIZE) * stride_cache_slot
                    + kv_head * stride_cache_head
                )
                tl.store(key_cache_ptr + slot_offset + dims, k_store, mask=dim_valid)
                tl.store(value_cache_ptr + slot_offset + dims, v_store, mask=dim_valid)

    if SINKS and not USE_SPLITS:  # split partials leave the sink to the merge
        # The sink is one more softmax column with no value: it only adds to the denominator.
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_sink = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_sink)
        l_i = l_i * alpha + tl.math.exp2(sink - m_sink)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    if KV_FP8:
        result = result * v_scale
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if USE_SPLITS:
        # Partials are per query row of a decode (only decodes split): [num_reqs * DECODE_MAX_Q,
        # heads, splits, head_dim], row req * DECODE_MAX_Q + j for the request's query token j.
        req64 = req.to(tl.int64)
        partial_req = req64 * DECODE_MAX_Q + q_tok
        partial_row = partial_req * stride_partial_req + head * stride_partial_head + split * stride_partial_split
        tl.store(partial_out_ptr + partial_row[:, None] + dims[None, :], result, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(
            partial_lse_ptr + partial_req * stride_lse_req + head * stride_lse_head + split,
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
                if ONE_ROW:
                    _merge_group(
                        out_ptr,
                        partial_out_ptr,
                        partial_lse_ptr,
                        sinks_ptr,
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
                        SINKS,
                    )
                else:  # a multi-token decode: every query row of the request, one after another
                    for j in range(0, q_len):
                        _merge_group(
                            out_ptr, partial_out_ptr, partial_lse_ptr, sinks_ptr, q_start.to(tl.int64) + j,
                            req64 * DECODE_MAX_Q + j, kv_head, num_active, stride_out_token, stride_out_head,
                            stride_partial_req, stride_partial_head, stride_partial_split, stride_lse_req,
                            stride_lse_head, GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, MERGE_CHUNK,
                            SINKS,
                        )  # fmt: skip
                tl.atomic_xchg(counter, 0)
    else:
        out_offset = token_row[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offset, result.to(out_ptr.dtype.element_ty), mask=store_mask)
