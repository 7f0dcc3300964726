"""Turning a scheduler step into one flattened batch: token ids, positions, slots, block tables
(slots and block tables once per KV cache group)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np

from tokenmill.worker.request_state import BlockTables, RequestState


@dataclass(slots=True)
class HostBatch:
    """Host-side (numpy) inputs of one step, before they are copied to the device."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, KV cache group 0
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, W] int32, KV cache group 0
    # Models with several KV cache groups (sliding-window layers): groups 1.. in order.
    extra_slot_mappings: list[np.ndarray]
    extra_block_tables: list[np.ndarray]
    # Rows of the flattened batch whose logits are needed: the last row of every request that
    # samples, then the prompt-logprob rows.
    sample_rows: np.ndarray  # [S] int64, one per sampling request, in scheduled order
    sampling_req_indices: list[int]  # index into the step's requests (batch order) for each sample row
    # Async scheduling: rows whose input token the previous step sampled and the host has not
    # seen yet (input_ids holds 0 there); the runner copies those ids in on the device.
    placeholder_rows: list[int]
    placeholder_req_ids: list[str]
    max_query_len: int
    max_seq_len: int
    # A step that verifies draft tokens: the draft tokens per sampling request (batch order; [] for
    # one without). Each such request has len(drafts) + 1 sample rows (its last known token's, then
    # one per draft), and `sample_rows` / `sampling_req_indices` hold all of them. None: one row each.
    sampling_drafts: list[list[int]] | None = None


