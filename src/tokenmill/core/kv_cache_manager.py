"""Per-request block tables on top of the block pool, with prefix caching.

The manager only speaks of tokens: a request's blocks cover its computed tokens plus those
scheduled this step. Full blocks are registered in the prefix cache when they are allocated for
tokens computed this step (not after the step): within one forward pass every layer writes all
K/V of the batch before attention reads it, so another request in the same step may already hit
them (this is how `n > 1` siblings share their prompt).
"""

from __future__ import annotations

from tokenmill.core.block_hash import extend_block_hashes
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._block_ids: dict[str, list[int]] = {}  # request id -> block table (the live list)
        self._num_registered_blocks: dict[str, int] = {}  # leading blocks already offered to the cache
        # In tokens, counted once per admission (a request retried while blocks are short counts once).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries ----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._block_ids[request_id]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._block_ids

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _uses_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need logits at every prompt position, so such requests compute it all.
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block ids, number of tokens they hold).

        Never the whole request: the last token is always recomputed, its logits are needed.
        """
        if not self._uses_prefix_cache(request):
            return [], 0
        block_size = self.block_size
        hashes = extend_block_hashes(request, block_size)
        tokens = request.all_token_ids
        max_hit_blocks = (request.num_tokens - 1) // block_size
        hit_ids: list[int] = []
        for i in range(max_hit_blocks):
            block = self.pool.lookup(hashes[i], tokens[i * block_size : (i + 1) * block_size])
            if block is None:
                break
            hit_ids.append(block.block_id)
        return hit_ids, len(hit_ids) * block_size

    # -- allocation -------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's blocks to cover its computed tokens, the prefix-cache hit
        `new_computed_block_ids` (from get_computed_blocks), `num_new_tokens` more, and
        `num_lookahead_tokens` slots after them (draft tokens: their KV is written this step but
        they are not the request's tokens, so no block of theirs enters the prefix cache).

        Returns the newly allocated block ids (maybe empty), or None, changing nothing, when the
        pool has too few free blocks.
        """
        # Runs for every scheduled request every step: the common case (no hit, no new block) is
        # kept to a few dict and integer operations.
        pool = self.pool
        block_size = self.block_size
        request_id = request.request_id
        block_ids = self._block_ids.get(request_id)
        num_hits = len(new_computed_block_ids) if new_computed_block_ids else 0
        num_total = request.num_computed_tokens + num_hits * block_size + num_new_tokens
        num_needed = (
            -(-(num_total + num_lookahead_tokens) // block_size)
            - num_hits
            - (len(block_ids) if block_ids is not None else 0)
        )
        hits = [pool.blocks[i] for i in new_computed_block_ids] if new_computed_block_ids else []
        num_revived = sum(1 for block in hits if block.ref_count == 0)  # hits now on the free list
        if num_needed > pool.num_free_blocks - num_revived:
            return None

        if hits:
            pool.touch(hits)
        new_ids = [block.block_id for block in pool.allocate(num_needed)] if num_needed > 0 else []
        if block_ids is None:
            block_ids = self._block_ids[request_id] = []
            self._num_registered_blocks[request_id] = num_hits
            if self._uses_prefix_cache(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hits * block_size
        if hits:
            block_ids.extend(block.block_id for block in hits)
        if new_ids:
            block_ids.extend(new_ids)
        if self.enable_prefix_caching and num_total // block_size > self._num_registered_blocks[request_id]:
            self._register_full_blocks(request, block_ids, num_total)
        return new_ids

    def _register_full_blocks(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        block_size = self.block_size
        num_full = min(num_tokens, request.num_tokens) // block_size
        start = self._num_registered_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = extend_block_hashes(request, block_size)
        tokens = request.all_token_ids
        for i in range(start, num_full):
            block = self.pool.blocks[block_ids[i]]
            if block.block_hash is None:  # not a hit; if another block has this content, stays uncached
                self.pool.cache(block, hashes[i], tuple(tokens[i * block_size : (i + 1) * block_size]))
        self._num_registered_blocks[request.request_id] = num_full

    def free(self, request: Request, *, uncache: bool = False) -> None:
        """Release the request's blocks, tail first so that a prefix's head is evicted last.

        `uncache=True` first drops them from the prefix cache: their KV may be wrong (the request
        errored, or its step may never have run).
        """
        block_ids = self._block_ids.pop(request.request_id, None)
        self._num_registered_blocks.pop(request.request_id, None)
        if block_ids is None:
            return
        blocks = [self.pool.blocks[i] for i in reversed(block_ids)]
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
        expected_refs = [0] * pool.num_blocks
        for request_id, block_ids in self._block_ids.items():
            assert len(set(block_ids)) == len(block_ids), (
                f"request {request_id} holds a block twice: {block_ids}"
            )
            for block_id in block_ids:
                expected_refs[block_id] += 1
        for block in pool.blocks:
            assert block.ref_count == expected_refs[block.block_id], (
                f"{block!r}: ref_count {block.ref_count} but {expected_refs[block.block_id]} requests hold it"
            )
        free_ids = [block.block_id for block in pool.free_queue]
        assert len(free_ids) == len(set(free_ids)), "a block is on the free list twice"
        assert len(free_ids) == pool.num_free_blocks, (
            f"free list has {len(free_ids)} blocks but counts {pool.num_free_blocks}"
        )
        num_unreferenced = sum(1 for block in pool.blocks if block.ref_count == 0)
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
            assert pool.num_free_blocks == pool.num_blocks, (
                f"no request is alive but only {pool.num_free_blocks} of {pool.num_blocks} blocks are "
                "free or evictable (leak)"
            )
