"""The reference attention backend: plain PyTorch over the paged KV cache.

It is the correctness oracle for faster backends and the production path on CPU, so it is
batched: every request's keys are gathered through its block table into one padded
[num_reqs, max_seq_len] tensor, every request's query rows into one padded
[num_reqs, max_query_len] tensor, and a single scaled_dot_product_attention call with a
boolean mask (causal with each request's offset, and no keys past its length) does the rest.

Grouped-query attention is handled without copying K/V: the query heads that share a KV head
are folded into the query-length axis, so each KV head is read once.

Layers with a sliding window gather only the blocks from the one holding the first key the
request's earliest query row can see (block-table entries before it may point at freed and
reused blocks), and mask the window's lower edge. Soft-capping and sinks need the scores
themselves, so such layers replace the SDPA call with explicit float32 score math.

An FP8 cache (float8_e4m3fn) stores e4m3 of value / scale with the layer's per-KV-head k_scale /
v_scale (kernels/kv_fp8.py) and reads stored * scale in float32; its rows move as bytes (torch has
no float8 index_copy on the CPU).

Shapes come from python ints in the metadata (max_query_len, max_seq_len) and the host copies,
never from device values, so this never waits on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import (
    PLAIN_ATTENTION,
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
)
from tokenmill.config import KernelConfig
from tokenmill.kernels.kv_fp8 import dequantize_kv, is_fp8_kv, quantize_kv

# A mixed batch is padded to num_reqs * max_query_len query rows. When that is much more than
# the real number of rows (a long prefill next to many decodes) the batch is split in two
# groups, single-token queries and longer ones, so the padding stays bounded.
_MAX_PADDING_RATIO = 2
# Step plans kept (per metadata object): enough for the KV cache groups of one step.
_MAX_CACHED_STEP_PLANS = 8
# Gathered K+V bytes per chunk of requests on CPU: small enough to stay in cache until read.
_CPU_CHUNK_BYTES = 4 << 20


class TorchReferenceBackend(AttentionBackend):
    name = "torch"
    supported_layer_features = frozenset({"sliding window", "logit soft-capping", "attention sinks"})

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        *,
        kernel: KernelConfig | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, kernel=kernel)
        self._buffer: torch.Tensor | None = None  # gathered K/V, reused across layers and steps
        # This step's index plans, shared by all layers: one per KV cache group's metadata (a model
        # with sliding-window layers has several, and its layers alternate between them).
        self._plans: list[_StepPlan] = []
        # attend_requests' plans: (the step's metadata, the requests, their plans per sliding
        # window, None for full layers), shared by all layers
        self._subset_plan: (
            tuple[AttentionMetadata, torch.Tensor, dict[int | None, list[_AttendPlan]]] | None
        ) = None

    def supports_kv_cache_dtype(self, kv_cache_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
        return super().supports_kv_cache_dtype(kv_cache_dtype, model_dtype) or is_fp8_kv(kv_cache_dtype)

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
        num_tokens = meta.num_actual_tokens
        if num_tokens == 0 or meta.num_reqs == 0 or meta.query_start_loc_cpu.numel() < 2:
            return q.new_zeros(q.shape[0], self.num_heads, self.head_dim)
        plan = self._plan_for(meta, q.shape[0], kv_cache.shape[2], q.device)
        if not kv_already_stored:
            scales = (layer.k_scale, layer.v_scale)
            self._store_kv(k[:num_tokens], v[:num_tokens], kv_cache, plan=plan.store, scales=scales)

        groups = plan.groups_for(layer.sliding_window, self._window_plans)
        if plan.whole_batch:
            return self._attend(q, kv_cache, groups[0], layer)  # common case: no copy
        out = q.new_zeros(q.shape[0], self.num_heads, self.head_dim)
        for group in groups:
            rows = self._attend(q, kv_cache, group, layer)
            if group.out_rows is None:  # the whole batch, placed among padding rows
                out[plan.first_row : plan.first_row + rows.shape[0]] = rows
            else:
                out.index_copy_(0, group.out_rows, rows)
        return out

    def attend_requests(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        reqs: torch.Tensor,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Attention for some requests only (host indices; their K/V already stored): a list of
        (rows [n, num_heads, head_dim], where those rows go in the batch). Other backends hand
        the requests they are slow at (long prefill chunks) to this one."""
        starts = meta.query_start_loc_cpu.to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        cached = self._subset_plan
        if cached is None or cached[0] is not meta or not torch.equal(cached[1], reqs):
            # (With several KV cache groups this is rebuilt as layers alternate between the groups'
            # metadata; only long prefill chunks of the C++ backend come here.)
            cached = self._subset_plan = (meta, reqs, {})
        window = layer.sliding_window
        plans = cached[2].get(window)
        if plans is None:  # per window: sliding and full layers alternate within one step
            plans = cached[2][window] = [
                self._attend_plan(
                    q.shape[0], kv_cache.shape[2], q.device, meta, group, starts, query_lens, window
                )
                for group in _groups_of(reqs, query_lens[reqs])
            ]
        results = []
        for plan in plans:
            assert plan.out_rows is not None
            results.append((self._attend(q, kv_cache, plan, layer), plan.out_rows))
        return results

    def _plan_for(
        self, meta: AttentionMetadata, q_rows: int, block_size: int, device: torch.device
    ) -> _StepPlan:
        """Index plans of this step: the same for every layer, so built once (per metadata object)."""
        for plan in self._plans:
            if plan.meta is meta and plan.q_rows == q_rows:
                return plan
        starts = meta.query_start_loc_cpu.to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        groups = _request_groups(query_lens, meta)  # None: the whole batch at once
        whole_batch = groups is None and int(starts[0]) == 0 and q_rows == meta.num_actual_tokens
        attend_plans = [
            self._attend_plan(q_rows, block_size, device, meta, reqs, starts, query_lens)
            for reqs in (groups or [None])
        ]
        store = _StorePlan.build(meta.slot_mapping[: meta.num_actual_tokens])
        plan = _StepPlan(
            meta, q_rows, whole_batch, int(starts[0]), attend_plans, store, groups, block_size, device
        )
        # The latest few: a step's groups (and nothing older once a new step has as many).
        self._plans = [plan, *self._plans[: _MAX_CACHED_STEP_PLANS - 1]]
        return plan

    def _window_plans(self, plan: _StepPlan, window: int) -> list[_AttendPlan]:
        """A step's attend plans for layers with a sliding window of `window` tokens."""
        starts = plan.meta.query_start_loc_cpu.to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        return [
            self._attend_plan(
                plan.q_rows, plan.block_size, plan.device, plan.meta, reqs, starts, query_lens, window
            )
            for reqs in (plan.request_groups or [None])
        ]

    def _store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor | None = None,
        *,
        plan: _StorePlan | None = None,
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> None:
        """Write k/v rows at `slots` (or at a prebuilt plan's); slot -1 writes nowhere. An FP8
        cache takes them quantized with `scales` (k_scale, v_scale; None = 1.0)."""
        if plan is None:
            assert slots is not None, "_store_kv needs slots or a plan"
            plan = _StorePlan.build(slots)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        fp8 = is_fp8_kv(kv_cache.dtype)
        flat = kv_cache.view(2, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        if fp8:
            flat = flat.view(torch.uint8)  # the rows move as bytes
        for i, new in enumerate((k, v)):
            rows = new.index_select(0, plan.src)
            rows = quantize_kv(rows, scales[i]).view(torch.uint8) if fp8 else rows.to(flat.dtype)
            values = torch.where(plan.any_valid, rows, flat[i].index_select(0, plan.dst))
            flat[i].index_copy_(0, plan.dst, values)

    def _attend_plan(
        self,
        q_rows: int,
        block_size: int,
        device: torch.device,
        meta: AttentionMetadata,
        reqs: torch.Tensor | None,  # host indices of the requests in this group; None = all
        starts: torch.Tensor,  # host [num_reqs + 1]
        all_query_lens: torch.Tensor,  # host [num_reqs]
        window: int | None = None,  # the layer's sliding window; None = every earlier key
    ) -> _AttendPlan:
        # The host copies cover the real requests; device tensors may hold padding requests after them.
        reqs_host = torch.arange(all_query_lens.numel()) if reqs is None else reqs
        num_reqs = reqs_host.numel()
        query_lens = all_query_lens[reqs_host]
        seq_lens_host = meta.seq_lens_cpu.to(torch.int64)[reqs_host]
        max_query_len = int(query_lens.max())
        max_seq_len = int(seq_lens_host.max())
        group = self.num_heads // self.num_kv_heads

        # Host-side index plan (tiny tensors), then one copy each to the device.
        offsets = torch.arange(max_query_len)
        in_query = offsets < query_lens[:, None]  # [R, Q]
        # Padded query rows repeat the request's first row; their output is dropped.
        gather_rows = (starts[reqs_host][:, None] + torch.where(in_query, offsets, 0)).flatten()
        gather_rows.clamp_(max=q_rows - 1)  # a request with no query rows may start past the end
        query_pos = (seq_lens_host - query_lens)[:, None] + offsets  # position of query j of each request

        if reqs is None:
            tables = meta.block_tables[:num_reqs]
            seq_lens = meta.seq_lens[:num_reqs]
            out_rows = None
        else:
            reqs_dev = reqs.to(device, non_blocking=True)
            tables = meta.block_tables.index_select(0, reqs_dev)
            seq_lens = meta.seq_lens.index_select(0, reqs_dev)
            out_rows = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in reqs.tolist()])
            out_rows = out_rows.to(device, non_blocking=True)

        if window is None:
            num_blocks = -(-max_seq_len // block_size)
            key_len = num_blocks * block_size
            block_table = tables[:, :num_blocks]
            # Query j sees keys at positions <= its own and < seq_len. Padded query rows get
            # positions >= seq_len - 1, so they see key 0 at least: no fully masked (NaN) row.
            key_pos = torch.arange(key_len, device=device)
            query_pos = query_pos.to(device, non_blocking=True)
            mask = (key_pos <= query_pos[:, :, None]) & (key_pos < seq_lens.to(torch.int64)[:, None, None])
        else:
            block_table, key_pos_host, key_len = _window_blocks(
                tables, seq_lens_host, query_lens, window, block_size
            )
            # Padded query rows take the last real position: it sees itself, so no row is fully masked.
            query_pos = torch.minimum(query_pos, seq_lens_host[:, None] - 1).to(device, non_blocking=True)
            key_pos = key_pos_host.to(device, non_blocking=True)[:, None, :]  # [R, 1, L]
            # p - window < k <= p; the gathered columns past seq_len lie after every query position.
            mask = (key_pos <= query_pos[:, :, None]) & (key_pos > query_pos[:, :, None] - window)
        if max_query_len == 1:
            mask = mask[:, None]  # [R, 1, 1, L]: broadcasts over the folded heads
        else:
            mask = mask[:, None, None].expand(num_reqs, 1, group, max_query_len, key_len)
            mask = mask.reshape(num_reqs, 1, group * max_query_len, key_len)
        keep_rows = None
        if not bool(in_query.all()):
            keep_rows = torch.nonzero(in_query.flatten()).flatten().to(device, non_blocking=True)
        return _AttendPlan(
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            key_len=key_len,
            gather_rows=gather_rows.to(device, non_blocking=True),
            block_table=block_table,
            mask=mask,
            keep_rows=keep_rows,
            out_rows=out_rows,
        )

    def _attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _AttendPlan,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        """Attention output [rows, num_heads, head_dim] for the query rows of a plan's requests."""
        device = q.device
        num_reqs, max_query_len, key_len = plan.num_reqs, plan.max_query_len, plan.key_len
        group = self.num_heads // self.num_kv_heads
        queries = q.index_select(0, plan.gather_rows)
        queries = queries.view(num_reqs, max_query_len, self.num_kv_heads, group, self.head_dim)
        # Fold the `group` query heads that share a KV head into the query axis: [R, kv_heads, group*Q, D].
        queries = queries.permute(0, 2, 3, 1, 4).reshape(
            num_reqs, self.num_kv_heads, group * max_query_len, -1
        )

        # On CPU, requests go in chunks whose gathered K/V stay in cache for the attention that
        # reads them right after (about twice as fast as one big gather); a GPU takes all at once.
        bytes_per_req = 2 * key_len * self.num_kv_heads * self.head_dim * kv_cache.element_size()
        chunk = max(1, _CPU_CHUNK_BYTES // bytes_per_req) if device.type == "cpu" else num_reqs
        # Soft-capping and sinks change the scores themselves: explicit score math instead of SDPA.
        scores = None
        if layer.logits_soft_cap is not None or layer.sinks is not None:
            scores = _ScoreMath(layer.logits_soft_cap, _sink_column(layer.sinks, group, max_query_len))
        kv_scales = (layer.k_scale, layer.v_scale) if is_fp8_kv(kv_cache.dtype) else None
        if chunk >= num_reqs:
            attn = self._gather_and_attend(queries, kv_cache, plan.block_table, plan.mask, scores, kv_scales)
        else:
            attn = torch.empty(queries.shape, dtype=torch.float32, device=device)
            for start in range(0, num_reqs, chunk):
                end = min(start + chunk, num_reqs)
                attn[start:end] = self._gather_and_attend(
                    queries[start:end], kv_cache, plan.block_table[start:end], plan.mask[start:end], scores,
                    kv_scales,
                )  # fmt: skip
        attn = attn.view(num_reqs, self.num_kv_heads, group, max_query_len, self.head_dim)
        attn = attn.permute(0, 3, 1, 2, 4).reshape(num_reqs * max_query_len, self.num_heads, self.head_dim)
        if plan.keep_rows is not None:  # drop the padded rows
            attn = attn.index_select(0, plan.keep_rows)
        return attn.to(q.dtype)

    def _gather_and_attend(
        self,
        queries: torch.Tensor,  # [R, kv_heads, rows, head_dim]
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,  # [R, num_blocks]
        mask: torch.Tensor,  # [R, 1, rows or 1, key_len]
        scores: _ScoreMath | None = None,
        kv_scales: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,  # an FP8 cache's
    ) -> torch.Tensor:
        """Gather the requests' K/V through their block tables, then one SDPA call (float32 out),
        or the explicit score math of a soft-capped / sink layer. An FP8 cache's K/V are read as
        stored * scale (`kv_scales`: k_scale, v_scale)."""
        num_reqs, num_blocks = block_table.shape
        blocks = block_table.reshape(-1).to(torch.int64)
        per_cache = num_reqs * num_blocks * kv_cache[0, 0].numel()
        buffer = self._gather_buffer(2 * per_cache, kv_cache)
        shape = (num_reqs, num_blocks * kv_cache.shape[2], self.num_kv_heads, self.head_dim)
        # index_select copies whole blocks (contiguous rows): much faster than advanced indexing on CPU.
        keys = torch.index_select(
            kv_cache[0], 0, blocks, out=buffer[:per_cache].view(-1, *kv_cache.shape[2:])
        )
        values = torch.index_select(
            kv_cache[1], 0, blocks, out=buffer[per_cache:].view(-1, *kv_cache.shape[2:])
        )
        # Softmax in float32 whatever the model dtype.
        queries = queries.to(torch.float32)
        keys = keys.view(shape).transpose(1, 2)
        values = values.view(shape).transpose(1, 2)
        if kv_scales is not None:  # [R, kv_heads, L, D]: heads on axis 1
            keys = dequantize_kv(keys, kv_scales[0], heads_axis=1)
            values = dequantize_kv(values, kv_scales[1], heads_axis=1)
        else:
            keys = keys.to(torch.float32)
            values = values.to(torch.float32)
        if scores is not None:
            return scores.attend(queries, keys, values, mask, self.scale)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)

    def _gather_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        # Reused across layers and steps: a fresh multi-MB allocation per layer costs page faults.
        buffer = self._buffer
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffer = buffer
        return buffer[:numel]


def _request_groups(query_lens: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor] | None:
    """Split the batch so padding to the longest query stays bounded; None = no split needed."""
    num_rows = int(query_lens.sum())
    if (
        meta.is_decode_only
        or query_lens.numel() * int(query_lens.max()) <= _MAX_PADDING_RATIO * num_rows + 16
    ):
        return None
    groups: list[torch.Tensor] = []
    decodes = torch.nonzero(query_lens == 1).flatten()
    if decodes.numel():
        groups.append(decodes)
    longer = torch.nonzero(query_lens != 1).flatten()
    groups.extend(_groups_of(longer, query_lens[longer]))
    return groups


def _groups_of(reqs: torch.Tensor, query_lens: torch.Tensor) -> list[torch.Tensor]:
    """`reqs` in one group when padding them to the longest query stays bounded, else one by one."""
    if reqs.numel() == 0:
        return []
    if reqs.numel() * int(query_lens.max()) <= _MAX_PADDING_RATIO * int(query_lens.sum()) + 16:
        return [reqs]
    return [reqs[i : i + 1] for i in range(reqs.numel())]


@dataclass(slots=True)
class _StorePlan:
    """Where this step's K/V rows go. Rows with slot -1 write nowhere: to skip them without a
    data-dependent shape (a host sync on GPU), each such row repeats the write of the first real
    row (same slot, same value); if no row is real, slot 0 is rewritten with what it holds."""

    src: torch.Tensor
    dst: torch.Tensor
    any_valid: torch.Tensor

    @classmethod
    def build(cls, slots: torch.Tensor) -> _StorePlan:
        valid = slots >= 0
        first_valid = torch.argmax(valid.to(torch.int32))
        src = torch.where(valid, torch.arange(slots.shape[0], device=slots.device), first_valid)
        return cls(src=src, dst=slots.index_select(0, src).clamp_min(0), any_valid=valid.any())


@dataclass(slots=True)
class _AttendPlan:
    """One group of requests' gather indices and mask (device tensors)."""

    num_reqs: int
    max_query_len: int
    key_len: int
    gather_rows: torch.Tensor  # query rows, padded to max_query_len per request
    block_table: torch.Tensor  # [num_reqs, key_len // block_size]
    mask: torch.Tensor  # [num_reqs, 1, rows or 1, key_len]
    keep_rows: torch.Tensor | None  # real rows among the padded ones; None: all real
    out_rows: torch.Tensor | None  # where the group's rows go in the batch; None: the whole batch


@dataclass(slots=True)
class _StepPlan:
    meta: AttentionMetadata  # the step it was built for (held, so identity is meaningful)
    q_rows: int
    whole_batch: bool
    first_row: int  # where the real query rows start in q
    groups: list[_AttendPlan]
    store: _StorePlan
    request_groups: list[torch.Tensor] | None  # how the batch is split (None: all at once)
    block_size: int
    device: torch.device
    # Sliding-window layers' plans, per window size, built by the first such layer of the step.
    windowed: dict[int, list[_AttendPlan]] = field(default_factory=dict)

    def groups_for(
        self, window: int | None, build: Callable[[_StepPlan, int], list[_AttendPlan]]
    ) -> list[_AttendPlan]:
        if window is None:
            return self.groups
        plans = self.windowed.get(window)
        if plans is None:
            plans = self.windowed[window] = build(self, window)
        return plans


def _window_blocks(
    tables: torch.Tensor,  # [R, max_blocks] int32, on the device
    seq_lens: torch.Tensor,  # host [R]
    query_lens: torch.Tensor,  # host [R]
    window: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The blocks a sliding-window layer reads: from the one holding the first key that the
    request's earliest query row sees to the one holding its last key. Entries before that may
    name blocks that were freed and reused, so they are never gathered. Requests needing fewer
    blocks than the longest repeat their last block (masked: those columns lie past seq_len).

    Returns the block table to gather [R, n] (device), each column's key positions [R, n *
    block_size] (host) and n * block_size."""
    first_key = (seq_lens - query_lens - window + 1).clamp_min(0)
    first_block = first_key // block_size
    last_block = torch.maximum((seq_lens - 1) // block_size, first_block)
    num_blocks = last_block - first_block + 1
    width = int(num_blocks.max())
    steps = torch.arange(width)
    columns = first_block[:, None] + torch.minimum(steps[None, :], num_blocks[:, None] - 1)
    block_table = tables.gather(1, columns.to(tables.device, non_blocking=True))
    key_pos = (first_block[:, None] + steps[None, :])[:, :, None] * block_size + torch.arange(block_size)
    return block_table, key_pos.reshape(seq_lens.numel(), width * block_size), width * block_size


def _sink_column(sinks: torch.Tensor | None, group: int, max_query_len: int) -> torch.Tensor | None:
    """Per-head sink logits laid out like the folded query rows: [kv_heads, group * Q, 1] float32."""
    if sinks is None:
        return None
    per_kv_head = sinks.to(torch.float32).view(-1, group, 1)
    return per_kv_head.expand(-1, group, max_query_len).reshape(per_kv_head.shape[0], -1, 1)


@dataclass(slots=True)
class _ScoreMath:
    """Softmax attention with explicit scores, for what SDPA cannot express: Gemma 2's soft cap
    (cap * tanh(scores / cap), after scaling, before masking) and gpt-oss's sinks (one more
    logit per head in every softmax row, whose weight goes to no value)."""

    soft_cap: float | None
    sink_column: torch.Tensor | None  # [kv_heads, rows, 1], see _sink_column

    def attend(
        self,
        queries: torch.Tensor,  # [R, kv_heads, rows, head_dim] float32
        keys: torch.Tensor,  # [R, kv_heads, key_len, head_dim] float32
        values: torch.Tensor,
        mask: torch.Tensor,  # [R, 1, rows or 1, key_len] bool, True = visible
        scale: float,
    ) -> torch.Tensor:
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
        if self.soft_cap is not None:
            scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sink_column is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sinks = self.sink_column[None].expand(scores.shape[0], -1, -1, -1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs, values)
