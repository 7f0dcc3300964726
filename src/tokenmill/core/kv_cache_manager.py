"""Per-request block tables on top of the block pool, with prefix caching and KV cache groups.

The manager only speaks of tokens: a request's blocks cover its computed tokens plus those
scheduled this step. Full blocks are registered in the prefix cache when they are allocated for
tokens computed this step (not after the step): within one forward pass every layer writes all
K/V of the batch before attention reads it, so another request in the same step may already hit
them (this is how `n > 1` siblings share their prompt).

A request has one block table per KV cache group (core/kv_cache_groups.py), all taken from the
one pool and all of the same length (entry i covers tokens i * block_size ...). A model without
sliding-window layers has one group: one table, exactly as without groups. A sliding group frees
the blocks that slid out of its window as the request advances: before each allocation, the
blocks wholly before the window of the step's first query (`first_block_in_window` of the
tokens computed so far) go back to the pool, keeping their prefix-cache hash, and their entries
become the null block (block 0, reserved). So the blocks a request holds in a sliding group stay
bounded by its window (`max_live_sliding_blocks`), not by its length.

Freeing at schedule time is safe for a step still in flight (async scheduling): its K/V reads
come before any later step's writes on the device's stream, as for a preempted request. A
request's computed tokens only shrink when draft tokens are rejected, which happens before it is
scheduled again (a request with a step in flight is not given drafts), or on preemption, which
frees everything.
"""

from __future__ import annotations

from tokenmill.core.block_hash import extend_block_hashes, group_block_hash
from tokenmill.core.block_pool import NULL_BLOCK_ID, BlockPool
from tokenmill.core.kv_cache_groups import KVCacheGroups, plan_kv_cache_groups
from tokenmill.core.prefix_cache_hits import first_block_in_window, longest_common_hit
from tokenmill.core.request import Request