def build_host_batch(
    requests: list[RequestState],
    num_computed_tokens: list[int],
    num_scheduled_tokens: list[int],
    block_size: int,
    block_table_width: int | None = None,
    drafts: list[list[int]] | None = None,
    tables: BlockTables | None = None,
) -> HostBatch:
    """The step's inputs: per request (batch order) its state, the tokens computed before the
    step and the tokens it computes now (`drafts`: per request, the draft tokens it verifies after
    its last known token; they are counted in its scheduled tokens). `tables`: the requests'
    block ids kept as numpy rows (the runner's `RequestStates`); without it they are read from
    each request's `block_ids` lists."""
    num_reqs = len(requests)
    starts = np.asarray(num_computed_tokens, dtype=np.int64)
    query_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)
    seq_lens = starts + query_lens
    # Each request's end row as Python ints: the loop below reads one per request, and numpy
    # scalar reads cost more than the rest of a decode's work there.
    ends = list(accumulate(num_scheduled_tokens))
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = ends
    num_tokens = ends[-1] if ends else 0

    input_ids: list[int] = []
    sample_rows: list[int] = []
    sampling_req_indices: list[int] = []
    placeholder_rows: list[int] = []
    placeholder_req_ids: list[str] = []
    sampling_drafts: list[list[int]] = []
    rows = zip(requests, num_computed_tokens, num_scheduled_tokens, ends, strict=True)
    for i, (r, start, num_new, end_row) in enumerate(rows):
        token_ids = r.token_ids
        request_drafts = drafts[i] if drafts is not None else None
        if request_drafts:
            num_known = num_new - len(request_drafts)
            if start + num_known != len(token_ids):
                raise RuntimeError(
                    f"{r!r}: {len(request_drafts)} drafts must follow its last known token, but the step "
                    f"computes tokens {start}..{start + num_new} of {len(token_ids)} known"
                )
            input_ids.extend(token_ids[start:])
            input_ids.extend(request_drafts)
            last_row = end_row - 1
            sample_rows.extend(range(last_row - len(request_drafts), last_row + 1))
            sampling_req_indices.extend([i] * (len(request_drafts) + 1))
            sampling_drafts.append(request_drafts)
            continue
        if num_new == 1:
            if start < len(token_ids):
                input_ids.append(token_ids[start])
            else:  # the token the previous step sampled for it, still on the device
                placeholder_rows.append(len(input_ids))
                placeholder_req_ids.append(r.request_id)
                input_ids.append(0)
        else:
            end = start + num_new
            if end > len(token_ids):  # only a 1-token decode can wait on an in-flight token
                raise RuntimeError(f"{r!r}: a {num_new}-token chunk reaches past its known tokens")
            input_ids.extend(token_ids[start:end])
        # The chunk reaches the request's last token (known, or still in flight): it samples.
        if start + num_new >= r.num_tokens:
            sample_rows.append(end_row - 1)
            sampling_req_indices.append(i)
            if drafts is not None:
                sampling_drafts.append([])

    # positions[t] = start of t's request + offset of t within the request's chunk
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = (
        np.arange(num_tokens, dtype=np.int64) - query_start_loc[:-1][req_of_token] + starts[req_of_token]
    )

    max_seq_len = int(seq_lens.max()) if num_reqs else 0
    needed_width = -(-max_seq_len // block_size)
    width = max(needed_width, 1) if block_table_width is None else block_table_width
    num_groups = len(requests[0].block_ids) if requests else 1
    # Blocks each request's sequence covers; its table may hold more (lookahead slots).
    num_blocks = [
        -(-(start + n) // block_size)
        for start, n in zip(num_computed_tokens, num_scheduled_tokens, strict=True)
    ]
    # The tables' cells that the step's sequences cover (a table may hold more: lookahead slots).
    cells = np.arange(width) < np.asarray(num_blocks, dtype=np.int64)[:, None]
    if tables is not None:
        if any(len(r.block_ids[0]) < n for r, n in zip(requests, num_blocks, strict=True)):
            raise RuntimeError("a request's block table is shorter than its scheduled tokens need")
        rows = np.fromiter((r.row for r in requests), dtype=np.int64, count=num_reqs)
    else:
        total_blocks = sum(num_blocks)
    block_tables_per_group = []
    slot_mappings = []
    block_of_token = positions // block_size
    offset_in_block = positions % block_size
    for group in range(num_groups):
        if tables is not None:
            # One gather from the kept rows; past what a sequence covers, zeros as below.
            kept = tables.group(group)
            block_tables = np.zeros((num_reqs, width), dtype=np.int32)
            span = min(width, kept.shape[1])
            np.copyto(block_tables[:, :span], kept[rows, :span], where=cells[:, :span])
        else:
            # Row-major order: one vectorised write per group, not one per request.
            block_tables = np.zeros((num_reqs, width), dtype=np.int32)
            block_tables[cells] = np.fromiter(
                chain.from_iterable(
                    table if len(table) == n else table[:n]
                    for table, n in zip((r.block_ids[group] for r in requests), num_blocks, strict=True)
                ),
                dtype=np.int32,
                count=total_blocks,
            )
        block_idx = block_tables[req_of_token, block_of_token].astype(np.int64)
        block_tables_per_group.append(block_tables)
        slot_mappings.append(block_idx * block_size + offset_in_block)

    return HostBatch(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mappings[0],
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables_per_group[0],
        extra_slot_mappings=slot_mappings[1:],
        extra_block_tables=block_tables_per_group[1:],
        sample_rows=np.asarray(sample_rows, dtype=np.int64),
        sampling_req_indices=sampling_req_indices,
        placeholder_rows=placeholder_rows,
        placeholder_req_ids=placeholder_req_ids,
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=max_seq_len,
        sampling_drafts=sampling_drafts if drafts is not None else None,
    )


def pad_to_uniform_query(batch: HostBatch, q: int) -> HostBatch:
    """The batch with every request's rows padded to `q` (a CUDA graph of q tokens per request
    replays it): request i's real rows first, then padding rows (token 0 at position 0, slot -1:
    their K/V are written nowhere). Each request's context grows by its padding rows, which only
    the padding rows themselves attend to (attention is causal within the step), so the real rows
    compute exactly what they would unpadded. One KV cache group only."""
    if batch.extra_slot_mappings:
        raise ValueError("padding to a uniform query length serves one KV cache group")
    num_reqs = len(batch.seq_lens)
    starts = batch.query_start_loc[:-1].astype(np.int64)
    lens = np.diff(batch.query_start_loc).astype(np.int64)
    if (lens > q).any():
        raise ValueError(f"a request computes {int(lens.max())} tokens, more than the padded {q}")
    # Destination row of each real row: its request's block of q rows, in order.
    req_of_row = np.repeat(np.arange(num_reqs), lens)
    dst = req_of_row * q + (np.arange(len(batch.input_ids)) - starts[req_of_row])
    total = num_reqs * q
    input_ids = np.zeros(total, np.int64)
    positions = np.zeros(total, np.int64)
    slot_mapping = np.full(total, -1, np.int64)
    input_ids[dst] = batch.input_ids
    positions[dst] = batch.positions
    slot_mapping[dst] = batch.slot_mapping
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=(np.arange(num_reqs + 1) * q).astype(np.int32),
        seq_lens=(batch.seq_lens + (q - lens)).astype(np.int32),
        block_tables=batch.block_tables,
        extra_slot_mappings=[],
        extra_block_tables=[],
        sample_rows=dst[batch.sample_rows],
        sampling_req_indices=batch.sampling_req_indices,
        placeholder_rows=[int(dst[r]) for r in batch.placeholder_rows],
        placeholder_req_ids=batch.placeholder_req_ids,
        max_query_len=q,
        max_seq_len=int(batch.seq_lens.max() + q) if num_reqs else 0,
        sampling_drafts=batch.sampling_drafts,
    )
