"""The longest prefix-cache hit that every KV cache group can serve.

A hit of `n` blocks means the request's first `n * block_size` tokens need no computing: every
layer must find their K/V. A full-attention group needs all `n` blocks. A sliding-window group
needs only the blocks holding the keys its next query (at position `n * block_size`) can see,
the last `window - 1` tokens before it; its earlier entries stay null. So a hit that a full
group can serve at `n` it can serve at any shorter length, but a sliding group may not: it needs
the blocks right before the hit point. As vLLM's hybrid coordinator does, the common length is
found by shrinking: the full groups' longest common prefix caps it, then each sliding group
offers its longest hit up to the cap, until every group agrees.

Each group's blocks sit in the prefix cache under the block's chained token hash plus the group
index (`group_block_hash`), so a group only ever hits its own blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.core.block_hash import group_block_hash
from tokenmill.core.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock


def first_block_in_window(num_tokens: int, window: int, block_size: int) -> int:
    """The first block a sliding group needs once `num_tokens` tokens are computed: the query at
    position `num_tokens` sees keys > num_tokens - window; every block before this one lies
    wholly before that."""
    return max(0, (num_tokens - window + 1) // block_size)


class _GroupLookups:
    """Prefix-cache lookups of one request, remembered per (group, block index): the shrinking
    search asks about the same blocks more than once."""

    def __init__(
        self, pool: BlockPool, hashes: Sequence[bytes], tokens: Sequence[int], block_size: int
    ) -> None:
        self.pool = pool
        self.hashes = hashes
        self.tokens = tokens
        self.block_size = block_size
        self._seen: dict[tuple[int, int], KVCacheBlock | None] = {}

    def block(self, group: int, index: int) -> KVCacheBlock | None:
        key = (group, index)
        if key in self._seen:
            return self._seen[key]
        start = index * self.block_size
        found = self.pool.lookup(
            group_block_hash(self.hashes[index], group), self.tokens[start : start + self.block_size]
        )
        self._seen[key] = found
        return found


def longest_common_hit(
    pool: BlockPool,
    windows: Sequence[int | None],
    hashes: Sequence[bytes],
    tokens: Sequence[int],
    block_size: int,
    max_blocks: int,
) -> tuple[list[list[int]], int]:
    """(per group, the hit's block table entries; the hit's length in blocks) for the longest
    prefix of at most `max_blocks` blocks that every group (`windows[g]`: its sliding window, or
    None) can serve. A sliding group's entries before its window are the null block. ([], 0)
    when there is no hit."""
    lookups = _GroupLookups(pool, hashes, tokens, block_size)
    num_hit = max_blocks
    for group, window in enumerate(windows):
        if window is None:
            n = 0
            while n < num_hit and lookups.block(group, n) is not None:
                n += 1
            num_hit = n
    sliding = [(group, window) for group, window in enumerate(windows) if window is not None]
    shrunk = True
    while shrunk and num_hit > 0:
        shrunk = False
        for group, window in sliding:
            n = _longest_sliding_hit(lookups, group, window, num_hit)
            if n < num_hit:
                num_hit, shrunk = n, True
    if num_hit == 0:
        return [], 0
    tables: list[list[int]] = []
    for group, window in enumerate(windows):
        first = 0 if window is None else first_block_in_window(num_hit * block_size, window, block_size)
        table = [NULL_BLOCK_ID] * first
        for index in range(first, num_hit):
            block = lookups.block(group, index)
            assert block is not None, "the hit search returned a block it did not find"
            table.append(block.block_id)
        tables.append(table)
    return tables, num_hit


def _longest_sliding_hit(lookups: _GroupLookups, group: int, window: int, max_blocks: int) -> int:
    """The longest hit of at most `max_blocks` blocks this sliding group can serve: a length n whose
    blocks first_block_in_window(n) .. n - 1 are all cached. Scans from the right: within a run of
    cached blocks only the run's end can be such an n (the blocks needed grow with n)."""
    block_size = lookups.block_size
    end = max_blocks  # blocks index .. end - 1 are cached
    for index in range(max_blocks - 1, -1, -1):
        if first_block_in_window(end * block_size, window, block_size) >= end:
            return end  # a window of one token needs no earlier block
        if lookups.block(group, index) is None:
            end = index
        elif first_block_in_window(end * block_size, window, block_size) >= index:
            return end
    return end
