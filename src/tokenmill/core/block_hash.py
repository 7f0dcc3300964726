"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, so equal hashes mean equal whole prefixes, not just
equal blocks. SHA-256 (not Python's `hash()`, which is salted per process and collides easily):
the hashes must mean the same thing in every process and for every user.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from tokenmill.core.request import Request

_ROOT_PARENT = bytes(32)  # parent of a sequence's first block
_EXTRA_KEY_MARK = b"\xffextra:"  # after the fixed-size token bytes, so it cannot be mistaken for tokens


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: str | None = None
) -> bytes:
    """sha256(parent hash, the block's token ids, extra key), 32 bytes."""
    hasher = hashlib.sha256(_ROOT_PARENT if parent_hash is None else parent_hash)
    hasher.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        hasher.update(_EXTRA_KEY_MARK)
        hasher.update(extra_key.encode())
    return hasher.digest()


def extend_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Hash the request's full blocks not hashed yet; returns `request.block_hashes`.

    Incremental: each full block is hashed once in the request's life (preemption keeps them).
    The cache salt and the LoRA adapter go into the first block only; the chain carries them to
    every later block.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full_blocks = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    first_extra_key = request.block_hash_extra_key if not hashes else None
    for i in range(len(hashes), num_full_blocks):
        start = i * block_size
        extra_key = first_extra_key if i == 0 else None
        parent = hash_block_tokens(parent, tokens[start : start + block_size], extra_key)
        hashes.append(parent)
    return hashes


def group_block_hash(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of KV cache group `group`: one token hash chain serves every
    group, and the group index in the key keeps a block of one group from being handed to another
    (their layers differ). Group 0's key is the hash itself, so a model with one group caches
    exactly as without groups."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
