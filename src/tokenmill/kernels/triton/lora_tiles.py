"""Tile shapes of the batched multi-LoRA kernels (lora.py), by shape class.

Shrink (x [T, K] times each slot's A [P*R, K]) has a long K and a tiny N (P*R = 8..192): a weight
read plus an activation read, never tensor-core bound. With few tokens it would leave most SMs
idle (8 slots x 1 tile x 1 column block), so K is split among programs (split-K); each split
writes its partial sums to its own plane of a float32 scratch and the expand kernel adds the
planes while it loads them: no atomics, no zeroing pass, the same sums in the same order every
step (batch-invariant). Many tokens fill the SMs with M tiles alone, so the split shrinks as T
grows, which also bounds the scratch (`shrink_scratch_numel`).

Expand (shrunk [T, R] times each slot's B [OUT, R], added to y) has an inner dimension of 8..64
and a long OUT: it is a read-modify-write of y plus a read of B, so wide column blocks over many
programs; R fits one tl.dot (padded to 16).

Token classes are the static (padded) batch size T, never the per-step counts, so one CUDA graph
captures one configuration.
"""

from __future__ import annotations

import dataclasses

MIN_DOT = 16  # tl.dot's smallest tile side


@dataclasses.dataclass(frozen=True, slots=True)
class LoraTiles:
    block_m: int  # tokens of one slot per program (>= 16)
    block_n: int  # output columns per program (shrink: of P*R; expand: of one part)
    block_k: int  # shrink: K per loop step; expand: unused (the whole rank is one step)
    split_k: int = 1  # shrink only: programs sharing one tile's K range
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT or value & (value - 1):
                raise ValueError(f"LoraTiles.{name} must be a power of two >= {MIN_DOT}, got {value}")
        if self.split_k < 1:
            raise ValueError(f"LoraTiles.split_k must be >= 1, got {self.split_k}")


def _pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


# Split-K of the shrink by token class (T up to the key). Few tokens: a tile per slot, so splits
# are what makes programs (8 slots x 8 splits x 1-3 column blocks ~ 64-192 programs for 132 SMs).
# From 1024 tokens the M tiles alone give >= 24 programs per column block and K stays long per
# program; beyond 2048 no split.
_SHRINK_SPLITS = ((128, 8), (512, 8), (1024, 4), (2048, 2))
MAX_SPLIT_K = max(split for _, split in _SHRINK_SPLITS)


def shrink_tiles(num_tokens: int, n: int, k: int) -> LoraTiles:
    """Tiles of the shrink for a static batch of `num_tokens` rows, N = P*R columns and K inputs."""
    split = next((s for limit, s in _SHRINK_SPLITS if num_tokens <= limit), 1)
    # No split leaves less than two BLOCK_K steps per program.
    block_k = 64 if k >= 1024 else 32
    split = max(1, min(split, k // (2 * block_k)))
    # All of N in one column block when it fits (x is read once); 64 is the widest that keeps the
    # accumulator of a 64-row tile in registers at 4 warps.
    block_n = min(_pow2_at_least(n), 64)
    if num_tokens <= 512:  # decode: a slot holds a few to ~64 tokens; small tiles waste the least
        return LoraTiles(16, block_n, block_k, split, num_warps=4, num_stages=4)
    return LoraTiles(64, block_n, block_k, split, num_warps=4, num_stages=3)


def expand_tiles(num_tokens: int, out: int, rank: int) -> LoraTiles:
    """Tiles of the expand for a static batch of `num_tokens` rows into `out` columns of rank `rank`."""
    del rank  # the whole (padded) rank is one dot step
    if num_tokens <= 512:
        return LoraTiles(16, 128 if out >= 4096 else 64, MIN_DOT, num_warps=4, num_stages=2)
    return LoraTiles(64, 128, MIN_DOT, num_warps=4, num_stages=2)


def shrink_scratch_numel(max_tokens: int, n: int, k: int) -> int:
    """Float32 elements of the split-K scratch that serves every T <= max_tokens: the largest
    split * T * n over the token classes."""
    limits = [limit for limit, _ in _SHRINK_SPLITS if limit < max_tokens] + [max_tokens]
    return max(shrink_tiles(t, n, k).split_k * t * n for t in limits)
