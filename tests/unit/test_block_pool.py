"""Block pool: LRU free list, eviction, ref counts, and the chained block hashes."""

from __future__ import annotations

import pytest

from tokenmill.core.block_hash import extend_block_hashes, hash_block_tokens
from tokenmill.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def free_order(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def cache_all(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    for block in blocks:
        assert pool.cache(block, bytes([block.block_id]) * 32, (block.block_id,))


# -- free list -------------------------------------------------------------------------------


def test_free_queue_pop_remove_append_are_ordered() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 1, 3, 4, 0]
    assert queue.num_free == 5
    with pytest.raises(ValueError, match="already in the free list"):
        queue.append(blocks[3])
    for _ in range(5):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free list"):
        queue.remove(blocks[1])


def test_a_dropped_pool_unlinks_its_free_list() -> None:
    # The free list's links are a reference cycle: a dropped pool unlinks them itself, so its blocks
    # die by reference counting (no garbage collection), as an engine's pool must.
    pool = BlockPool(64)
    in_use = pool.allocate(10)
    blocks = list(pool.blocks)
    assert sum(b.next_free is not None for b in blocks) == 54
    del pool
    assert all(b.prev_free is None and b.next_free is None for b in blocks)
    assert all(b.ref_count == 1 for b in in_use)  # the blocks themselves are untouched


def test_allocate_takes_from_head_and_refuses_too_many() -> None:
    pool = BlockPool(4)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_lru_eviction_order_tail_of_a_sequence_first() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2), pool.allocate(2)
    cache_all(pool, first + second)
    pool.free(reversed(first))  # a finished request frees tail first
    pool.free(reversed(second))
    assert free_order(pool) == [1, 0, 3, 2]
    # Eviction takes the least recently freed block, the tail of the first sequence.
    [evicted] = pool.allocate(1)
    assert evicted.block_id == 1 and evicted.block_hash is None and evicted.token_ids is None
    assert pool.lookup(bytes([1]) * 32, [1]) is None
    assert pool.lookup(bytes([0]) * 32, [0]) is pool.blocks[0]


def test_uncached_free_blocks_are_handed_out_before_cached_ones() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    cache_all(pool, blocks[:1])
    pool.free([blocks[0]])  # cached: goes to the tail
    pool.free([blocks[1]])  # holds nothing: goes to the head
    assert free_order(pool) == [1, 3, 0]
    assert [b.block_id for b in pool.allocate(2)] == [1, 3]
    assert pool.lookup(bytes([0]) * 32, [0]) is pool.blocks[0]  # survived


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    cache_all(pool, [block])
    pool.free([block])
    assert pool.num_free_blocks == 3
    hit = pool.lookup(bytes([0]) * 32, [0])
    assert hit is block
    pool.touch([hit, hit])  # two requests share it
    assert block.ref_count == 2 and pool.num_free_blocks == 2 and 0 not in free_order(pool)
    pool.free([block])
    assert pool.num_free_blocks == 2
    pool.free([block])
    assert free_order(pool)[-1] == 0  # most recently used: evicted last
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block])


def test_lookup_compares_token_ids_and_first_cached_block_wins() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    digest = b"h" * 32
    assert pool.cache(a, digest, (1, 2))
    assert pool.lookup(digest, [1, 2]) is a
    assert pool.lookup(digest, [1, 3]) is None  # same hash, other tokens: a collision is a miss
    assert not pool.cache(b, digest, (1, 2))  # duplicate content stays uncached
    assert b.block_hash is None
    pool.uncache(a)
    assert pool.lookup(digest, [1, 2]) is None and a.block_hash is None


def test_reset_prefix_cache_forgets_everything() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    cache_all(pool, blocks)
    pool.free(blocks)
    pool.reset_prefix_cache()
    assert not pool.cached_blocks and all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 2


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)


# -- hashes ----------------------------------------------------------------------------------


def make_request(tokens: list[int], salt: str | None = None) -> Request:
    return Request("r", tokens, SamplingParams(), cache_salt=salt)


def test_block_hash_is_sha256_chained_and_deterministic() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3])
    assert len(h0) == 32 and h0 == hash_block_tokens(None, [1, 2, 3])
    assert h0 != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(h0, [5, 6, 7]) != hash_block_tokens(None, [5, 6, 7])
    assert hash_block_tokens(h0, [5, 6, 7]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9, 9]), [5, 6, 7]
    )
    assert hash_block_tokens(None, [1], "") != hash_block_tokens(None, [1])
    assert hash_block_tokens(None, [1], "a") != hash_block_tokens(None, [1], "b")


def test_extend_block_hashes_only_full_blocks_and_incremental() -> None:
    request = make_request(list(range(10)))
    hashes = extend_block_hashes(request, 4)
    assert hashes is request.block_hashes and len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    first = list(hashes)
    request.append_output_token_ids([10, 11])
    extend_block_hashes(request, 4)
    assert request.block_hashes[:2] == first and len(request.block_hashes) == 3
    fresh = make_request(list(range(12)))
    assert extend_block_hashes(fresh, 4) == request.block_hashes


def test_salt_separates_every_block_through_the_chain() -> None:
    tokens = list(range(12))
    plain = extend_block_hashes(make_request(tokens), 4)
    salted = extend_block_hashes(make_request(tokens, salt="user-a"), 4)
    other = extend_block_hashes(make_request(tokens, salt="user-b"), 4)
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert all(s != o for s, o in zip(salted, other, strict=True))
    assert extend_block_hashes(make_request(tokens, salt="user-a"), 4) == salted
