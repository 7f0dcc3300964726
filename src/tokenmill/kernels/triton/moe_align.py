"""Token-expert pairs sorted into expert-aligned blocks, for the grouped GEMMs of fused_moe.py.

A step routes T tokens to top_k experts each: N = T * top_k pairs, pair p = token p // top_k in
its (p % top_k)-th slot. The grouped GEMMs work on blocks of `block_m` rows that all belong to
one expert, so the pairs are grouped by expert (in pair order within an expert) and each
expert's run is padded to a multiple of block_m with the sentinel N:

    sorted_pair_ids  [max_blocks * block_m] int32   pair ids by expert, runs padded with N
    block_expert_ids [max_blocks] int32              the expert of each block
    num_padded       [1] int32                       entries in use; blocks past it do nothing

Nothing here reads a value back to the host: the sizes are bounds known from N, E and block_m
(max_blocks = ceil(N / block_m) + min(N, E), since each expert with pairs adds at most one
partly filled block), so a step can sit in a CUDA graph. Two ways to the same result:

- `align_small`: one Triton program counts, scans and scatters in registers (one launch): small
  batches, where a chain of torch launches would cost more than the loop of one program.
- `align_by_sort`: torch ops (a stable argsort, cumsums, a scatter, a searchsorted): large
  prefill steps, where one program looping over the pairs would be the slow part; it also runs
  on the CPU, where the tests use it as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Elements of one [pairs, experts] one-hot tile in align_small's registers: 32 pairs a loop step
# with 128 experts, 512 with 8.
_TILE_ELEMENTS = 4096
# align_small serves steps whose pairs fit in this many of its loop steps (one program walks them
# twice; past that the torch ops' parallel launches are faster): 256 pairs with 128 experts.
SMALL_ALIGN_MAX_CHUNKS = 8


@dataclass(slots=True)
class ExpertBlocks:
    sorted_pair_ids: torch.Tensor  # [max_blocks * block_m] int32
    block_expert_ids: torch.Tensor  # [max_blocks] int32
    num_padded: torch.Tensor  # [1] int32
    block_m: int
    num_pairs: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert_ids.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The expert-aligned blocks of the pairs in `topk_ids` [T, top_k] (int32 or int64)."""
    if topk_ids.numel() <= SMALL_ALIGN_MAX_CHUNKS * _chunk(num_experts):
        return align_small(topk_ids, num_experts, block_m)
    return align_by_sort(topk_ids, num_experts, block_m)


def _chunk(num_experts: int) -> int:
    """Pairs per loop step of align_small."""
    return max(16, _TILE_ELEMENTS // triton.next_power_of_2(num_experts))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_small_kernel(
    ids_ptr,  # [N] expert id of each pair
    sorted_ptr,  # [max_blocks * BLOCK_M] int32
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    num_experts,
    num_blocks,  # max_blocks
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # pairs per loop step
    EXPERTS_PAD: tl.constexpr,
    FILL: tl.constexpr,  # sentinel slots written per loop step
):
    experts = tl.arange(0, EXPERTS_PAD)
    # Pass 1: pairs per expert, each expert's run padded to BLOCK_M, and where each run starts.
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=EXPERTS_PAD).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_ends = tl.cumsum(padded, axis=0)
    run_starts = run_ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Block b starts at row b * BLOCK_M and belongs to the first expert whose run ends after it
    # (empty runs end where they start and are passed over). Blocks past the end are never run;
    # they name the last expert so nothing reads out of bounds.
    for first_block in range(0, num_blocks, CHUNK):
        blocks = first_block + tl.arange(0, CHUNK)
        ended = (run_ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32)
        expert = tl.minimum(tl.sum(ended, axis=1), num_experts - 1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    # Pass 2: every slot gets the sentinel, then each pair goes to its run's start + the pairs of
    # its expert before it (earlier chunks: `placed`; this chunk: a cumulative one-hot count).
    for start in range(0, num_blocks * BLOCK_M, FILL):
        slots = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + slots, num_pairs, mask=slots < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinel stores land before the scatter overwrites some of them
    placed = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        in_range = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=in_range, other=EXPERTS_PAD).to(tl.int32)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
        base = tl.sum(one_hot * (run_starts + placed)[None, :], axis=1)
        tl.store(sorted_ptr + base + rank, pairs, mask=in_range)
        placed += tl.sum(one_hot, axis=0)


def align_small(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """align_pairs in one Triton program (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = ids.device
    out = ExpertBlocks(
        sorted_pair_ids=torch.empty(blocks * block_m, dtype=torch.int32, device=device),
        block_expert_ids=torch.empty(blocks, dtype=torch.int32, device=device),
        num_padded=torch.empty(1, dtype=torch.int32, device=device),
        block_m=block_m,
        num_pairs=num_pairs,
    )
    experts_pad = triton.next_power_of_2(num_experts)
    chunk = _chunk(num_experts)
    _align_small_kernel[(1,)](
        ids,
        out.sorted_pair_ids,
        out.block_expert_ids,
        out.num_padded,
        num_pairs,
        num_experts,
        blocks,
        BLOCK_M=block_m,
        CHUNK=chunk,
        EXPERTS_PAD=experts_pad,
        FILL=1024,
        num_warps=4,
    )
    return out


def align_by_sort(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """align_pairs with torch ops, on any device; no host syncs."""
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # (bincount reads its size back to the host)
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = torch.cumsum(padded, 0)
    run_starts = run_ends - padded
    order = torch.argsort(ids, stable=True)  # pair ids grouped by expert, in pair order
    sorted_experts = ids[order]
    pairs_before = torch.cumsum(counts, 0) - counts  # of lower experts, unpadded
    rank = torch.arange(num_pairs, device=device) - pairs_before[sorted_experts]
    sorted_pair_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, run_starts[sorted_experts] + rank, order.to(torch.int32))
    block_rows = torch.arange(blocks, device=device) * block_m
    block_expert_ids = torch.searchsorted(run_ends, block_rows, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(
        sorted_pair_ids=sorted_pair_ids,
        block_expert_ids=block_expert_ids.to(torch.int32),
        num_padded=run_ends[-1:].to(torch.int32),
        block_m=block_m,
        num_pairs=num_pairs,
    )
