"""KV cache manager: block tables, prefix hits (capped, token-checked), caching at allocation, leaks."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens: list[int], **params: object) -> Request:
    return Request(request_id, tokens, SamplingParams(**params))  # type: ignore[arg-type]


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[list[int]] | None:
    """What the scheduler does for a waiting request; advances num_computed_tokens like a step."""
    hit_ids, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new is None else num_new
    new_ids = kv.allocate_slots(request, num_new, hit_ids)
    if new_ids is not None:
        request.num_computed_tokens = num_hit + num_new
    return new_ids


def test_allocate_grows_the_live_block_table() -> None:
    kv = KVCacheManager(8, BLOCK)
    request = make_request("a", list(range(6)))
    assert admit(kv, request) == [[0, 1]]  # one list per KV cache group: one group here
    [table] = kv.get_block_ids("a")
    assert table == [0, 1]
    request.append_output_token_ids([6, 7])
    assert kv.allocate_slots(request, 1) == []  # position 6 still fits block 1
    request.num_computed_tokens += 1
    assert kv.allocate_slots(request, 2) == [[2]]
    assert kv.get_block_ids("a")[0] is table and table == [0, 1, 2]
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(request)
    assert kv.usage == 0 and kv.num_free_blocks == 8 and not kv.has_blocks("a")
    kv.check_invariants()


def test_allocate_fails_without_changing_anything() -> None:
    kv = KVCacheManager(3, BLOCK)
    big = make_request("big", list(range(9)))
    assert admit(kv, big, num_new=8) == [[0, 1]]
    other = make_request("other", list(range(100, 109)))
    assert kv.allocate_slots(other, 9) is None
    assert kv.num_free_blocks == 1 and not kv.has_blocks("other")
    kv.check_invariants()


def test_prefix_hit_after_free_and_never_the_whole_prompt() -> None:
    kv = KVCacheManager(16, BLOCK)
    first = make_request("a", list(range(10)))
    admit(kv, first)
    kv.free(first)
    second = make_request("b", list(range(10)) + [99])
    hit_ids, num_hit = kv.get_computed_blocks(second)
    assert (hit_ids, num_hit) == ([[0, 1]], 8)  # the two full blocks of the shared prefix
    exact = make_request("c", list(range(8)))  # prompt is exactly the two cached blocks
    assert kv.get_computed_blocks(exact) == ([[0]], 4)  # the last token must be recomputed for logits
    assert admit(kv, second) == [[2]]
    assert kv.get_block_ids("b") == [[0, 1, 2]]
    assert kv.pool.blocks[0].ref_count == 1
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    kv.check_invariants()


def test_blocks_are_cached_when_allocated_so_the_same_step_can_hit() -> None:
    kv = KVCacheManager(16, BLOCK)
    prompt = list(range(13))
    parent = make_request("n0", prompt)
    admit(kv, parent)
    sibling = make_request("n1", prompt)
    assert kv.get_computed_blocks(sibling) == ([[0, 1, 2]], 12)
    admit(kv, sibling)
    assert kv.get_block_ids("n1")[0][:3] == [0, 1, 2]
    assert [kv.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 2, 1]
    kv.free(parent)
    kv.free(sibling)
    kv.check_invariants()


def test_partial_chunk_caches_only_computed_full_blocks() -> None:
    kv = KVCacheManager(16, BLOCK)
    request = make_request("a", list(range(12)))
    admit(kv, request, num_new=6)  # blocks 0 (full) and 1 (half computed)
    assert kv.pool.blocks[0].block_hash is not None and kv.pool.blocks[1].block_hash is None
    probe = make_request("p", list(range(12)))
    assert kv.get_computed_blocks(probe)[1] == 4


def test_hit_compares_token_ids() -> None:
    kv = KVCacheManager(8, BLOCK)
    admit(kv, make_request("a", list(range(9))))
    kv.pool.blocks[0].token_ids = (0, 1, 2, 77)  # as if another sequence had collided on the hash
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_salt_prevents_sharing() -> None:
    kv = KVCacheManager(8, BLOCK)
    admit(kv, Request("a", list(range(9)), SamplingParams(), cache_salt="alice"))
    assert kv.get_computed_blocks(Request("b", list(range(9)), SamplingParams(), cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(Request("c", list(range(9)), SamplingParams(), cache_salt="alice"))[1] == 8


def test_eviction_drops_hits_and_uncache_on_free() -> None:
    kv = KVCacheManager(4, BLOCK)
    first = make_request("a", list(range(9)))
    admit(kv, first)
    kv.free(first)
    filler = make_request("f", list(range(50, 62)))
    admit(kv, filler)  # needs 3 of the 4 blocks: evicts the least recently freed first
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 4  # block 0 survived
    kv.free(filler)
    errored = make_request("e", list(range(200, 209)))
    admit(kv, errored)
    kv.free(errored, uncache=True)
    assert kv.get_computed_blocks(make_request("e2", list(range(200, 209))))[1] == 0
    kv.check_invariants()


def test_prompt_logprobs_requests_skip_the_lookup_but_still_fill_the_cache() -> None:
    kv = KVCacheManager(8, BLOCK)
    admit(kv, make_request("a", list(range(9))))
    wants_logprobs = make_request("b", list(range(9)), prompt_logprobs=1)
    assert kv.get_computed_blocks(wants_logprobs) == ([], 0)
    queries = kv.prefix_cache_queries
    admit(kv, wants_logprobs)
    assert kv.prefix_cache_queries == queries  # not a prefix-cache query
    kv.check_invariants()


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    admit(kv, first)
    assert not kv.pool.cached_blocks and first.block_hashes == []
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_check_invariants_catches_leaks_and_bad_ref_counts() -> None:
    kv = KVCacheManager(4, BLOCK)
    request = make_request("a", list(range(5)))
    admit(kv, request)
    kv.check_invariants()
    kv._block_ids.pop("a")  # the request forgot its blocks without freeing them
    with pytest.raises(AssertionError, match="ref_count 1 but 0 requests hold it"):
        kv.check_invariants()

    kv = KVCacheManager(4, BLOCK)
    admit(kv, make_request("a", list(range(5))))
    kv.pool.cached_blocks[b"x" * 32] = kv.pool.blocks[3]
    with pytest.raises(AssertionError, match="prefix cache maps a hash"):
        kv.check_invariants()


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    kv = KVCacheManager(6, BLOCK)
    request = make_request("a", list(range(7)))
    assert admit(kv, request) == [[0, 1]]  # positions 0..6
    request.append_output_token_ids([7])  # 8 tokens: two full blocks once position 7 is computed
    # Position 7 plus 5 draft slots (8..12): blocks up to position 12, four in all.
    assert kv.allocate_slots(request, 1, num_lookahead_tokens=5) == [[2, 3]]
    assert kv.get_block_ids("a") == [[0, 1, 2, 3]]
    # Only blocks full of the request's own tokens enter the prefix cache, never draft slots.
    assert [b.block_id for b in kv.pool.blocks if b.block_hash is not None] == [0, 1]
    assert kv.allocate_slots(make_request("big", list(range(100, 109))), 9) is None  # 2 free blocks
    kv.check_invariants()
