"""KV cache manager with several KV cache groups: one pool, per-group tables, sliding groups free
what slid out of the window, prefix hits every group agrees on, nothing leaks."""

from __future__ import annotations

import pytest

from tokenmill.core.block_hash import group_block_hash
from tokenmill.core.block_pool import NULL_BLOCK_ID
from tokenmill.core.kv_cache_groups import max_live_sliding_blocks, plan_kv_cache_groups
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.prefix_cache_hits import first_block_in_window
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
WINDOW = 8
NULL = NULL_BLOCK_ID


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def manager(num_blocks: int, windows: tuple[int | None, ...], **kwargs: object) -> KVCacheManager:
    """One layer per window: one group per layer (G = 1)."""
    return KVCacheManager(num_blocks, BLOCK, groups=plan_kv_cache_groups(len(windows), windows), **kwargs)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[list[int]] | None:
    hit_ids, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new is None else num_new
    new_ids = kv.allocate_slots(request, num_new, hit_ids)
    if new_ids is not None:
        request.num_computed_tokens = num_hit + num_new
    return new_ids


def decode(kv: KVCacheManager, request: Request, num_steps: int, token: int = 7) -> None:
    """Append a token and compute it, `num_steps` times, as decode steps do."""
    for _ in range(num_steps):
        request.append_output_token_ids([token])
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


def check_sliding_table(kv: KVCacheManager, request_id: str, group: int, window: int, computed: int) -> None:
    """Entries wholly before the window of the query at `computed` are null; the rest are live."""
    table = kv.get_block_ids(request_id)[group]
    first = first_block_in_window(computed, window, BLOCK)
    assert table[:first] == [NULL] * first
    assert NULL not in table[first:]


def test_one_pool_per_group_tables_and_a_reserved_null_block() -> None:
    kv = manager(16, (None, WINDOW))
    assert kv.num_usable_blocks == 15 and kv.num_free_blocks == 15
    request = make_request("a", list(range(10)))
    full, sliding = admit(kv, request)
    assert len(full) == len(sliding) == 3 and not set(full) & set(sliding)
    assert NULL not in full + sliding  # the null block is never handed out
    assert kv.get_block_ids("a") == [full, sliding]
    assert kv.usage == pytest.approx(6 / 15)
    kv.check_invariants()
    kv.free(request)
    assert kv.num_free_blocks == 15 and kv.usage == 0
    kv.check_invariants()


def test_admission_counts_blocks_over_all_groups() -> None:
    kv = manager(6, (None, WINDOW))  # 5 usable blocks
    other = make_request("other", list(range(50, 54)))
    assert admit(kv, other) is not None  # 1 block per group: 3 left
    request = make_request("a", list(range(8)))  # 2 blocks per group: 4
    assert kv.allocate_slots(request, 8) is None
    assert not kv.has_blocks("a") and kv.num_free_blocks == 3
    kv.check_invariants()


