"""A step's attention metadata over a scattered block pool, for attention benchmarks and tests.

Requests get blocks in a random order (as a pool that has been in use hands them out), each with
`context_lens[i]` tokens already cached and `query_lens[i]` query tokens this step, whose slots
are the positions after the context.
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata


def scattered_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str = "cuda",
    seed: int | None = 0,
    *,
    extra_blocks: int = 0,
) -> tuple[AttentionMetadata, int]:
    """(the step's metadata on `device`, the pool's block count: the requests' blocks plus
    `extra_blocks`). A step is decode-only when every query is one token. `seed` None: torch's
    global generator orders the blocks."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + extra_blocks
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots, used = [], 0
    for r, n in enumerate(blocks):
        owned = order[used : used + n]
        used += n
        tables[r, :n] = owned.to(torch.int32)
        positions = torch.arange(context_lens[r], seq_lens[r])
        slots.append(owned[positions // block_size] * block_size + positions % block_size)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=sum(query_lens),
        num_reqs=len(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq.to(device),
        block_tables=tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq,
        is_decode_only=max(query_lens) == 1,
    )
    return meta, num_blocks
