"""Tile shapes of the batched multi-LoRA kernels (lora.py), by shape class.

Shrink (x [T, K] times each slot's A [P*R, K]) has a long K and a tiny N (P*R = 8..192): a weight
read plus an activation read, never tensor-core bound. With few tokens it would leave most SMs
idle (8 slots x 1 tile x 1 column block), so K is split among programs (split-K); each split
writes its float32 partial sums to a scratch and counts itself in on a per-tile counter; the last
to arrive adds the partials in split order (the same sums every step) and resets the counter: one
launch, no zeroing pass. Many tokens fill the SMs with M tiles alone, so the split shrinks as T
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


# The shrink's tiles by token class (T up to the key): (block_m, split_k). From a sweep on an H100
# at Llama-3.1-8B's shapes, 8 slots of rank 16 (us per shrink, 4 rotating sets in a CUDA graph):
# few tokens leave one tile per slot, so the split is what makes programs (16 splits: 3.2-4.9 us
# at T=64, against 3.5-6.4 with 8); from 64 tokens 32-row tiles beat 16 (T=512 down: 10.6 vs
# 12.9 us); at T=4096 64-row tiles need a split of 4 to fill the SMs (qkv 18.3 us against 29.8
# unsplit, down 44.5 against 88.5). 1024-2048 and 8192 are interpolated, not measured.
_SHRINK_CLASSES = ((64, 16, 16), (512, 32, 16), (1024, 64, 8), (4096, 64, 4))
_SHRINK_BEYOND = (64, 2)
MAX_SPLIT_K = max(split for _, _, split in _SHRINK_CLASSES)


def _shrink_class(num_tokens: int) -> tuple[int, int]:
    return next(((bm, split) for limit, bm, split in _SHRINK_CLASSES if num_tokens <= limit), _SHRINK_BEYOND)


def shrink_tiles(num_tokens: int, n: int, k: int) -> LoraTiles:
    """Tiles of the shrink for a static batch of `num_tokens` rows, N = P*R columns and K inputs."""
    block_m, split = _shrink_class(num_tokens)
    # Long K (down_proj's 14336) streams better in 128-wide steps (T=64: 4.9 against 5.0 us; T=4096:
    # 44.5 against 46.8); short K keeps 64, and tiny test shapes 32.
    block_k = 128 if k >= 8192 else 64 if k >= 1024 else 32
    split = max(1, min(split, k // (2 * block_k)))  # each split streams at least two BLOCK_K steps
    # All of N in one column block when it fits (x is read once): 64 keeps a 64-row accumulator in
    # registers at 4 warps; 16-column blocks were never faster in the sweep.
    block_n = min(_pow2_at_least(n), 64)
    return LoraTiles(block_m, block_n, block_k, split, num_warps=4, num_stages=4 if block_m <= 32 else 3)


def expand_tiles(num_tokens: int, out: int, rank: int) -> LoraTiles:
    """Tiles of the expand for a static batch of `num_tokens` rows into `out` columns of rank `rank`.
    The sweep (same setup): 128 columns at 4 warps within 5% of the best everywhere; 16-row tiles
    best up to 256 tokens, 32 from 512 (qkv at T=512: 6.5 against 7.3 us; T=4096 on par with 64)."""
    del out, rank  # the whole (padded) rank is one dot step; OUT only sets the grid
    return LoraTiles(16 if num_tokens <= 256 else 32, 128, MIN_DOT, num_warps=4, num_stages=2)


def shrink_scratch_numel(max_tokens: int, n: int) -> int:
    """Float32 elements of the split-K partial sums that serve every T <= max_tokens and every K:
    the largest split * T * n over the token classes."""
    limits = [limit for limit, _, _ in _SHRINK_CLASSES if limit < max_tokens] + [max_tokens]
    return max(_shrink_class(t)[1] * t * n for t in limits)


def shrink_counters(max_tokens: int, max_slots: int, n: int) -> int:
    """Tile counters of the split-K shrink: one per (M program, column block) of its largest grid."""
    most_programs = max(-(-max_tokens // bm) for _, bm, _ in _SHRINK_CLASSES) + min(max_slots, max_tokens)
    return most_programs * -(-n // MIN_DOT)
