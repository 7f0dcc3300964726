"""Padding a verification step's requests to one query length (for a CUDA graph of q rows each)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.core.outputs import NewRequestData
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.batch_inputs import build_host_batch, pad_to_uniform_query
from tokenmill.worker.request_state import RequestState


def _state(request_id: str, tokens: list[int], blocks: list[int]) -> RequestState:
    return RequestState(NewRequestData(request_id, tokens, SamplingParams(), (), [blocks], 0))


def test_real_rows_keep_their_tokens_positions_and_slots_and_pads_write_nowhere():
    a = _state("a", list(range(10, 20)), [3, 4, 5])  # 10 tokens, block size 4
    b = _state("b", list(range(30, 36)), [7, 8, 9])  # 6 tokens
    drafts = [[91], [92, 93, 94]]
    # a verifies 1 draft after its last token (2 rows), b 3 drafts (4 rows); both at decode positions.
    batch = build_host_batch([a, b], [9, 5], [2, 4], 4, block_table_width=4, drafts=drafts)
    padded = pad_to_uniform_query(batch, 4)
    assert padded.query_start_loc.tolist() == [0, 4, 8]
    assert padded.input_ids.tolist() == [19, 91, 0, 0, 35, 92, 93, 94]
    assert padded.positions.tolist() == [9, 10, 0, 0, 5, 6, 7, 8]
    assert padded.slot_mapping[[2, 3]].tolist() == [-1, -1]
    np.testing.assert_array_equal(padded.slot_mapping[[0, 1, 4, 5, 6, 7]], batch.slot_mapping)
    # Contexts grow by the padding rows only: the real rows' causal windows are unchanged.
    assert padded.seq_lens.tolist() == [13, 9]
    assert padded.sample_rows.tolist() == [0, 1, 4, 5, 6, 7]
    assert padded.sampling_drafts == drafts


def test_a_request_longer_than_q_is_refused():
    a = _state("a", list(range(8)), [1, 2, 3])
    batch = build_host_batch([a], [7], [3], 4, drafts=[[5, 6]])
    with pytest.raises(ValueError, match="more than the padded 2"):
        pad_to_uniform_query(batch, 2)
