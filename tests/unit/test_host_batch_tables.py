"""build_host_batch's block tables and slot mappings against a per-request reference: tables that
hold more blocks than the step's sequence covers (lookahead slots), decodes waiting on an in-flight
token, a prefill chunk, two KV cache groups, a fixed table width (CUDA graphs) and the natural one,
read from the states' lists or from the runner's kept numpy rows (BlockTables: rows reused after a
request left, tables grown by later diffs)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenmill.core.outputs import NewRequestData
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.batch_inputs import build_host_batch
from tokenmill.worker.request_state import BlockTables, RequestState

BLOCK = 4


def _reference(states, starts, lens, width):  # noqa: ANN001, ANN202 - the obvious per-request loops
    groups = len(states[0].block_ids)
    tables, slots = [], []
    for group in range(groups):
        table = np.zeros((len(states), width), np.int32)
        slot = []
        for i, (state, start, n) in enumerate(zip(states, starts, lens, strict=True)):
            covered = -(-(start + n) // BLOCK)
            table[i, :covered] = state.block_ids[group][:covered]
            slot += [state.block_ids[group][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        tables.append(table)
        slots.append(slot)
    return tables, slots


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("fixed_width", [None, 40])
def test_block_tables_and_slots_match_the_per_request_reference(fixed_width: int | None, kept: bool) -> None:
    rng = random.Random(7)
    tables = BlockTables() if kept else None
    if tables is not None:  # rows that earlier requests held and left full of other ids
        for i in range(20):
            gone = RequestState(
                NewRequestData(
                    f"gone{i}", [1], SamplingParams(), (), [[900] * (30 if i else 100), [901] * 30], 0
                )
            )
            tables.add(gone)
            if i % 2:
                tables.remove(gone)
    states, starts, lens = [], [], []
    next_block = 1
    for i in range(12):
        num_tokens = rng.randint(1, 60)
        decode = i % 3 != 0
        start = num_tokens if decode else rng.randint(0, num_tokens - 1)  # decode: its token is in flight
        n = 1 if decode else num_tokens - start
        extra = rng.randint(0, 2)  # lookahead blocks past the step's sequence
        count = -(-(start + n) // BLOCK) + extra
        block_ids = [
            list(range(next_block, next_block + count)),
            list(range(500 + next_block, 500 + next_block + count)),
        ]
        next_block += count
        state = RequestState(
            NewRequestData(f"r{i}", list(range(num_tokens)), SamplingParams(), (), block_ids, 0)
        )
        if decode:
            state.num_tokens += 1
        if tables is not None:  # half the table first, the rest as a later step's diff
            full = [list(t) for t in block_ids]
            for table in state.block_ids:
                del table[len(table) // 2 :]
            tables.add(state)
            for group, table in enumerate(state.block_ids):
                tables.write(state, group, len(table), full[group][len(table) :])
                table.extend(full[group][len(table) :])
        states.append(state)
        starts.append(start)
        lens.append(n)
    batch = build_host_batch(states, starts, lens, BLOCK, block_table_width=fixed_width, tables=tables)
    width = fixed_width or max(-(-(s + n) // BLOCK) for s, n in zip(starts, lens, strict=True))
    tables, slots = _reference(states, starts, lens, width)
    assert batch.block_tables.tolist() == tables[0].tolist()
    assert [t.tolist() for t in batch.extra_block_tables] == [tables[1].tolist()]
    assert batch.slot_mapping.tolist() == slots[0]
    assert [s.tolist() for s in batch.extra_slot_mappings] == [slots[1]]
    assert batch.query_start_loc.tolist() == [0, *np.cumsum(lens).tolist()]
    decodes = [i for i in range(12) if i % 3 != 0]
    assert batch.placeholder_req_ids == [f"r{i}" for i in decodes]
    assert batch.sample_rows.tolist() == [int(np.sum(lens[: i + 1])) - 1 for i in range(12)]
    assert batch.input_ids.tolist() == [
        0 if i % 3 else token for i in range(12) for token in range(starts[i], starts[i] + lens[i])
    ]
