"""Inputs for a step the engine runs only for itself (memory profiling, kernel warm-up), against
a scratch KV cache: every request reads the same `blocks_per_req` blocks and writes nowhere
(in every KV cache group: the groups' siblings share group 0's tables)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata


def scratch_step(
    query_lens: list[int],
    seq_lens: list[int],
    blocks_per_req: int,
    device: torch.device,
    decode_only: bool,
    num_kv_groups: int = 1,
    num_blocks: int | None = None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of a batch whose request i computes its last query_lens[i] of
    seq_lens[i] tokens; slot -1 for every token, so no K/V is stored. With `num_blocks`, the
    table's entries cycle through that many blocks (a long context over a small scratch pool)."""
    num_tokens = sum(query_lens)
    qsl = np.zeros(len(query_lens) + 1, np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    lens = np.asarray(seq_lens, np.int32)
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=int(lens.max()),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(lens).to(device),
        block_tables=(torch.arange(blocks_per_req, dtype=torch.int32) % (num_blocks or blocks_per_req))
        .to(device)
        .repeat(len(query_lens), 1),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
        query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens_cpu=torch.from_numpy(lens),
        is_decode_only=decode_only,
    )
    if num_kv_groups > 1:
        meta.with_kv_groups([(meta.block_tables, meta.slot_mapping)] * (num_kv_groups - 1))
    positions = torch.cat(
        [torch.arange(s - q, s, device=device) for q, s in zip(query_lens, seq_lens, strict=True)]
    )
    return positions, meta
