"""The Triton attention backend: a KV-store kernel plus paged attention for mixed batches.

Decodes (requests with one query token) may split their KV range over several programs
(flash-decoding) so a small batch with long contexts still fills the GPU. The split count comes
from host-side facts only (num_reqs, max_seq_len, the host copy of query_start_loc, the SM
count), never from a device read. Once `prepare_for_capture` has run, decode-only steps up to the
captured batch size use a split count that depends on the batch size alone and write their
partial results into scratch allocated there, so a captured graph replays correctly for any
context length and capture allocates nothing of ours.

Multi-token decodes (metadata's multi_token_decode: speculative verification, every request
computing 1 + k tokens, k <= 7) run in the decode launch too (kernels/triton/paged_attention.py, `decode_query_block`), with the split
rule and the graph scratch of single-token decodes; scratch rows are per query token.

Small decode-only steps can skip the model's separate RoPE + KV-store launch:
`forward_decode_with_rope` takes q and k un-rotated and does RoPE, the KV store and attention in
one launch per layer (`supports_fused_decode_rope` says when the model should call it).

An FP8 cache (float8_e4m3fn) is a compile-time switch too: the KV store divides by the layer's
k_scale / v_scale (AttentionLayerSpec), the attention widens tiles to q's dtype and applies them.

Each layer's sliding window, soft cap and sinks (AttentionLayerSpec) are compile-time switches of
the kernels, so plain layers run the same code as without them; a sliding layer's programs start
at the tile of their earliest row's first visible key and never read the pages before it. Its
split count is planned for the window instead of the whole context. Everything read from the
spec is a python constant of the layer, so CUDA-graph capture and replay are unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.backend import (
    PLAIN_ATTENTION,
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    QKNorm,
)
from tokenmill.config import KernelConfig
from tokenmill.kernels.kv_fp8 import is_fp8_kv
from tokenmill.kernels.triton.fast_launch import PreparedLaunch
from tokenmill.kernels.triton.kv_store import store_kv
from tokenmill.kernels.triton.paged_attention import (
    DecodeRope,
    KernelVariant,
    decode_query_block,
    launch_variants,
    paged_attention,
    replay_paged_attention,
)

MAX_KV_SPLITS = 64
# Below this many KV tokens per split, the merge pass and per-program overhead outweigh the gain.
MIN_TOKENS_PER_SPLIT = 128
# Aim for about this many programs per SM: enough loads in flight to cover memory latency, and
# short enough programs that uneven context lengths leave little tail. Measured on an H200
# (benchmarks/attention_microbench.py, bf16, 8 KV heads): 2 -> 4 took batch 1 at 32K context from
# 0.60 to 0.70 of copy bandwidth, batch 8 at 4K from 0.61 to 0.71, batch 64 at mixed lengths up to
# 4K from 0.60 to 0.72, and cost batch 64 at a uniform 4K 1.00 -> 0.98.
PROGRAMS_PER_SM = 4
# forward_decode_with_rope is used for decode steps of at most this many requests. Measured on an
# H200 (benchmarks/decode_layer_microbench.py, Llama-3.1-8B shapes, us per layer, fused vs the
# separate RoPE + KV-store launch and attention, with these tiles): batch 1 at 640-token context
# 9.5 vs 11.5, at 4000 15.3 vs 17.5; batch 64 at 640 81.5 vs 60.1. With 32-token tiles (another
# run): batch 1 8.1 vs 10.8, batch 8 18.9 vs 17.3, 16 27.8 vs 23.1, 32 42.6 vs 34.3. Batches 2-7
# were not measured, so only single-request steps take it.
FUSED_ROPE_MAX_REQS = 1
_CPU_PSEUDO_SM_COUNT = 4  # interpreter runs only; the value just keeps the planner deterministic


def choose_num_kv_splits(num_reqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """A power of two (fewer kernel variants) between 1 and MAX_KV_SPLITS."""
    base_programs = max(1, num_reqs * num_kv_heads)
    wanted = -(-PROGRAMS_PER_SM * num_sms // base_programs)  # cdiv
    by_length = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    limit = min(wanted, by_length, MAX_KV_SPLITS)
    splits = 1
    while splits * 2 <= limit:
        splits *= 2
    return splits


@dataclass(slots=True)
class _SplitScratch:
    """fp32 partial outputs and log-sum-exps, viewed per step as [reqs, heads, splits, (head_dim)],
    and the per-(request, KV head) arrival counters of the in-kernel merge (zero between launches:
    the kernel resets them)."""

    partial_out: torch.Tensor  # flat
    partial_lse: torch.Tensor  # flat
    split_counters: torch.Tensor  # int32 [max requests * num_kv_heads]

    @classmethod
    def allocate(
        cls,
        capacity_rows: int,
        max_reqs: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> _SplitScratch:
        return cls(
            partial_out=torch.empty(capacity_rows * num_heads * head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(capacity_rows * num_heads, dtype=torch.float32, device=device),
            split_counters=torch.zeros(max_reqs * num_kv_heads, dtype=torch.int32, device=device),
        )

    def views(
        self, num_rows: int, num_heads: int, num_splits: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_rows, heads, splits, (head_dim)]: a row per decode request, or per query token of a
        multi-token decode."""
        rows = num_rows * num_splits
        if rows * num_heads > self.partial_lse.numel():
            raise RuntimeError(
                f"split-KV scratch holds {self.partial_lse.numel() // num_heads} row-splits but this "
                f"step needs {rows} ({num_rows} decode rows x {num_splits} splits); call prepare_for_capture "
                f"with the largest batch size and decode query length that will be captured"
            )
        partial_out = self.partial_out[: rows * num_heads * head_dim].view(
            num_rows, num_heads, num_splits, head_dim
        )
        partial_lse = self.partial_lse[: rows * num_heads].view(num_rows, num_heads, num_splits)
        return partial_out, partial_lse


