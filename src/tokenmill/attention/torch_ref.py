"""The reference attention backend: plain PyTorch over the paged KV cache.

It is the correctness oracle for faster backends and the production path on CPU, so it is
batched: every request's keys are gathered through its block table into one padded
[num_reqs, max_seq_len] tensor, every request's query rows into one padded
[num_reqs, max_query_len] tensor, and a single scaled_dot_product_attention call with a
boolean mask (causal with each request's offset, and no keys past its length) does the rest.

Grouped-query attention is handled without copying K/V: the query heads that share a KV head
are folded into the query-length axis, so each KV head is read once.

Shapes come from python ints in the metadata (max_query_len, max_seq_len) and the host copies,
never from device values, so this never waits on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import (
    PLAIN_ATTENTION,
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
)
from tokenmill.config import KernelConfig

# A mixed batch is padded to num_reqs * max_query_len query rows. When that is much more than
# the real number of rows (a long prefill next to many decodes) the batch is split in two
# groups, single-token queries and longer ones, so the padding stays bounded.
_MAX_PADDING_RATIO = 2
# Gathered K+V bytes per chunk of requests on CPU: small enough to stay in cache until read.
_CPU_CHUNK_BYTES = 4 << 20


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

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
        self._plan: _StepPlan | None = None  # this step's index plans, shared by all layers
        # attend_requests' plans: (the step's metadata, the requests, their plans), shared by all layers
        self._subset_plan: tuple[AttentionMetadata, torch.Tensor, list[_AttendPlan]] | None = None

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
        if not layer.is_plain:
            self.check_layer_spec(layer)
        num_tokens = meta.num_actual_tokens
        if num_tokens == 0 or meta.num_reqs == 0 or meta.query_start_loc_cpu.numel() < 2:
            return q.new_zeros(q.shape[0], self.num_heads, self.head_dim)
        plan = self._plan_for(meta, q.shape[0], kv_cache.shape[2], q.device)
        if not kv_already_stored:
            self._store_kv(k[:num_tokens], v[:num_tokens], kv_cache, plan=plan.store)

        if plan.whole_batch:
            return self._attend(q, kv_cache, plan.groups[0])  # common case: no copy
        out = q.new_zeros(q.shape[0], self.num_heads, self.head_dim)
        for group in plan.groups:
            rows = self._attend(q, kv_cache, group)
            if group.out_rows is None:  # the whole batch, placed among padding rows
                out[plan.first_row : plan.first_row + rows.shape[0]] = rows
            else:
                out.index_copy_(0, group.out_rows, rows)
        return out

    def attend_requests(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, reqs: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Attention for some requests only (host indices; their K/V already stored): a list of
        (rows [n, num_heads, head_dim], where those rows go in the batch). Other backends hand
        the requests they are slow at (long prefill chunks) to this one."""
        starts = meta.query_start_loc_cpu.to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        cached = self._subset_plan
        if cached is None or cached[0] is not meta or not torch.equal(cached[1], reqs):
            plans = [
                self._attend_plan(q.shape[0], kv_cache.shape[2], q.device, meta, group, starts, query_lens)
                for group in _groups_of(reqs, query_lens[reqs])
            ]
            cached = self._subset_plan = (meta, reqs, plans)
        results = []
        for plan in cached[2]:
            assert plan.out_rows is not None
            results.append((self._attend(q, kv_cache, plan), plan.out_rows))
        return results

    def _plan_for(
        self, meta: AttentionMetadata, q_rows: int, block_size: int, device: torch.device
    ) -> _StepPlan:
        """Index plans of this step: the same for every layer, so built once (per metadata object)."""
        plan = self._plan
        if plan is not None and plan.meta is meta and plan.q_rows == q_rows:
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
        self._plan = _StepPlan(meta, q_rows, whole_batch, int(starts[0]), attend_plans, store)
        return self._plan

    def _store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor | None = None,
        *,
        plan: _StorePlan | None = None,
    ) -> None:
        """Write k/v rows at `slots` (or at a prebuilt plan's); slot -1 writes nowhere."""
        if plan is None:
            assert slots is not None, "_store_kv needs slots or a plan"
            plan = _StorePlan.build(slots)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        flat = kv_cache.view(2, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        for i, new in enumerate((k, v)):
            values = torch.where(
                plan.any_valid,
                new.index_select(0, plan.src).to(flat.dtype),
                flat[i].index_select(0, plan.dst),
            )
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
    ) -> _AttendPlan:
        # The host copies cover the real requests; device tensors may hold padding requests after them.
        reqs_host = torch.arange(all_query_lens.numel()) if reqs is None else reqs
        num_reqs = reqs_host.numel()
        query_lens = all_query_lens[reqs_host]
        seq_lens_host = meta.seq_lens_cpu.to(torch.int64)[reqs_host]
        max_query_len = int(query_lens.max())
        max_seq_len = int(seq_lens_host.max())
        group = self.num_heads // self.num_kv_heads
        num_blocks = -(-max_seq_len // block_size)
        key_len = num_blocks * block_size

        # Host-side index plan (tiny tensors), then one copy each to the device.
        offsets = torch.arange(max_query_len)
        in_query = offsets < query_lens[:, None]  # [R, Q]
        # Padded query rows repeat the request's first row; their output is dropped.
        gather_rows = (starts[reqs_host][:, None] + torch.where(in_query, offsets, 0)).flatten()
        gather_rows.clamp_(max=q_rows - 1)  # a request with no query rows may start past the end
        query_pos = (seq_lens_host - query_lens)[:, None] + offsets  # position of query j of each request

        if reqs is None:
            block_table = meta.block_tables[:num_reqs, :num_blocks]
            seq_lens = meta.seq_lens[:num_reqs]
            out_rows = None
        else:
            reqs_dev = reqs.to(device, non_blocking=True)
            block_table = meta.block_tables[:, :num_blocks].index_select(0, reqs_dev)
            seq_lens = meta.seq_lens.index_select(0, reqs_dev)
            out_rows = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in reqs.tolist()])
            out_rows = out_rows.to(device, non_blocking=True)

        # Query j sees keys at positions <= its own and < seq_len. Padded query rows get
        # positions >= seq_len - 1, so they see key 0 at least: no fully masked (NaN) row.
        key_pos = torch.arange(key_len, device=device)
        query_pos = query_pos.to(device, non_blocking=True)
        mask = (key_pos <= query_pos[:, :, None]) & (key_pos < seq_lens.to(torch.int64)[:, None, None])
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

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _AttendPlan) -> torch.Tensor:
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
        if chunk >= num_reqs:
            attn = self._gather_and_attend(queries, kv_cache, plan.block_table, plan.mask)
        else:
            attn = torch.empty(queries.shape, dtype=torch.float32, device=device)
            for start in range(0, num_reqs, chunk):
                end = min(start + chunk, num_reqs)
                attn[start:end] = self._gather_and_attend(
                    queries[start:end], kv_cache, plan.block_table[start:end], plan.mask[start:end]
                )
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
    ) -> torch.Tensor:
        """Gather the requests' K/V through their block tables, then one SDPA call (float32 out)."""
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
        return F.scaled_dot_product_attention(
            queries.to(torch.float32),  # softmax in float32 whatever the model dtype
            keys.view(shape).transpose(1, 2).to(torch.float32),
            values.view(shape).transpose(1, 2).to(torch.float32),
            attn_mask=mask,
            scale=self.scale,
        )

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
