"""Paged attention over the block pool, in place, for batches that mix prefill chunks and decodes.

One program handles a tile of query rows of one request against one KV head: the rows are
`BLOCK_Q` consecutive query tokens times the `GROUP` query heads that share the KV head (GQA), so
each K/V tile is loaded once for the whole group. Query token `j` of a request sits at position
`seq_len - query_len + j` and attends to every cached position <= it (the already-cached prefix
plus the causal part of this step's chunk).

Split-KV (flash-decoding): with `num_kv_splits > 1`, grid axis 2 cuts each program's KV range
into that many pieces; each writes a normalised partial output and its base-2 log-sum-exp, and
`_merge_splits_kernel` combines them. The split boundaries come from the device-side seq_lens,
so the grid depends only on host-known sizes: no device sync, stable under CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    # Request r owns q-block slots [query_start_loc[r] // BLOCK_Q + r, ...): enough for
    # cdiv(query_len, BLOCK_Q) blocks whatever the alignment. Binary search for the last r whose
    # first slot is <= q_block.
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_slot = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_slot <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs", "num_kv_splits"])
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e): scores live in base 2 so exp2 does the softmax
    num_reqs,
    num_kv_splits,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_partial_token,
    stride_partial_head,
    stride_partial_split,
    stride_lse_token,
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
    DECODE_ONLY: tl.constexpr,  # one query token per request: program axis 0 is the request
    USE_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # fp32 dots for bf16 inputs (the CPU interpreter mis-multiplies bf16)
    DOT_PRECISION: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        req = pid_q
        q_block_local = 0
    else:
        req = _find_request(query_start_loc_ptr, pid_q, num_reqs, BLOCK_Q)
        q_block_local = pid_q - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block_local * BLOCK_Q + rows // GROUP_PAD
    group_idx = rows % GROUP_PAD
    head = kv_head * GROUP + group_idx
    row_valid = (q_tok < q_len) & (group_idx < GROUP)
    token_row = (q_start + q_tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token_row[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = context_len + q_tok

    # This q block sees KV positions [0, kv_end); split `split` takes its share of the tiles.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_kv_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined for rows with no key yet.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_block_table
    for tile in range(tile_begin, tile_end):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_valid = kv_pos < kv_end
        block = tl.load(block_table_row + kv_pos // PAGE_SIZE, mask=kv_valid, other=0)
        kv_offset = (
            block.to(tl.int64) * stride_cache_block
            + (kv_pos % PAGE_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        key_t = tl.load(
            key_cache_ptr + kv_offset[None, :] + dims[:, None],
            mask=kv_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        value = tl.load(
            value_cache_ptr + kv_offset[:, None] + dims[None, :],
            mask=kv_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if UPCAST_DOT:
            key_t = key_t.to(tl.float32)
            value = value.to(tl.float32)
        scores = tl.dot(q, key_t, input_precision=DOT_PRECISION) * scale_log2
        if DECODE_ONLY:
            visible = kv_valid[None, :]
        else:
            visible = kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(value.dtype), value, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if USE_SPLITS:
        partial_row = (
            token_row * stride_partial_token + head * stride_partial_head + split * stride_partial_split
        )
        tl.store(partial_out_ptr + partial_row[:, None] + dims[None, :], result, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(
            partial_lse_ptr + token_row * stride_lse_token + head * stride_lse_head + split,
            lse,
            mask=row_valid,
        )
    else:
        out_offset = token_row[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offset, result.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_reqs", "num_kv_splits"])
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_kv_splits,
    stride_out_token,
    stride_out_head,
    stride_partial_token,
    stride_partial_head,
    stride_partial_split,
    stride_lse_token,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding rows past the last request
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_kv_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    lse = tl.load(
        partial_lse_ptr + token * stride_lse_token + head * stride_lse_head + splits,
        mask=split_valid,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a row with no keys at all
    weights = tl.math.exp2(lse - lse_max)
    denom = tl.sum(weights, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    partial = tl.load(
        partial_out_ptr
        + token * stride_partial_token
        + head * stride_partial_head
        + splits[:, None] * stride_partial_split
        + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    merged = tl.sum(partial * weights[:, None], axis=0) / denom
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def choose_tile_config(
    group_pad: int, head_dim_pad: int, decode_only: bool, max_query_len: int
) -> TileConfig:
    """Tile sizes from host-side facts only (no autotuning: it would sync and break graph capture)."""
    block_n = 64 if head_dim_pad <= 128 else 32
    if decode_only:
        return TileConfig(block_q=1, block_m=max(16, group_pad), block_n=block_n, num_warps=4, num_stages=3)
    # Enough rows to cover the longest chunk's group, capped where registers/shared memory run out.
    cap = 128 if head_dim_pad <= 128 else 64
    block_m = max(16, group_pad, min(cap, triton.next_power_of_2(max(1, max_query_len) * group_pad)))
    num_warps = 8 if block_m >= 128 else 4
    return TileConfig(
        block_q=block_m // group_pad, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=2
    )


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
    partial_out: torch.Tensor | None = None,  # [num_tokens, num_heads, num_kv_splits, head_dim] fp32
    partial_lse: torch.Tensor | None = None,  # [num_tokens, num_heads, num_kv_splits] fp32
) -> None:
    """Attention for every query row into `out`; launches only, never syncs or allocates."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_tokens == 0 or num_reqs == 0:
        return
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    config = choose_tile_config(group_pad, head_dim_pad, decode_only, max_query_len)
    use_splits = num_kv_splits > 1
    if use_splits and (partial_out is None or partial_lse is None):
        raise ValueError("num_kv_splits > 1 needs partial_out and partial_lse scratch buffers")
    if not use_splits:
        partial_out, partial_lse = out, out  # unused by the kernel; any tensor will do
    num_q_programs = num_reqs if decode_only else num_tokens // config.block_q + num_reqs
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[(num_q_programs, num_kv_heads, num_kv_splits)](
        out,
        partial_out,
        partial_lse,
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2_E,
        num_reqs,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=kv_cache.shape[2],
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        DECODE_ONLY=decode_only,
        USE_SPLITS=use_splits,
        UPCAST_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        DOT_PRECISION=dot_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if use_splits:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_lse,
            query_start_loc,
            num_reqs,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
            num_warps=4,
        )
