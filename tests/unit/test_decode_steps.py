"""bench/decode_steps.py: hand-built uniform decode steps (the verification shapes' benchmark input)."""

from __future__ import annotations

import pytest

from tokenmill.bench.decode_steps import blocks_needed, uniform_decode_step


def test_each_request_computes_q_known_tokens_past_its_prompt_in_its_own_blocks() -> None:
    first, again = uniform_decode_step(3, 4, 30, 16, 1000, prompt_len=8, first_block=5)
    assert first.total_num_scheduled_tokens == again.total_num_scheduled_tokens == 12
    assert list(first.num_scheduled_tokens.values()) == [4, 4, 4]
    assert first.batch_num_computed_tokens() == again.batch_num_computed_tokens() == [30, 30, 30]
    assert list(again.num_scheduled_tokens) == [new.request_id for new in first.scheduled_new_reqs]
    blocks = [b for new in first.scheduled_new_reqs for b in new.block_ids[0]]
    assert blocks == list(range(5, 5 + blocks_needed(3, 4, 30, 16)))  # 3 x cdiv(34, 16), no overlap
    for new in first.scheduled_new_reqs:
        assert len(new.prompt_token_ids) == 8 and len(new.prompt_token_ids) + len(new.output_token_ids) == 34
        assert all(0 <= t < 1000 for t in new.prompt_token_ids + new.output_token_ids)
    assert not first.scheduled_spec_decode_tokens  # known tokens, no drafts


def test_refuses_steps_that_are_not_decodes() -> None:
    with pytest.raises(ValueError, match="context_len \\(4\\) must be at least prompt_len \\(16\\)"):
        uniform_decode_step(1, 2, 4, 16, 100)
    with pytest.raises(ValueError, match="must be >= 1"):
        uniform_decode_step(1, 0, 40, 16, 100)
