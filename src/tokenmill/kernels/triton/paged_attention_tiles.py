"""The @triton.jit helpers of the paged attention kernel: which request owns a q-block, the
split-KV plan, and one KV tile's loads and online-softmax update. See paged_attention.py.

SLIDING, SOFT_CAP, KV_FP8 (and the kernel's SINKS) are constexpr: a plain layer over a 16-bit
cache compiles to the same code as without them."""

from __future__ import annotations

import triton
import triton.language as tl


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
def _window_first_tile(first_query_pos, sliding_window, BLOCK_N: tl.constexpr):
    """(first key position, its tile) that a query at `first_query_pos` (the earliest of its
    program) sees: p - window < k <= p. The tiles before it are never loaded."""
    kv_begin = tl.maximum(first_query_pos - sliding_window + 1, 0)
    return kv_begin, kv_begin // BLOCK_N


@triton.jit
def _tanh(x):
    """tanh from exp2 of a non-positive argument: no overflow for any x, no libdevice call (so
    the CPU interpreter runs it too)."""
    t = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _load_tile(
    tile,
    cached_end,  # positions < cached_end are read from the pages
    cached_begin,  # SLIDING: and positions >= cached_begin (the blocks before may be reused)
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
    SLIDING: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache is e4m3: widen to COMPUTE_DTYPE (exact; the scales apply later)
    COMPUTE_DTYPE: tl.constexpr,  # q's dtype, the dots' operand type
):
    """One KV tile's keys (transposed, [head_dim, BLOCK_N]) and values ([BLOCK_N, head_dim])."""
    kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cached = kv_pos < cached_end
    if SLIDING:
        cached = cached & (kv_pos >= cached_begin)
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
    if KV_FP8:
        key_t = key_t.to(COMPUTE_DTYPE)
        value = value.to(COMPUTE_DTYPE)
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
    kv_begin,  # SLIDING: positions < kv_begin are before every row's window
    kv_end,  # positions < kv_end are visible
    q_pos,
    k_new,  # NEW_TOKEN: the key and value of position kv_end - 1, in registers
    v_new,
    scale_log2,
    sliding_window,  # SLIDING: a row at p sees p - sliding_window < k <= p
    soft_cap_log2,  # SOFT_CAP: the cap in the base-2 units of the scores (cap * log2(e))
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    NEW_TOKEN: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
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
    if SOFT_CAP:
        # cap * tanh(s / cap) on the natural-log scores is the same map on the base-2 ones.
        scores = soft_cap_log2 * _tanh(scores / soft_cap_log2)
    if DECODE:
        visible = kv_valid[None, :]
        if SLIDING:  # one row, at kv_end - 1: its window starts at kv_begin
            visible = visible & (kv_pos >= kv_begin)[None, :]
    else:
        visible = kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
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
    kv_begin,  # SLIDING: positions < kv_begin are neither read nor visible
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
    sliding_window,
    soft_cap_log2,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    NEW_TOKEN: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    """One KV tile of the online softmax: returns the updated (m_i, l_i, acc)."""
    key_t, value = _load_tile(
        tile, cached_end, kv_begin, block_table_row, key_cache_ptr, value_cache_ptr, kv_head, dims,
        dim_valid, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE_SIZE, BLOCK_N, SLIDING,
        KV_FP8, COMPUTE_DTYPE,
    )  # fmt: skip
    return _attend_loaded(
        q, m_i, l_i, acc, key_t, value, tile, kv_begin, kv_end, q_pos, k_new, v_new, scale_log2,
        sliding_window, soft_cap_log2, BLOCK_N, DECODE, NEW_TOKEN, SLIDING, SOFT_CAP, UPCAST_DOT,
        DOT_PRECISION,
    )  # fmt: skip
