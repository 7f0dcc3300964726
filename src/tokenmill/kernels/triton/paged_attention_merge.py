"""The split-KV merge of the paged attention kernel: `_merge_group` (run by the attention launch
itself with split counters) and `_merge_splits_kernel` (its own launch). See paged_attention.py."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.paged_attention_tiles import _split_plan, _window_first_tile


@triton.jit
def _merge_group(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    sinks_ptr,  # SINKS: [num_heads] logits (natural-log units)
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
    SINKS: tl.constexpr,
):
    """Combine the split partials of the GROUP query heads of one KV head of one decode request.

    The partials are read MERGE_CHUNK splits at a time ([group, chunk, head_dim] per load), so
    a merge costs a few memory round trips rather than one per split. A sink joins the
    denominator here, once, not in every split."""
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
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=g_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a row with no keys at all
    denom = tl.sum(tl.math.exp2(lse - lse_max[:, None]), axis=1)
    if SINKS:
        denom += tl.math.exp2(sink - lse_max)
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


@triton.jit(do_not_specialize=["num_kv_splits", "min_tiles_per_split", "sliding_window"])
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
    sinks_ptr,  # SINKS only
    sliding_window,  # SLIDING only
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the attention launch's, for its split plan
    SLIDING: tl.constexpr,
    SINKS: tl.constexpr,
    DECODE_MAX_Q: tl.constexpr = 1,  # the attention launch's: its decodes have 1..DECODE_MAX_Q rows
):
    """The merge as a launch of its own, one program per (request, KV head), for callers that
    pass no split counters; the same `_merge_group` the attention launch runs otherwise."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if (q_len < 1) | (q_len > DECODE_MAX_Q):  # not served by the decode launch
        return
    seq_len = tl.load(seq_lens_ptr + req)
    if SLIDING:  # the attention launch split the window's tiles only (from its earliest row's)
        _, first_tile = _window_first_tile(seq_len - q_len, sliding_window, BLOCK_N)
        _, num_active = _split_plan(seq_len - first_tile * BLOCK_N, num_kv_splits, min_tiles_per_split, BLOCK_N)
    else:
        _, num_active = _split_plan(seq_len, num_kv_splits, min_tiles_per_split, BLOCK_N)
    if DECODE_MAX_Q == 1:
        _merge_group(
            out_ptr,
            partial_out_ptr,
            partial_lse_ptr,
            sinks_ptr,
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
            SINKS,
        )
    else:  # partial rows req * DECODE_MAX_Q + j, one per query token j of the request
        for j in range(0, q_len):
            _merge_group(
                out_ptr, partial_out_ptr, partial_lse_ptr, sinks_ptr, q_start.to(tl.int64) + j,
                req.to(tl.int64) * DECODE_MAX_Q + j, kv_head, num_active, stride_out_token, stride_out_head,
                stride_partial_req, stride_partial_head, stride_partial_split, stride_lse_req, stride_lse_head,
                GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, MERGE_CHUNK, SINKS,
            )  # fmt: skip
