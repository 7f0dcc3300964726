"""The torch-free parts of speculative decoding: the config, the ngram proposer, the draft policy."""

from __future__ import annotations

import pytest

from tokenmill.spec_decode.config import parse_speculative_config
from tokenmill.spec_decode.draft_policy import DraftPolicy
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.stats import SpecDecodingStats


def test_config_takes_vllm_keys():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 4, 5)
    assert parse_speculative_config({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "promt_lookup_max": 2}, "promt_lookup_max"),
        ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("{not json", "JSON"),
    ],
)
def test_config_errors_name_the_key(value, named):
    with pytest.raises(ValueError, match=named):
        parse_speculative_config(value)


def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert proposer.propose([1, 2, 3, 9, 2, 3], 4) == [9, 2, 3]
    assert proposer.propose([5, 6, 7], 2) == []  # nothing repeats
    # A repeating run: the earliest match is followed by the most tokens.
    assert proposer.propose([8, 7, 7, 7, 7, 7], 3) == [7, 7]
    # The longest n-gram wins: [2, 3] is followed by 4 once and 9 later; [1, 2, 3] only by 4.
    assert proposer.propose([1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3], 1) == [4]


def test_policy_gates_large_batches_and_cools_down_poor_acceptance():
    policy = DraftPolicy(4, disable_by_batch_size=8, min_acceptance_rate=0.3)
    assert policy.drafting_allowed(8) and not policy.drafting_allowed(9)
    assert policy.num_drafts("r") == 4
    policy.record("r", 4, 0)
    assert policy.num_drafts("r") == 4  # one bad step is not enough
    policy.record("r", 4, 0)
    assert [policy.num_drafts("r") for _ in range(5)] == [0, 0, 0, 0, 4]  # 4 steps off, then a probe
    policy.record("r", 4, 0)  # the probe fails too: twice as long off
    assert [policy.num_drafts("r") for _ in range(9)] == [0] * 8 + [4]
    policy.record("good", 4, 4)
    assert policy.num_drafts("good") == 4
    policy.forget("r")
    assert policy.num_drafts("r") == 4


def test_stats_count_per_position():
    stats = SpecDecodingStats(3)
    stats.observe(3, 2)
    stats.observe(3, 0)
    stats.observe(0, 0)  # no drafts: not a draft
    assert stats.as_stats()["spec_decode_num_drafts"] == 2
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.mean_acceptance_length == 2.0
    assert stats.acceptance_rate == pytest.approx(2 / 6)