# Per KV cache group, a list of block ids (the step contract carries them as such).
GroupBlockIds = list[list[int]]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        groups: KVCacheGroups | None = None,
    ) -> None:
        """`groups` defaults to one full-attention group (a model without sliding layers)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups if groups is not None else plan_kv_cache_groups(1, ())
        self.num_groups = self.groups.num_groups
        self.windows = self.groups.sliding_windows()  # per group; None = full attention
        self._sliding = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        self.pool = BlockPool(num_blocks, reserve_null_block=bool(self._sliding))
        # The null block's id where table entries may be null, else -1 (matches no block).
        self._null_id = NULL_BLOCK_ID if self._sliding else -1
        self._block_ids: dict[str, GroupBlockIds] = {}  # request id -> per group, the live table
        self._num_registered_blocks: dict[str, int] = {}  # leading blocks already offered to the cache
        # In tokens, counted once per admission (a request retried while blocks are short counts once).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries ----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold K/V (all but the null block of a pool with sliding groups)."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_usable_blocks

    def get_block_ids(self, request_id: str) -> GroupBlockIds:
        """The request's live block tables, one per group (entries that slid out: the null block)."""
        return self._block_ids[request_id]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._block_ids

    def num_live_blocks(self, request_id: str) -> list[int]:
        """Per group, the blocks the request holds (its table minus null entries)."""
        null = self._null_id
        return [sum(1 for i in table if i != null) for table in self._block_ids[request_id]]

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Blocks one request holds, over all groups, while computing `num_new_tokens` tokens after
        `num_computed_tokens` (sliding groups without what slid out of their window)."""
        block_size = self.block_size
        per_table = -(-(num_computed_tokens + num_new_tokens) // block_size)
        return sum(
            per_table
            - (0 if w is None else min(per_table, first_block_in_window(num_computed_tokens, w, block_size)))
            for w in self.windows
        )

    def uses_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need logits at every prompt position, so such requests compute it all.
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlockIds, int]:
        """Longest cached prefix of full blocks that every group can serve: (per group the table
        entries of the hit, number of tokens they hold); ([], 0) without a hit.

        Never the whole request: the last token is always recomputed, its logits are needed.
        """
        if not self.uses_prefix_cache(request):
            return [], 0
        block_size = self.block_size
        hashes = extend_block_hashes(request, block_size)
        tokens = request.all_token_ids
        max_hit_blocks = (request.num_tokens - 1) // block_size
        if self.num_groups == 1 and not self._sliding:  # one full group: a plain prefix walk
            hit_ids: list[int] = []
            for i in range(max_hit_blocks):
                block = self.pool.lookup(hashes[i], tokens[i * block_size : (i + 1) * block_size])
                if block is None:
                    break
                hit_ids.append(block.block_id)
            return ([hit_ids] if hit_ids else []), len(hit_ids) * block_size
        tables, num_hit = longest_common_hit(
            self.pool, self.windows, hashes, tokens, block_size, max_hit_blocks
        )
        return tables, num_hit * block_size

    # -- allocation -------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: GroupBlockIds | None = None,
        num_lookahead_tokens: int = 0,
    ) -> GroupBlockIds | None:
        """Grow the request's tables to cover its computed tokens, the prefix-cache hit
        `new_computed_block_ids` (from get_computed_blocks), `num_new_tokens` more, and
        `num_lookahead_tokens` slots after them (draft tokens: their KV is written this step but
        they are not the request's tokens, so no block of theirs enters the prefix cache).
        Sliding groups first free the blocks that slid out of their window.

        Returns the newly allocated block ids per group, or [] when no group got a block; None,
        allocating nothing, when the pool has too few free blocks.
        """
        # Runs for every scheduled request every step: the common case (no hit, no new block) is
        # kept to a few dict and integer operations.
        pool = self.pool
        block_size = self.block_size
        request_id = request.request_id
        tables = self._block_ids.get(request_id)
        num_hits = len(new_computed_block_ids[0]) if new_computed_block_ids else 0
        num_computed = request.num_computed_tokens + num_hits * block_size
        num_total = num_computed + num_new_tokens
        if tables is not None and self._sliding:
            self._free_slid_out(tables, num_computed)
        num_needed = -(-(num_total + num_lookahead_tokens) // block_size) - num_hits - (
            len(tables[0]) if tables is not None else 0
        )
        hits = []
        if new_computed_block_ids:
            null = self._null_id
            hits = [pool.blocks[i] for table in new_computed_block_ids for i in table if i != null]
        if num_needed > 0 or hits:
            num_revived = sum(1 for block in hits if block.ref_count == 0)  # hits now on the free list
            if num_needed * self.num_groups > pool.num_free_blocks - num_revived:
                return None
        if hits:
            pool.touch(hits)
        new_ids: GroupBlockIds = []
        if num_needed > 0:
            ids = [block.block_id for block in pool.allocate(num_needed * self.num_groups)]
            new_ids = [ids[g * num_needed : (g + 1) * num_needed] for g in range(self.num_groups)]
        if tables is None:
            tables = self._block_ids[request_id] = [[] for _ in range(self.num_groups)]
            self._num_registered_blocks[request_id] = num_hits
            if self.uses_prefix_cache(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hits * block_size
        if new_computed_block_ids:
            for table, hit in zip(tables, new_computed_block_ids, strict=True):
                table.extend(hit)
        if new_ids:
            for table, new in zip(tables, new_ids, strict=True):
                table.extend(new)
        if self.enable_prefix_caching and num_total // block_size > self._num_registered_blocks[request_id]:
            self._register_full_blocks(request, tables, num_total)
        return new_ids

    def _free_slid_out(self, tables: GroupBlockIds, num_computed_tokens: int) -> None:
        """Free, in each sliding group, the blocks wholly before the window of the query at
        `num_computed_tokens`; their entries become the null block. Entries already null form a
        prefix of the table, so only the newly slid-out ones are looked at."""
        block_size = self.block_size
        null = self._null_id
        for group, window in self._sliding:
            table = tables[group]
            last = min(first_block_in_window(num_computed_tokens, window, block_size), len(table)) - 1
            if last < 0 or table[last] == null:
                continue
            first = last
            while first > 0 and table[first - 1] != null:
                first -= 1
            # Earliest first, so the earliest are evicted first (a later hit needs the blocks
            # right before its hit point, whatever it is).
            slid_out = [self.pool.blocks[table[i]] for i in range(first, last + 1)]
            table[first : last + 1] = [null] * (last + 1 - first)
            self.pool.free(slid_out)

    def _register_full_blocks(self, request: Request, tables: GroupBlockIds, num_tokens: int) -> None:
        block_size = self.block_size
        num_full = min(num_tokens, request.num_tokens) // block_size
        start = self._num_registered_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = extend_block_hashes(request, block_size)
        tokens = request.all_token_ids
        blocks = self.pool.blocks
        null = self._null_id
        for i in range(start, num_full):
            block_tokens = tuple(tokens[i * block_size : (i + 1) * block_size])
            for group, table in enumerate(tables):
                block_id = table[i]
                if block_id == null:  # slid out before its tokens were all known: stays uncached
                    continue
                block = blocks[block_id]
                if block.block_hash is None:  # not a hit; if another block has this content, stays uncached
                    self.pool.cache(block, group_block_hash(hashes[i], group), block_tokens)
        self._num_registered_blocks[request.request_id] = num_full

    def free(self, request: Request, *, uncache: bool = False) -> None:
        """Release the request's blocks in every group, tail first so that a prefix's head is
        evicted last.

        `uncache=True` first drops them from the prefix cache: their KV may be wrong (the request
        errored, or its step may never have run).
        """
        tables = self._block_ids.pop(request.request_id, None)
        self._num_registered_blocks.pop(request.request_id, None)
        if tables is None:
            return
        pool_blocks = self.pool.blocks
        if len(tables) == 1 and not self._sliding:
            blocks = [pool_blocks[i] for i in reversed(tables[0])]
        else:
            null = self._null_id
            blocks = [
                pool_blocks[table[i]]
                for i in range(len(tables[0]) - 1, -1, -1)
                for table in tables
                if table[i] != null
            ]
        if uncache:
            for block in blocks:
                self.pool.uncache(block)
        self.pool.free(blocks)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # -- checks for tests -------------------------------------------------------------------

    def request_ids_with_blocks(self) -> set[str]:
        return set(self._block_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (O(num_blocks): tests only)."""
        pool = self.pool
        null = self._null_id
        expected_refs = [0] * pool.num_blocks
        group_of: dict[int, int] = {}  # block id -> the group whose tables hold it
        for request_id, tables in self._block_ids.items():
            assert len(tables) == self.num_groups, (
                f"request {request_id} has {len(tables)} block tables for {self.num_groups} groups"
            )
            assert len({len(table) for table in tables}) == 1, (
                f"request {request_id}'s block tables differ in length: {[len(t) for t in tables]}"
            )
            for group, table in enumerate(tables):
                live = [i for i in table if i != null]
                num_null = len(table) - len(live)
                if self.windows[group] is None:
                    assert num_null == 0, f"request {request_id} has null entries in full group {group}"
                assert all(i == null for i in table[:num_null]), (
                    f"request {request_id}'s null entries in group {group} are not a prefix: {table}"
                )
                assert len(set(live)) == len(live), f"request {request_id} holds a block twice: {table}"
                for block_id in live:
                    expected_refs[block_id] += 1
                    assert group_of.setdefault(block_id, group) == group, (
                        f"block {block_id} is held by groups {group_of[block_id]} and {group} at once"
                    )
        for block in pool.blocks:
            if block is pool.null_block:
                assert block.ref_count == 0 and block.block_hash is None, (
                    f"the null block was used: {block!r}"
                )
                assert expected_refs[block.block_id] == 0, "a table holds the null block as a live block"
                continue
            assert block.ref_count == expected_refs[block.block_id], (
                f"{block!r}: ref_count {block.ref_count} but {expected_refs[block.block_id]} requests hold it"
            )
        free_ids = [block.block_id for block in pool.free_queue]
        assert len(free_ids) == len(set(free_ids)), "a block is on the free list twice"
        assert len(free_ids) == pool.num_free_blocks, (
            f"free list has {len(free_ids)} blocks but counts {pool.num_free_blocks}"
        )
        assert pool.null_block is None or pool.null_block.block_id not in free_ids, (
            "the null block is on the free list"
        )
        num_unreferenced = sum(
            1 for block in pool.blocks if block.ref_count == 0 and block is not pool.null_block
        )
        assert len(free_ids) == num_unreferenced, (
            f"free list has {len(free_ids)} blocks but {num_unreferenced} blocks have ref_count 0"
        )
        assert all(pool.blocks[i].ref_count == 0 for i in free_ids), "a block in use is on the free list"
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash, f"prefix cache maps a hash to {block!r}, which has another"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size, (
                f"cached {block!r} does not hold a full block of tokens"
            )
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached_blocks.get(block.block_hash) is block, (
                    f"{block!r} has a hash the cache lost"
                )
        if not self._block_ids:
            assert pool.num_free_blocks == pool.num_usable_blocks, (
                f"no request is alive but only {pool.num_free_blocks} of {pool.num_usable_blocks} blocks "
                "are free or evictable (leak)"
            )