# Metadata objects whose records are kept: a step has one per KV group (two for models with
# sliding and global layers); more would only hold the tensors of steps that have ended.
_KEPT_STEP_RECORDS = 4


@dataclass(slots=True)
class _StepRecords:
    """The attention launches recorded at the first layer of each kind (window, soft cap, sinks or
    not) for one metadata object of a step, replayed by the other layers of that kind."""

    meta: AttentionMetadata  # held so that its id is not reused while the record lives
    facts: tuple[int, int, int, int]
    launches: dict[tuple, list[PreparedLaunch | None]]


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    supported_layer_features = frozenset({"sliding window", "logit soft-capping", "attention sinks"})
    accepts_kv_stored_by_rope = True  # its cache takes K/V from the RoPE launch (rope_and_store_kv)
    fused_decode_rope_applies_norm = True  # DecodeRope's norm_source
    fused_decode_rope_applies_qk_norm = True  # DecodeRope's q/k norm weights
    supports_cuda_graphs = True
    supports_multi_token_decode = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        *,
        num_kv_splits: int | None = None,
        kernel: KernelConfig | None = None,
    ) -> None:
        """`num_kv_splits` forces the split count for every step (tests and benchmarks)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, kernel=kernel)
        if num_kv_splits is not None and not 1 <= num_kv_splits <= MAX_KV_SPLITS:
            raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")
        self.forced_num_kv_splits = num_kv_splits
        self._num_sms: int | None = None
        self._graph_max_reqs = 0  # decode batches up to this size use the batch-size-only split rule
        self._graph_max_decode_q = 1  # ... and decode query blocks (decode_query_block) up to this
        self._graph_max_context_len = 0
        self._graph_scratch: _SplitScratch | None = None
        self._plan_memo: tuple | None = None  # (metadata, window, plan) of the step being run
        # The recorded launches of the latest steps' metadata objects, by id (oldest first).
        self._replay_memo: dict[int, _StepRecords] = {}

    # -- CUDA-graph hooks -----------------------------------------------------------------------

    def prepare_for_capture(
        self, max_num_reqs: int, max_blocks_per_req: int, max_decode_query_len: int = 1
    ) -> None:
        """Fix the split rule for decode batches <= max_num_reqs (of up to max_decode_query_len
        tokens per request) and allocate their scratch once."""
        if not torch.cuda.is_available():
            raise RuntimeError("prepare_for_capture needs CUDA: graphs are captured on the GPU only")
        device = torch.device("cuda", torch.cuda.current_device())
        limits = (max_num_reqs, decode_query_block(max_decode_query_len), max_blocks_per_req * self.block_size)
        if self._graph_scratch is not None:
            # A second set of graphs (LoRA captures one with its kernels and one without) shares the
            # first's scratch: graphs already captured read it, so it must stay where it is.
            if limits != (self._graph_max_reqs, self._graph_max_decode_q, self._graph_max_context_len):
                raise RuntimeError(
                    f"prepare_for_capture called again with other limits {limits}; graphs captured "
                    "before still read the first call's scratch"
                )
            return
        self._graph_max_reqs, self._graph_max_decode_q, self._graph_max_context_len = limits
        capacity_rows = self._graph_max_decode_q * max(
            batch * self._graph_num_kv_splits(batch, device) for batch in range(1, max_num_reqs + 1)
        )
        self._graph_scratch = _SplitScratch.allocate(
            capacity_rows, max_num_reqs, self.num_heads, self.num_kv_heads, self.head_dim, device
        )

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        # The kernels read seq_lens / block_tables / query_start_loc from the runner's persistent
        # device buffers and derive split boundaries on the device: nothing to refresh here.
        if meta.is_decode_only and meta.num_reqs > self._graph_max_reqs:
            raise RuntimeError(
                f"replaying a decode batch of {meta.num_reqs} requests, but prepare_for_capture "
                f"was called for at most {self._graph_max_reqs}"
            )
        if _decode_query_len(meta) > self._graph_max_decode_q:
            raise RuntimeError(
                f"replaying a decode step of {meta.max_query_len} tokens per request, but "
                f"prepare_for_capture was called for at most {self._graph_max_decode_q}"
            )

    # -- the step ------------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        kv_already_stored: bool = False,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        return self._forward(q, k, v, kv_cache, meta, kv_already_stored=kv_already_stored, layer=layer)

    def supports_kv_cache_dtype(self, kv_cache_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
        # The kernels multiply q with K tiles loaded in the cache's dtype: they must match, or the
        # cache is scaled FP8, whose tiles the kernels widen to q's dtype.
        return kv_cache_dtype == model_dtype or is_fp8_kv(kv_cache_dtype)

    def supports_fused_decode_rope(self, meta: AttentionMetadata) -> bool:
        """Whether this step should go through forward_decode_with_rope (decode-only, small)."""
        return self._fuses_decode_rope(meta.is_decode_only, meta.num_reqs)

    @staticmethod
    def _fuses_decode_rope(decode_only: bool, num_reqs: int) -> bool:
        return decode_only and num_reqs <= FUSED_ROPE_MAX_REQS

    def forward_decode_with_rope(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], not yet rotated
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not yet rotated
        v: torch.Tensor,
        positions: torch.Tensor,  # [num_tokens] int64
        cos_cache: torch.Tensor,  # RotaryEmbedding's tables
        sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        norm_source: torch.Tensor | None = None,
        norm_eps: float = 0.0,
        qk_norm: QKNorm | None = None,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        """A decode-only step's RoPE, KV store and attention in one launch per layer.

        Same result as rotating q and k (kernels/triton/elementwise.rope_inplace), storing k/v and calling
        forward(); q, k and v are left as they were. Mixed batches must use forward().
        With `norm_source` [num_tokens, hidden], q/k/v are first scaled by 1/rms of those rows
        (the deferred input RMSNorm: see DecodeRope). With `qk_norm`, q and k get their per-head
        RMSNorm before RoPE in the same launch.
        """
        if not meta.is_decode_only:
            raise ValueError("forward_decode_with_rope serves decode-only batches; use forward()")
        rope = DecodeRope(
            k,
            v,
            positions,
            cos_cache,
            sin_cache,
            meta.slot_mapping,
            norm_source=norm_source,
            norm_eps=norm_eps,
            q_norm_weight=qk_norm.q_weight if qk_norm is not None else None,
            k_norm_weight=qk_norm.k_weight if qk_norm is not None else None,
            qk_norm_eps=qk_norm.eps if qk_norm is not None else 0.0,
        )
        return self._forward(q, k, v, kv_cache, meta, kv_already_stored=True, rope=rope, layer=layer)

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        kv_already_stored: bool,
        rope: DecodeRope | None = None,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        if q.shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f"q shape {tuple(q.shape)} must be [num_tokens, {self.num_heads}, {self.head_dim}]"
            )
        if kv_cache.shape[2] != self.block_size:
            raise ValueError(
                f"kv_cache block size {kv_cache.shape[2]} must equal the backend's {self.block_size}"
            )
        if not kv_already_stored:
            store_kv(k, v, kv_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty((num_tokens, self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        # Every layer of a step launches the same attention but for its cache, q and output: the
        # first layer (per layer spec) records its launches, the others replay them.
        record = None
        if rope is None and q.is_cuda:
            records = self._step_records(meta)
            # Layers alike in what the launches compile in share one record; their sinks and FP8
            # scales swap in.
            kind = (layer.sliding_window, layer.logits_soft_cap, layer.sinks is not None)
            recorded = records.launches.get(kind)
            if recorded is not None and replay_paged_attention(
                recorded, out, q, kv_cache, layer.k_scale, layer.v_scale, layer.sinks
            ):
                return out
            record = []
        num_splits, (partial_out, partial_lse, split_counters), all_decode = self._step_plan(
            meta, q.device, layer.sliding_window
        )
        decode_q = _decode_query_len(meta)
        paged_attention(
            out,
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            num_reqs=meta.num_reqs,
            max_query_len=meta.max_query_len,
            decode_only=meta.is_decode_only,
            scale=self.scale,
            num_kv_splits=num_splits,
            partial_out=partial_out,
            partial_lse=partial_lse,
            split_counters=split_counters,
            # The split count is fixed per batch size before graph capture (for the longest context);
            # at run time each split still gets at least this many KV tokens (0 = split as planned).
            min_kv_per_split=self.kernel.min_kv_tokens_per_split,
            rope=rope,
            all_decode=all_decode,
            sliding_window=layer.sliding_window,
            logits_soft_cap=layer.logits_soft_cap,
            sinks=layer.sinks,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            decode_query_len=decode_q,
            record=record,
        )
        if record is not None:  # kept only once complete (a launch that raised leaves none behind)
            records.launches[kind] = record
        return out

    def _step_records(self, meta: AttentionMetadata) -> _StepRecords:
        """The launches recorded for `meta` this step. The metadata object is the step's (as for
        _step_plan); its sizes are checked too, in case a caller mutates one in place between
        steps. A hybrid model's step has one metadata object per KV group (sliding and global
        layers alternate), so the latest few are kept rather than only the last."""
        memo = self._replay_memo
        facts = (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len)
        records = memo.get(id(meta))
        if records is None or records.meta is not meta or records.facts != facts:
            memo.pop(id(meta), None)
            while len(memo) >= _KEPT_STEP_RECORDS:
                del memo[next(iter(memo))]
            records = memo[id(meta)] = _StepRecords(meta, facts, {})
        return records

    # -- planning --------------------------------------------------------------------------------

    def _step_plan(
        self, meta: AttentionMetadata, device: torch.device, window: int | None
    ) -> tuple[int, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], bool]:
        """(KV splits, their scratch buffers, all_decode) of a step: the same for every layer of a
        window, so worked out once per step (the metadata object) and window. Every layer of an eager
        step used to redo it (host tensor arithmetic and three scratch allocations per layer).
        Reusing the scratch across layers is safe: the launches run in order on one stream."""
        memo = self._plan_memo
        if memo is not None and memo[0] is meta and memo[1] == window:
            return memo[2]
        num_splits = self._num_kv_splits(meta, device, window)
        scratch = self._scratch(num_splits, meta, device) if num_splits > 1 else (None, None, None)
        # One row per request (decode-only, no zero-row padding requests): the host copy says so.
        all_decode = meta.is_decode_only and int(meta.query_start_loc_cpu[-1]) == meta.num_reqs
        plan = (num_splits, scratch, all_decode)
        # Holding `meta` keeps its id from being reused by a later step's metadata.
        self._plan_memo = (meta, window, plan)
        return plan

    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = _CPU_PSEUDO_SM_COUNT
        return self._num_sms

    def _uses_graph_rule(self, meta: AttentionMetadata) -> bool:
        decode_q = _decode_query_len(meta)
        all_in_decode_launch = meta.is_decode_only or decode_q > 1
        return (
            all_in_decode_launch and meta.num_reqs <= self._graph_max_reqs and decode_q <= self._graph_max_decode_q
        )

    def _graph_num_kv_splits(self, num_reqs: int, device: torch.device, window: int | None = None) -> int:
        """Fixed per batch size (and layer window) before capture. A window only lowers the
        count, so the scratch sized in prepare_for_capture for full layers holds it too."""
        if self.forced_num_kv_splits is not None:
            return self.forced_num_kv_splits
        return choose_num_kv_splits(
            num_reqs, self.num_kv_heads, _keys_seen(self._graph_max_context_len, window), self._sm_count(device)
        )

    def _num_kv_splits(self, meta: AttentionMetadata, device: torch.device, window: int | None = None) -> int:
        if self.forced_num_kv_splits is not None:
            return self.forced_num_kv_splits
        decode_q = _decode_query_len(meta)
        if meta.is_decode_only or decode_q > 1:
            num_decodes = meta.num_reqs
        else:
            # Only the decodes of a mixed batch split; the host copy of query_start_loc says
            # how many there are without touching the device.
            query_lens = meta.query_start_loc_cpu[1:] - meta.query_start_loc_cpu[:-1]
            num_decodes = int((query_lens == 1).sum())
        return self._plan_num_kv_splits(
            meta.is_decode_only, meta.num_reqs, num_decodes, meta.max_seq_len, device, window, decode_q
        )

    def _plan_num_kv_splits(
        self,
        decode_only: bool,
        num_reqs: int,
        num_decodes: int,
        max_seq_len: int,
        device: torch.device,
        window: int | None = None,
        decode_q: int = 1,
    ) -> int:
        """The split count of a step, from the host-side facts `_num_kv_splits` reads off its metadata.
        A multi-token decode step (decode_q > 1: every request in the decode launch) splits as a
        decode-only step of as many requests."""
        if self.forced_num_kv_splits is not None:
            return self.forced_num_kv_splits
        if decode_q > 1:
            if num_reqs <= self._graph_max_reqs and decode_q <= self._graph_max_decode_q:  # _uses_graph_rule
                return self._graph_num_kv_splits(num_reqs, device, window)
            return choose_num_kv_splits(
                num_reqs, self.num_kv_heads, _keys_seen(max_seq_len, window), self._sm_count(device)
            )
        if not decode_only:
            if num_decodes == 0:
                return 1
            return choose_num_kv_splits(
                num_decodes, self.num_kv_heads, _keys_seen(max_seq_len, window), self._sm_count(device)
            )
        if num_reqs <= self._graph_max_reqs:  # _uses_graph_rule
            return self._graph_num_kv_splits(num_reqs, device, window)
        return choose_num_kv_splits(
            num_reqs, self.num_kv_heads, _keys_seen(max_seq_len, window), self._sm_count(device)
        )

    def kernel_variants(
        self,
        *,
        num_reqs: int,
        num_decodes: int,
        max_query_len: int,
        max_seq_len: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
        fused_rope: bool = True,
        decode_only: bool | None = None,
        multi_token_decode: bool = False,
    ) -> tuple[KernelVariant, ...]:
        """The paged-attention kernel variants a step of `layer` launches, from the facts its
        metadata holds (num_decodes: its requests with query_len 1; decode_only: by default
        max_query_len == 1, as the model runner sets it, and then one row per request).
        `fused_rope`: whether the model calls forward_decode_with_rope for the steps
        supports_fused_decode_rope admits. The start-up warm-up (worker/kernel_warmup.py) plans
        with this, so that no serving step compiles one. `multi_token_decode`: the metadata's flag
        (a verification step, every request in the decode launch when max_query_len fits)."""
        if decode_only is None:
            decode_only = max_query_len == 1
        decode_q = decode_query_block(max_query_len) if multi_token_decode and not decode_only else 1
        if decode_q > 1:  # a multi-token decode step: every request in the decode launch
            num_decodes = num_reqs
        splits = self._plan_num_kv_splits(
            decode_only, num_reqs, num_decodes, max_seq_len, device, layer.sliding_window, decode_q
        )
        return launch_variants(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            decode_only=decode_only,
            num_kv_splits=splits,
            fused_merge=True,  # _scratch always hands out split counters
            rope=fused_rope and self._fuses_decode_rope(decode_only, num_reqs),
            all_decode=decode_only,
            kv_fp8=is_fp8_kv(kv_cache_dtype),
            sliding=layer.sliding_window is not None,
            soft_cap=layer.logits_soft_cap is not None,
            sinks=layer.sinks is not None,
            decode_query_len=decode_q,
        )

    def _scratch(
        self, num_splits: int, meta: AttentionMetadata, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Partial outputs, log-sum-exps and merge counters for this step's split decodes (a row per
        query token of a multi-token decode: num_reqs * decode query block)."""
        scratch = self._graph_scratch
        rows = meta.num_reqs * _decode_query_len(meta)
        if scratch is None or not self._uses_graph_rule(meta):
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split-KV during CUDA-graph capture needs prepare_for_capture first")
            scratch = _SplitScratch.allocate(
                rows * num_splits,
                meta.num_reqs,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                device,
            )
        partial_out, partial_lse = scratch.views(rows, self.num_heads, num_splits, self.head_dim)
        return partial_out, partial_lse, scratch.split_counters


def _decode_query_len(meta: AttentionMetadata) -> int:
    """The step's decode query block: 1 unless it is a multi-token decode step (then 2, 4 or 8, or 1
    for queries too long for the decode launch)."""
    if not meta.multi_token_decode or meta.is_decode_only:
        return 1
    return decode_query_block(meta.max_query_len)


def _keys_seen(context_len: int, window: int | None) -> int:
    """How many keys a decode at this context length attends to (what its splits divide)."""
    return context_len if window is None else min(context_len, window)