@pytest.mark.parametrize("windows", [(WINDOW,), (None, WINDOW), (WINDOW, None, 2 * WINDOW)])
def test_sliding_groups_free_what_slid_out_and_stay_bounded(windows: tuple[int | None, ...]) -> None:
    kv = manager(64, windows)
    request = make_request("a", list(range(13)))
    admit(kv, request)
    free_after_prefill = kv.num_free_blocks
    for _ in range(200):
        decode(kv, request, 1)
        live = kv.num_live_blocks("a")
        computed = request.num_computed_tokens
        for group, window in enumerate(kv.windows):  # groups: full ones first, then windows ascending
            table_len = len(kv.get_block_ids("a")[group])
            assert table_len == -(-computed // BLOCK)  # every table covers the whole sequence
            if window is None:
                assert live[group] == table_len
            else:
                # Exactly what the step's query (at computed - 1) needed, within the documented bound.
                assert live[group] == table_len - first_block_in_window(computed - 1, window, BLOCK)
                assert live[group] <= max_live_sliding_blocks(window, BLOCK, 1)
                check_sliding_table(kv, "a", group, window, computed - 1)
        kv.check_invariants()
    assert request.num_computed_tokens == 213
    num_full = sum(1 for w in windows if w is None)
    # Memory follows the window: only the full groups grew with the sequence.
    assert free_after_prefill - kv.num_free_blocks <= num_full * 51 + len(windows)
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_invariants()


def test_slid_out_blocks_stay_cached_until_evicted() -> None:
    kv = manager(32, (WINDOW,))
    request = make_request("a", list(range(40)))
    admit(kv, request)  # 10 blocks, all live during the prefill chunk
    [table] = kv.get_block_ids("a")
    first_ten = list(table)
    decode(kv, request, 1)  # the next allocation frees blocks 0..7 (wholly before position 40 - 7)
    assert table[:8] == [NULL] * 8 and table[8:10] == first_ten[8:10]
    for block_id in first_ten[:8]:
        block = kv.pool.blocks[block_id]
        assert block.ref_count == 0 and block.block_hash is not None  # free, still a prefix-cache entry
    kv.check_invariants()


def test_prefix_hit_of_a_sliding_group_whose_early_blocks_are_gone() -> None:
    kv = manager(14, (WINDOW,))  # 13 usable blocks
    prompt = list(range(40))
    first = make_request("a", prompt)
    admit(kv, first)
    decode(kv, first, 1)
    kv.free(first)
    # A filler takes 8 blocks: the free list hands out uncached blocks first, then the least recently
    # freed cached ones: the earliest blocks of the prompt, which slid out first.
    filler = make_request("f", list(range(500, 532)))
    admit(kv, filler)
    assert kv.pool.lookup(group_block_hash(first.block_hashes[0], 0), prompt[:BLOCK]) is None
    second = make_request("b", [*prompt, 99])
    hit_ids, num_hit = kv.get_computed_blocks(second)
    # 40 tokens hit: the query at position 40 needs only keys 33..39 (blocks 8 and 9).
    assert num_hit == 40
    [table] = hit_ids
    assert table[:8] == [NULL] * 8 and NULL not in table[8:] and len(table) == 10
    [[new_id]] = admit(kv, second)  # one block for the one token past the hit
    assert kv.get_block_ids("b") == [[*table, new_id]]
    assert all(kv.pool.blocks[i].ref_count == 1 for i in table[8:])  # revived from the free list
    kv.check_invariants()


def test_common_hit_shrinks_to_what_the_sliding_group_holds() -> None:
    kv = manager(40, (None, WINDOW))
    prompt = list(range(40))
    first = make_request("a", prompt)
    admit(kv, first)
    full_ids, sliding_ids = (list(t) for t in kv.get_block_ids("a"))
    kv.free(first)
    kv.pool.uncache(kv.pool.blocks[sliding_ids[8]])  # as if evicted: the sliding group lacks block 8
    hit_ids, num_hit = kv.get_computed_blocks(make_request("b", [*prompt, 99]))
    # Full holds 10 blocks (a hit of 9: the last token is recomputed). At 9 the sliding group needs
    # blocks 7, 8 (8 is gone); at 8 it needs blocks 6, 7: both there.
    assert num_hit == 8 * BLOCK
    assert hit_ids == [full_ids[:8], [NULL] * 6 + sliding_ids[6:8]]


def test_a_full_group_needs_every_block_of_the_hit() -> None:
    kv = manager(40, (None, WINDOW))
    prompt = list(range(40))
    first = make_request("a", prompt)
    admit(kv, first)
    full_ids, _ = (list(t) for t in kv.get_block_ids("a"))
    kv.free(first)
    kv.pool.uncache(kv.pool.blocks[full_ids[2]])
    hit_ids, num_hit = kv.get_computed_blocks(make_request("b", [*prompt, 99]))
    # The sliding group alone could serve 9 blocks; the full one only the first 2. At 2 blocks the
    # sliding group needs blocks 0 and 1 (first_block_in_window(8) = 0).
    assert num_hit == 2 * BLOCK and hit_ids[0] == full_ids[:2] and NULL not in hit_ids[1]


def test_shrinking_repeats_until_every_sliding_group_agrees() -> None:
    # Window 5 needs the last block before the hit point; window 9 the last two.
    kv = manager(60, (5, 9))
    prompt = list(range(44))
    first = make_request("a", prompt)
    admit(kv, first)
    short_ids, long_ids = (list(t) for t in kv.get_block_ids("a"))
    kv.free(first)
    kv.pool.uncache(kv.pool.blocks[long_ids[9]])  # window 9 cannot serve 10 blocks; it serves 9
    kv.pool.uncache(kv.pool.blocks[short_ids[8]])  # window 5 cannot serve 9; it serves 8
    hit_ids, num_hit = kv.get_computed_blocks(make_request("b", [*prompt, 99]))
    # One pass would stop at 9 (window 5 checked at 10 first: fine; then window 9 shrinks to 9);
    # window 5 must be asked again at 9 and shrinks to 8, where window 9 still agrees.
    assert num_hit == 8 * BLOCK
    assert hit_ids == [[NULL] * 7 + short_ids[7:8], [NULL] * 6 + long_ids[6:8]]


def test_each_group_caches_its_blocks_under_its_own_key() -> None:
    kv = manager(40, (None, WINDOW))
    request = make_request("a", list(range(17)))
    admit(kv, request)
    full_ids, sliding_ids = kv.get_block_ids("a")
    hashes = request.block_hashes
    for i in range(4):
        assert kv.pool.blocks[full_ids[i]].block_hash == hashes[i]
        assert kv.pool.blocks[sliding_ids[i]].block_hash == group_block_hash(hashes[i], 1) != hashes[i]
    kv.free(request)
    # With the full group's blocks evicted, the sliding group's cached blocks are no hit for it.
    for block_id in full_ids:
        kv.pool.uncache(kv.pool.blocks[block_id])
    assert kv.get_computed_blocks(make_request("b", list(range(17)))) == ([], 0)


def test_preemption_and_abort_free_every_group_and_leak_nothing() -> None:
    kv = manager(80, (None, WINDOW, None))
    requests = [make_request(f"r{i}", list(range(10 * i, 10 * i + 9 + i))) for i in range(3)]
    for request in requests:
        admit(kv, request)
        decode(kv, request, 15)
    kv.check_invariants()
    kv.free(requests[0])  # preemption frees like an abort
    errored_ids = [i for table in kv.get_block_ids("r1") for i in table if i != NULL]
    kv.free(requests[1], uncache=True)  # an errored request's live blocks leave the prefix cache
    assert all(kv.pool.blocks[i].block_hash is None for i in errored_ids)
    kv.check_invariants()
    kv.free(requests[2])
    kv.check_invariants()  # no request alive: every usable block is free or evictable
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.usage == 0
    assert kv.pool.null_block is not None and kv.pool.null_block.ref_count == 0


def test_check_invariants_catches_group_mixups() -> None:
    kv = manager(16, (None, WINDOW))
    admit(kv, make_request("a", list(range(9))))
    kv.check_invariants()
    tables = kv._block_ids["a"]
    tables[0][0] = NULL  # a full group never holds a null entry
    with pytest.raises(AssertionError, match="null entries in full group 0"):
        kv.check_invariants()

    kv = manager(16, (None, WINDOW))
    admit(kv, make_request("a", list(range(9))))
    tables = kv._block_ids["a"]
    tables[1][1], tables[1][2] = NULL, tables[1][1]  # a null entry after a live one
    with pytest.raises(AssertionError, match="not a prefix"):
        kv.check_invariants()
