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

Multi-token decodes (`decode_query_len` > 1: a speculative verification step, where each request
computes its last token and k draft tokens): the decode flavour then serves every request with
1..decode_query_len query tokens, one program per (request, KV head, split) whose tile holds all
of the request's query tokens times the GQA group, so each K/V tile is read once for all of them
(as for the group's heads) and split-KV applies as for single-token decodes. Row j of a request
sees keys up to its own position (causal within the step's tokens). Partials are kept per query
row: [num_reqs * decode_query_len, heads, splits, head_dim]. A step whose requests all fit launches
no prefill flavour.

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
the token's row, so the norm needs no launch either. With `rope.q_norm_weight` / `k_norm_weight`
(Qwen3's and Gemma 3's per-head RMSNorm on q and k), every program normalizes its q rows and the
new key before rotating them: one launch instead of the norms', the rotation's and the store's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels.kv_fp8 import is_fp8_kv
from tokenmill.kernels.triton.fast_launch import FastLauncher, PreparedLaunch
from tokenmill.kernels.triton.kv_fp8 import kv_scales_for
from tokenmill.kernels.triton.paged_attention_kernel import _paged_attention_kernel
from tokenmill.kernels.triton.paged_attention_merge import _merge_splits_kernel

LOG2_E = 1.4426950408889634

# A mixed step launches attention eagerly between its CUDA-graph pieces: skip Triton's per-call
# dispatch of these ~90-parameter kernels (kernels/triton/fast_launch.py).
_ATTENTION_LAUNCH = FastLauncher(_paged_attention_kernel)
_MERGE_LAUNCH = FastLauncher(_merge_splits_kernel)


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    merge_chunk: int = 8  # decode: split partials read per round of the merge


# The longest query a decode launch serves (a verification step's 1 + k tokens, k <= 7); longer
# ones take the prefill flavour.
MAX_DECODE_QUERY_LEN = 8


def decode_query_block(max_query_len: int) -> int:
    """The decode launch's query tokens per request for a multi-token decode step (speculative
    verification) whose longest query is `max_query_len`: that, rounded up to a power of two; 1
    (multi-token rows take the prefill flavour) past MAX_DECODE_QUERY_LEN."""
    if max_query_len <= 1 or max_query_len > MAX_DECODE_QUERY_LEN:
        return 1
    return _next_power_of_2(max_query_len)


def decode_tile_config(
    group_pad: int, head_dim_pad: int, num_reqs: int = 0, kv_fp8: bool = False, *, query_len: int = 1
) -> TileConfig:
    """The decode launch's tiles. They must not depend on whether the RoPE + KV store is fused
    in: the fused and the plain launch of one batch take the same tiles in the same order, so
    they agree bit for bit. The merge reads up to 32 splits per round while that stays within
    16K fp32 values.

    Single-request steps take 32-token tiles with 2 stages: on an H200 (Llama-3.1-8B shapes,
    `bench latency`, same machine) 224.5 against 223.2 tok/s with 64-token / 3-stage tiles, and
    8.1-8.2 against 9.4-9.5 us a layer in benchmarks/decode_layer_microbench.py. (With them at
    batches up to 8, the tiny Qwen3 checkpoint's bf16 greedy output once differed from
    transformers' in the 4-request test of tests/gpu/test_engine_gpu.py; larger batches keep
    64-token tiles, which also measured faster from batch 8 on.)

    An FP8 cache takes 64-token tiles with 2 stages at every batch size (head_dim <= 128): on an
    H100 (`benchmarks/fp8_kv_bench.py --part tiles`, Llama-3.1-8B attention shapes, us per decode
    launch, fp8 with these tiles against fp8 with the bf16 tiles / the bf16 cache with its own):
    batch 1 at 8K 18.7 against 27.2 / 28.0, at 32K 62.7 against 73.8 / 80.4; batch 8 at 8K 83.7
    against 97.8 / 105.8, at 32K 285.0 against 342.4 / 378.3. (128-token tiles: 55.1 at batch 1
    and 32K, slower elsewhere; 8 warps slower throughout.)

    `query_len` > 1 (a power of two): multi-token decodes, a tile of query_len tokens times the
    group per program; the KV tiles stay as for single-token decodes."""
    merge_chunk = max(1, min(32, 16384 // (group_pad * head_dim_pad)))
    block_m = max(16, group_pad * query_len)
    if kv_fp8 and head_dim_pad <= 128:
        return TileConfig(
            block_q=query_len, block_m=block_m, block_n=64, num_warps=4, num_stages=2, merge_chunk=merge_chunk
        )
    small = num_reqs == 1 and head_dim_pad <= 128
    block_n = 64 if head_dim_pad <= 128 else 32
    return TileConfig(
        block_q=query_len,
        block_m=block_m,
        block_n=32 if small else block_n,
        num_warps=4,
        num_stages=2 if small else 3,
        merge_chunk=merge_chunk,
    )


def prefill_tile_config(group_pad: int, head_dim_pad: int, max_query_len: int) -> TileConfig:
    """Enough rows to cover the longest chunk's group, capped where registers and shared memory run out."""
    block_n = 64 if head_dim_pad <= 128 else 32
    cap = 128 if head_dim_pad <= 128 else 64
    block_m = max(16, group_pad, min(cap, _next_power_of_2(max(1, max_query_len) * group_pad)))
    num_warps = 8 if block_m >= 128 else 4
    return TileConfig(
        block_q=block_m // group_pad, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=2
    )


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1, without its call overhead (the warm-up plans with
    these functions over thousands of step shapes)."""
    return 1 << (n - 1).bit_length()


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
    # Set for models with a per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3): their
    # [head_dim] weights, 16-bit (rounded as layers/rmsnorm.rms_norm) or float32 (Gemma's 1 + w,
    # rounded once), applied in the launch instead of by launches of their own.
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    qk_norm_eps: float = 0.0


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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype
    k_scale: torch.Tensor | None = None,  # FP8 cache only: float32 [num_kv_heads]; None = 1.0
    v_scale: torch.Tensor | None = None,
    decode_query_len: int = 1,
    record: list[PreparedLaunch | None] | None = None,
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
    The layer's options (see attention/backend.py's AttentionLayerSpec): a query at p sees keys
    p - sliding_window < k <= p, and each program loads only the tiles from its earliest row's
    first visible key on, never a page wholly before it; scores become cap * tanh(scores / cap);
    `sinks` add one logit per head to every softmax's denominator. Each is a compile-time switch
    of the kernels, off (and free) for plain layers.
    An FP8 (float8_e4m3fn) cache holds e4m3 of value / scale per KV head (kernels/kv_fp8.py): its
    tiles are widened to q's dtype, the dots accumulate in fp32, K's scale multiplies the scores
    and V's the output (with `rope`, this step's K/V are stored that way and attended as stored).
    `decode_query_len` (1, 2, 4 or 8; see `decode_query_block`): the decode launch serves the
    requests with 1..decode_query_len query tokens, and the prefill launch the longer ones (none
    run when max_query_len <= decode_query_len > 1); split partials then hold
    num_reqs * decode_query_len rows.
    `record`: a list that receives each launch as a PreparedLaunch (None where one took Triton's
    own path), for `replay_paged_attention` to repeat with another layer's out, q and cache.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_tokens == 0 or num_reqs == 0:
        return
    group_pad = _next_power_of_2(num_heads // num_kv_heads)
    head_dim_pad = max(16, _next_power_of_2(head_dim))
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
    if decode_query_len not in (1, 2, 4, 8) or decode_query_len > MAX_DECODE_QUERY_LEN:
        raise ValueError(f"decode_query_len must be 1, 2, 4 or 8, got {decode_query_len}")
    if decode_query_len > 1 and (rope is not None or decode_only or all_decode):
        raise ValueError(
            "decode_query_len > 1 serves multi-token decodes: not with decode_only / all_decode (one row "
            "per request) or the fused RoPE + KV store (one new token per request)"
        )
    if use_splits and partial_lse is not None and partial_lse.shape[0] < num_reqs * decode_query_len:
        raise ValueError(
            f"partial_out / partial_lse need {num_reqs * decode_query_len} rows (requests x "
            f"decode_query_len), got {partial_lse.shape[0]}"
        )
    if rope is not None:
        _check_rope(rope, q, kv_cache, decode_only)
    layer = _LayerOptions.check(sliding_window, logits_soft_cap, sinks, num_heads)
    if not is_fp8_kv(kv_cache.dtype) and kv_cache.dtype != q.dtype:
        raise ValueError(
            f"a {kv_cache.dtype} KV cache under {q.dtype} queries: the cache must be q's dtype or "
            "float8_e4m3fn (scaled FP8)"
        )
    k_scale, v_scale = kv_scales_for(kv_cache, k_scale, v_scale, num_kv_heads)
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
        layer,
        k_scale,
        v_scale,
        decode_query_len,
        record,
    )
    prefill, config = _tile_configs(
        group_pad, head_dim_pad, num_reqs, max_query_len, decode_only, is_fp8_kv(kv_cache.dtype),
        prefill_config, decode_config, decode_query_len,
    )  # fmt: skip
    if config.block_q != decode_query_len:
        raise ValueError(f"the decode tiles' block_q {config.block_q} must equal decode_query_len {decode_query_len}")
    if prefill is not None:
        launch.attention(prefill, num_tokens // prefill.block_q + num_reqs, decode=False, num_kv_splits=1)
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


def replay_paged_attention(
    launches: list[PreparedLaunch | None],
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Repeat the launches a `paged_attention(..., record=launches)` call made, for another layer of
    the same step with the same window and soft cap, and sinks where the recorded one had them: its
    `out`, `q`, `kv_cache` (FP8 scales, sinks) must match the recorded ones in dtype, shape, strides
    and 16-byte alignment (everything else, the step's metadata and scratch, is reused as
    recorded). False, launching nothing, where they do not or a launch was not recorded: then
    call paged_attention."""
    k_scale, v_scale = kv_scales_for(kv_cache, k_scale, v_scale, kv_cache.shape[3])
    swappable = _swappable(out, q, kv_cache[0], kv_cache[1], k_scale, v_scale, sinks)
    bound = []
    for launch in launches:
        values = launch.bind(swappable) if launch is not None else None
        if values is None:
            return False
        bound.append(values)
    for launch, values in zip(launches, bound, strict=True):
        launch.launch(values)
    return True


def _swappable(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The tensors a recorded launch takes from the layer replaying it: gpt-oss's sinks differ per
    layer (a launch without sinks passes a stand-in, not swapped). A recording finds them among
    its arguments by identity, so they must be the very objects passed (not fresh views)."""
    layer_tensors = (out, q, key_cache, value_cache, k_scale, v_scale)
    return layer_tensors if sinks is None else (*layer_tensors, sinks)


def _tile_configs(
    group_pad: int,
    head_dim_pad: int,
    num_reqs: int,
    max_query_len: int,
    decode_only: bool,
    kv_fp8: bool,
    prefill_config: TileConfig | None = None,
    decode_config: TileConfig | None = None,
    decode_query_len: int = 1,
) -> tuple[TileConfig | None, TileConfig]:
    """(the prefill launch's tiles, None in a decode-only step or a multi-token decode step whose
    requests all fit the decode launch; the decode launch's). In a mixed batch the decode launch
    runs even when no request decodes: its programs then exit at once."""
    prefill = None
    if not decode_only and not (decode_query_len > 1 and max_query_len <= decode_query_len):
        prefill = prefill_config or prefill_tile_config(group_pad, head_dim_pad, max_query_len)
    decode = decode_config or decode_tile_config(
        group_pad, head_dim_pad, num_reqs, kv_fp8, query_len=decode_query_len
    )
    return prefill, decode


@dataclass(frozen=True, slots=True)
class KernelVariant:
    """What makes a launch of `_paged_attention_kernel` a compile of its own, beyond a model's
    constants (dtypes, head counts and sizes, page size, strides): the flavour, its tiles and warps,
    the split count (SPLITS_PAD, MERGE_CHUNK), and the constexpr switches. The integer arguments
    that vary from step to step are not specialized on (do_not_specialize), a launch without
    splits passes `out` for the unused partial buffers (their strides would otherwise make the
    prefill launch of a step with split decodes a variant of its own), and the step's buffers are
    fresh allocations or views at offset 0 (16-byte aligned), so launches with equal variants
    share one compile. `launch_variants` lists a step's; the start-up warm-up compiles them all."""

    decode: bool
    config: TileConfig
    splits_pad: int
    fused_merge: bool
    all_decode: bool
    rope: bool
    kv_fp8: bool
    sliding: bool
    soft_cap: bool
    sinks: bool


def launch_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_reqs: int,
    max_query_len: int,
    decode_only: bool,
    num_kv_splits: int = 1,
    fused_merge: bool = True,
    rope: bool = False,
    all_decode: bool = False,
    kv_fp8: bool = False,
    sliding: bool = False,
    soft_cap: bool = False,
    sinks: bool = False,
    decode_query_len: int = 1,
) -> tuple[KernelVariant, ...]:
    """The kernel variants `paged_attention` launches with these arguments (the default tiles),
    in launch order: what a step compiles the first time a process runs one like it."""
    if num_reqs == 0 or max_query_len == 0:
        return ()
    group_pad = _next_power_of_2(num_heads // num_kv_heads)
    head_dim_pad = max(16, _next_power_of_2(head_dim))
    prefill, decode = _tile_configs(
        group_pad, head_dim_pad, num_reqs, max_query_len, decode_only, kv_fp8, decode_query_len=decode_query_len
    )
    switches = {"kv_fp8": kv_fp8, "sliding": sliding, "soft_cap": soft_cap, "sinks": sinks}
    launches = []
    if prefill is not None:
        launches.append(KernelVariant(False, prefill, 1, False, False, False, **switches))
    splits = num_kv_splits > 1
    launches.append(
        KernelVariant(
            True,
            decode,
            _next_power_of_2(num_kv_splits),
            splits and fused_merge,
            decode_only and all_decode,
            rope,
            **switches,
        )
    )
    return tuple(launches)


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
    if (rope.q_norm_weight is None) != (rope.k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together (a model normalizes both or neither)")
    for name, weight in (("q_norm_weight", rope.q_norm_weight), ("k_norm_weight", rope.k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor, got {tuple(weight.shape)}")


@dataclass(frozen=True, slots=True)
class _LayerOptions:
    """A layer's window, soft cap and sinks as the kernels take them (0 / unused when absent)."""

    sliding_window: int | None
    soft_cap_log2: float | None  # the cap in the base-2 units the kernel's scores use
    sinks: torch.Tensor | None

    @classmethod
    def check(
        cls, sliding_window: int | None, soft_cap: float | None, sinks: torch.Tensor | None, num_heads: int
    ) -> _LayerOptions:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token (or None), got {sliding_window}")
        if soft_cap is not None and not soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive (or None), got {soft_cap}")
        if sinks is not None and (sinks.shape != (num_heads,) or sinks.stride(0) != 1):
            raise ValueError(f"sinks must be a contiguous [{num_heads}] tensor, got {tuple(sinks.shape)}")
        return cls(sliding_window, None if soft_cap is None else soft_cap * LOG2_E, sinks)


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
    partial_out: torch.Tensor | None  # None without splits
    partial_lse: torch.Tensor | None
    split_counters: torch.Tensor
    fused_merge: bool
    layer: _LayerOptions
    k_scale: torch.Tensor  # FP8 cache: float32 [num_kv_heads] (else unused)
    v_scale: torch.Tensor
    decode_query_len: int  # the decode launch serves the requests with 1..this many query tokens
    record: list[PreparedLaunch | None] | None = None  # paged_attention's `record`

    def _launch(
        self,
        launcher: FastLauncher,
        grid: tuple[int, ...],
        swappable: tuple[torch.Tensor, ...],
        *args,
        **kwargs,
    ) -> None:
        if self.record is None:
            launcher(grid, *args, **kwargs)
        else:
            self.record.append(launcher.prepare(swappable, grid, *args, **kwargs))

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
        # Without splits the partial buffers are unused: `out` stands in, so that the prefill launch
        # of a step whose decodes split sees the same strides as any other (one variant, not three).
        partial_out, partial_lse = (self.partial_out, self.partial_lse) if num_kv_splits > 1 else (out, out)
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
        q_norm = rope.q_norm_weight if rope is not None else None
        k_norm = rope.k_norm_weight if rope is not None else None
        layer = self.layer
        self._launch(
            _ATTENTION_LAUNCH,
            (num_q_programs, num_kv_heads, num_kv_splits),
            _swappable(out, q, key_cache, value_cache, self.k_scale, self.v_scale, layer.sinks),
            out,
            partial_out,
            partial_lse,
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
            q_norm if q_norm is not None else q,  # (unused without QK_NORM)
            k_norm if k_norm is not None else q,
            rope.qk_norm_eps if rope is not None else 0.0,
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
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            self.block_tables.stride(0),
            layer.sinks if layer.sinks is not None else q,  # (unused without sinks)
            self.k_scale,
            self.v_scale,
            layer.sliding_window or 0,
            layer.soft_cap_log2 or 0.0,
            GROUP=num_heads // num_kv_heads,
            GROUP_PAD=_next_power_of_2(num_heads // num_kv_heads),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=max(16, _next_power_of_2(head_dim)),
            PAGE_SIZE=kv_cache.shape[2],
            BLOCK_Q=config.block_q,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            DECODE=decode,
            DECODE_MAX_Q=self.decode_query_len,
            ONE_ROW=decode and self.decode_query_len == 1,
            ALL_DECODE=decode and all_decode,
            USE_SPLITS=num_kv_splits > 1,
            FUSED_MERGE=decode and num_kv_splits > 1 and self.fused_merge,
            SPLITS_PAD=_next_power_of_2(num_kv_splits),
            MERGE_CHUNK=min(config.merge_chunk, _next_power_of_2(num_kv_splits)),
            ROPE_KV=rope is not None,
            NORM_SCALE=norm_source is not None,
            QK_NORM=q_norm is not None,
            HIDDEN_PAD=_next_power_of_2(hidden),
            HALF=head_dim // 2,
            SLIDING=layer.sliding_window is not None,
            SOFT_CAP=layer.soft_cap_log2 is not None,
            SINKS=layer.sinks is not None,
            ON_GPU=q.device.type == "cuda",
            # The CPU interpreter multiplies bf16 wrongly (Triton 3.9): do those dots in fp32 there.
            UPCAST_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            KV_FP8=is_fp8_kv(kv_cache.dtype),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )

    def merge(self, num_kv_splits: int, min_tiles: int, config: TileConfig) -> None:
        """Merge the decode launch's split partials (its tiles: `config`)."""
        out = self.out
        num_heads, num_kv_heads = out.shape[1], self.kv_cache.shape[3]
        layer = self.layer
        self._launch(
            _MERGE_LAUNCH,
            (self.num_reqs, num_kv_heads),
            _swappable(out, self.q, self.kv_cache[0], self.kv_cache[1], self.k_scale, self.v_scale, layer.sinks),
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
            layer.sinks if layer.sinks is not None else out,  # (unused without sinks)
            layer.sliding_window or 0,
            GROUP=num_heads // num_kv_heads,
            GROUP_PAD=_next_power_of_2(num_heads // num_kv_heads),
            HEAD_DIM=out.shape[2],
            HEAD_DIM_PAD=max(16, _next_power_of_2(out.shape[2])),
            SPLITS_PAD=_next_power_of_2(num_kv_splits),
            MERGE_CHUNK=min(config.merge_chunk, _next_power_of_2(num_kv_splits)),
            BLOCK_N=config.block_n,
            SLIDING=layer.sliding_window is not None,
            SINKS=layer.sinks is not None,
            DECODE_MAX_Q=self.decode_query_len,
            num_warps=4,
        )
