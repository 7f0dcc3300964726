"""The attention benchmarks' scattered-pool batch builder: every query token's slot is in its own
request's blocks at its position, and no two requests share a block."""

from __future__ import annotations

import torch

from tokenmill.bench.paged_batch import scattered_paged_batch


def test_slots_follow_each_requests_block_table() -> None:
    query_lens, context_lens, block = [5, 1, 1, 17], [0, 20, 33, 15], 16
    meta, num_blocks = scattered_paged_batch(query_lens, context_lens, block, "cpu", seed=3, extra_blocks=2)
    assert num_blocks == 1 + 2 + 3 + 2 + 2
    assert meta.query_start_loc.tolist() == [0, 5, 6, 7, 24] and not meta.is_decode_only
    assert meta.seq_lens.tolist() == [5, 21, 34, 32]
    slots = meta.slot_mapping.tolist()
    for r, (start, end) in enumerate(
        zip(meta.query_start_loc[:-1].tolist(), meta.query_start_loc[1:].tolist(), strict=True)
    ):
        for token, position in zip(
            range(start, end), range(context_lens[r], context_lens[r] + query_lens[r]), strict=True
        ):
            block_id = int(meta.block_tables[r, position // block])
            assert slots[token] == block_id * block + position % block
    owned = [
        set(meta.block_tables[r, : -(-s // block)].tolist()) for r, s in enumerate(meta.seq_lens.tolist())
    ]
    assert sum(map(len, owned)) == len(set().union(*owned)) == 8  # distinct blocks, none shared
    assert scattered_paged_batch([1, 1], [7, 9], block, "cpu")[0].is_decode_only
    same = scattered_paged_batch(query_lens, context_lens, block, "cpu", seed=3, extra_blocks=2)[0]
    assert torch.equal(same.block_tables, meta.block_tables)
