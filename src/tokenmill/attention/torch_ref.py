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

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata

# A mixed batch is padded to num_reqs * max_query_len query rows. When that is much more than
# the real number of rows (a long prefill next to many decodes) the batch is split in two
# groups, single-token queries and longer ones, so the padding stays bounded.
_MAX_PADDING_RATIO = 2


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        out = q.new_zeros(q.shape[0], self.num_heads, self.head_dim)
        if num_tokens == 0 or meta.num_reqs == 0:
            return out
        self._store_kv(k[:num_tokens], v[:num_tokens], kv_cache, meta.slot_mapping[:num_tokens])

        starts = meta.query_start_loc_cpu.to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        for reqs in _request_groups(query_lens, meta):
            self._attend(q, kv_cache, meta, reqs, starts, query_lens, out)
        return out

    def _store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        # Rows with slot -1 write nowhere. To skip them without a data-dependent shape (a host
        # sync on GPU), each such row repeats the write of the first real row: same slot, same
        # value. If no row is real, slot 0 is rewritten with what it already holds.
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        flat = kv_cache.view(2, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        valid = slots >= 0
        first_valid = torch.argmax(valid.to(torch.int32))
        src = torch.where(valid, torch.arange(slots.shape[0], device=slots.device), first_valid)
        dst = slots.index_select(0, src).clamp_min(0)
        any_valid = valid.any()
        for i, new in enumerate((k, v)):
            values = torch.where(
                any_valid, new.index_select(0, src).to(flat.dtype), flat[i].index_select(0, dst)
            )
            flat[i].index_copy_(0, dst, values)

    def _attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        reqs: torch.Tensor | None,  # host indices of the requests in this group; None = all
        starts: torch.Tensor,  # host [num_reqs + 1]
        all_query_lens: torch.Tensor,  # host [num_reqs]
        out: torch.Tensor,
    ) -> None:
        """Attention for the query rows of `reqs`, written into their rows of `out`."""
        device = q.device
        reqs_host = torch.arange(meta.num_reqs) if reqs is None else reqs
        num_reqs = reqs_host.numel()
        query_lens = all_query_lens[reqs_host]
        seq_lens_host = meta.seq_lens_cpu.to(torch.int64)[reqs_host]
        max_query_len = int(query_lens.max())
        max_seq_len = int(seq_lens_host.max())
        group = self.num_heads // self.num_kv_heads
        block_size = kv_cache.shape[2]
        num_blocks = -(-max_seq_len // block_size)
        key_len = num_blocks * block_size

        # Host-side index plan (tiny tensors), then one copy each to the device.
        offsets = torch.arange(max_query_len)
        in_query = offsets < query_lens[:, None]  # [R, Q]
        # Padded query rows repeat the request's first row; their output is dropped.
        gather_rows = (starts[reqs_host][:, None] + torch.where(in_query, offsets, 0)).flatten()
        query_pos = (seq_lens_host - query_lens)[:, None] + offsets  # position of query j of each request

        block_table = meta.block_tables[:, :num_blocks]
        seq_lens = meta.seq_lens
        if reqs is not None:
            reqs_dev = reqs.to(device, non_blocking=True)
            block_table = block_table.index_select(0, reqs_dev)
            seq_lens = seq_lens.index_select(0, reqs_dev)

        # Keys and values of each request through its block table: [R, kv_heads, key_len, head_dim].
        # index_select copies whole blocks (contiguous rows): much faster than advanced indexing on CPU.
        blocks = block_table.reshape(-1).to(torch.int64)
        shape = (num_reqs, key_len, self.num_kv_heads, self.head_dim)
        keys = kv_cache[0].index_select(0, blocks).view(shape).transpose(1, 2)
        values = kv_cache[1].index_select(0, blocks).view(shape).transpose(1, 2)

        queries = q.index_select(0, gather_rows.to(device, non_blocking=True))
        queries = queries.view(num_reqs, max_query_len, self.num_kv_heads, group, self.head_dim)
        # Fold the `group` query heads that share a KV head into the query axis: [R, kv_heads, group*Q, D].
        queries = queries.permute(0, 2, 3, 1, 4).reshape(num_reqs, self.num_kv_heads, group * max_query_len, -1)

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

        attn = F.scaled_dot_product_attention(
            queries.to(torch.float32),  # softmax in float32 whatever the model dtype
            keys.to(torch.float32),
            values.to(torch.float32),
            attn_mask=mask,
            scale=self.scale,
        )
        attn = attn.view(num_reqs, self.num_kv_heads, group, max_query_len, self.head_dim)
        attn = attn.permute(0, 3, 1, 2, 4).reshape(num_reqs * max_query_len, self.num_heads, self.head_dim)

        # Drop padded rows and put the real ones back in the flattened batch.
        uniform = bool(in_query.all())
        if not uniform:
            attn = attn.index_select(0, torch.nonzero(in_query.flatten()).flatten().to(device, non_blocking=True))
        if reqs is None:
            out[int(starts[0]) : int(starts[-1])] = attn.to(out.dtype)
        else:
            dst = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in reqs.tolist()])
            out.index_copy_(0, dst.to(device, non_blocking=True), attn.to(out.dtype))


def _request_groups(query_lens: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor | None]:
    """Split the batch so padding to the longest query stays bounded (None = the whole batch)."""
    num_rows = int(query_lens.sum())
    if meta.is_decode_only or meta.num_reqs * int(query_lens.max()) <= _MAX_PADDING_RATIO * num_rows + 16:
        return [None]
    groups: list[torch.Tensor | None] = []
    decodes = torch.nonzero(query_lens == 1).flatten()
    if decodes.numel():
        groups.append(decodes)
    longer = torch.nonzero(query_lens != 1).flatten()
    lens = query_lens[longer]
    if longer.numel() * int(lens.max()) <= _MAX_PADDING_RATIO * int(lens.sum()) + 16:
        groups.append(longer)
    else:  # very uneven prefills: one request at a time
        groups.extend(longer[i : i + 1] for i in range(longer.numel()))
    return groups
