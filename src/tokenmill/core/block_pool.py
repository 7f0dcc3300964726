"""The pool of KV blocks: ref counts, an O(1) LRU free list, and the hash -> block prefix cache.

A block with ref_count 0 is free. A free block that still carries a hash keeps its KV and can be
revived by a prefix-cache hit (`touch`) until it is handed out again (evicted). The free list is
ordered so that the blocks least worth keeping go first: uncached blocks at the head, then cached
blocks in the order they were freed (least recently used first).

A pool serving sliding-window KV cache groups reserves block 0 as the null block: the entries of
a block table whose blocks slid out of the window point at it. It is never handed out, freed or
cached, and nothing ever writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

# Told of the cached blocks one allocation evicts: (block id, prefix-cache key, token ids) each.
EvictionListener = Callable[[list[tuple[int, bytes, tuple[int, ...]]]], None]


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens while cached, checked on a hit
    # Free-list links; both None while the block is in use.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock({self.block_id}, ref_count={self.ref_count}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: O(1) pop, push and removal."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free KV blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block!r} is already in the free list")
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __del__(self) -> None:
        # A doubly linked list is a reference cycle: unlinked here, a dropped pool's blocks (over
        # 100,000 on the CPU's default 1 GiB pool of a small model) go when it goes, not at the
        # cyclic collector's next full pass.
        block = self._head
        while block is not None:
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt


NULL_BLOCK_ID = 0  # the null block's id, in a pool that reserves one


class BlockPool:
    def __init__(self, num_blocks: int, *, reserve_null_block: bool = False) -> None:
        min_blocks = 2 if reserve_null_block else 1
        if num_blocks < min_blocks:
            why = " (one is the null block of the sliding-window groups)" if reserve_null_block else ""
            raise ValueError(f"num_blocks must be >= {min_blocks}{why}, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[NULL_BLOCK_ID] if reserve_null_block else None
        self.free_queue = FreeBlockQueue(b for b in self.blocks if b is not self.null_block)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        # A KV connector that saves evicted blocks elsewhere (core/kv_connector.py); None: nobody.
        self.on_evict: EvictionListener | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold a request's K/V: all but the null block."""
        return len(self.blocks) - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, including cached ones that would be evicted."""
        return self.free_queue.num_free

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks off the head of the free list (evicting their cached content)."""
        if num_blocks > self.free_queue.num_free:
            raise ValueError(f"asked for {num_blocks} KV blocks but only {self.free_queue.num_free} are free")
        blocks = []
        evicted = [] if self.on_evict is not None else None
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if evicted is not None:
                    evicted.append((block.block_id, block.block_hash, block.token_ids))
                self.uncache(block)
            block.ref_count = 1
            blocks.append(block)
        if evicted:
            self.on_evict(evicted)  # type: ignore[misc]
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, reviving free ones."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block, in the order given (pass a sequence tail first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"{block!r} freed more often than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)  # holds nothing reusable: hand it out first
                else:
                    self.free_queue.append(block)

    def lookup(self, block_hash: bytes, token_ids: list[int]) -> KVCacheBlock | None:
        """The cached block with this hash and exactly these tokens (a hash collision is a miss)."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Register a full block; False if another block already holds this content."""
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached_blocks[block_hash] = block
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. between benchmark runs); blocks in use stay allocated."""
        for block in list(self.cached_blocks.values()):
            self.uncache(block)
