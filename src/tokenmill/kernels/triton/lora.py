"""Batched multi-LoRA on the GPU: each token of a step goes through its own adapter's A and B.

A linear layer of P merged parts (1 plain, 2 gate/up, 3 q/k/v) has, per device slot s of S,
    lora_a [S, P*R, K]  part p's A is rows p*R .. (p+1)*R
    lora_b [S, OUT, R]  part p's B is rows part_starts[p] .. + part_rows[p] (the parts tile OUT)
with the scale alpha/r folded into B and ranks below R zero-padded. The step's mapping comes as
static int32 device buffers: `sorted_token_ids` (the tokens that have a slot, grouped by slot),
`slot_starts[s]` and `slot_counts[s]` (0: slot unused this step). Tokens with no slot appear
nowhere and their rows are neither read nor written.

    lora_shrink:  shrunk[t] = x[t] @ lora_a[slot(t)].T                      (float32)
    lora_expand:  y[t, part p] += shrunk[t, p*R:(p+1)*R] @ lora_b[slot(t), part p].T
    lora_apply:   both, the shrink's K split over a caller-owned LoraScratch

CUDA-graph safe: no host syncs, no allocations, and grids from static shapes only. The M axis
of both grids enumerates the step's (slot, M tile) pairs compactly: each program reads the S
counts, takes the running sum of their tiles and finds its own pair; the grid has
cdiv(T, BLOCK_M) + min(S, T) programs on that axis (an upper bound on the pairs whatever the
counts: each slot wastes at most one partial tile), and programs past the step's pairs exit at
once. Tiles by shape class: lora_tiles.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.lora_tiles import (
    LoraTiles,
    expand_tiles,
    shrink_counters,
    shrink_scratch_numel,
    shrink_tiles,
)

MAX_PARTS = 4  # the expand kernel takes each part's bounds as scalar arguments
_NO_PART = 1 << 30  # the first column block of a part that does not exist


@triton.jit
def _slot_tile(counts_ptr, S, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(slot, first row of the tile within the slot's tokens, the slot's token count) of this
    program's M tile; slot >= S when the program has no tile this step."""
    slots = tl.arange(0, S_PAD)
    counts = tl.load(counts_ptr + slots, mask=slots < S, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    pid = tl.program_id(0)
    # The program's slot is the first whose tiles end after it (empty slots end where they begin).
    slot = tl.sum((ends <= pid).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(slots == slot, ends - tiles, 0), 0)
    count = tl.sum(tl.where(slots == slot, counts, 0), 0)
    return slot, (pid - first_tile) * BLOCK_M, count


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K], last dimension contiguous
    a_ptr,  # [S, N, K] contiguous
    out_ptr,  # [T, N] float32, last dimension contiguous
    part_ptr,  # [SPLIT_K, T, N] float32 partial sums (read only with SPLIT_K > 1)
    counter_ptr,  # int32, one per (M program, column block), zero between launches (SPLIT_K > 1)
    ids_ptr,  # [T_cap] int32
    starts_ptr,  # [S] int32
    counts_ptr,  # [S] int32
    S,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_as,
    stride_om,
    stride_ps,  # T * N: one split's partial sums
    SPLIT_K: tl.constexpr,
    S_PAD: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" for float32 inputs
    UPCAST_DOT: tl.constexpr,  # float32 dots for 16-bit inputs (the CPU interpreter mis-multiplies bf16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot, m0, count = _slot_tile(counts_ptr, S, S_PAD, BLOCK_M)
    if slot >= S:
        return
    offs = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs < count
    start = tl.load(starts_ptr + slot)
    rows = tl.load(ids_ptr + start + offs, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # Out-of-range columns read a valid row of A (wrapped) and are never stored: no mask in the loop.
    a_rows = (cols % N).to(tl.int64)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    ks = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    a_at = a_ptr + slot.to(tl.int64) * stride_as + a_rows[None, :] * K + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_at + k0, mask=row_ok[:, None], other=0.0)
            a = tl.load(a_at + k0)
        else:
            k_ok = (k0 + ks) < K
            x = tl.load(x_at + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_at + k0, mask=k_ok[:, None], other=0.0)
        if UPCAST_DOT:
            x, a = x.to(tl.float32), a.to(tl.float32)
        else:
            a = a.to(x.dtype)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        part_at = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(part_at + tl.program_id(2) * stride_ps, acc, mask=out_ok)
        # Every thread's partial sums are stored before one thread counts the program in; the
        # count's release (and the last program's acquire) order them for the last program.
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split: add all in split order, reset the count
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other programs' stores are, not from a stale L1 line.
                acc += tl.load(part_at + split * stride_ps, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=out_ok)
    else:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=out_ok)


@triton.jit
def _expand_kernel(
    s_ptr,  # [T, P*R] float32 (the shrink's output), last dimension contiguous
    b_ptr,  # [S, OUT, R] contiguous
    y_ptr,  # [T, >= OUT], last dimension contiguous
    ids_ptr,
    starts_ptr,
    counts_ptr,
    S,
    R,
    stride_sm,
    stride_bs,
    stride_ym,
    start0, start1, start2, start3,  # part p's first row of OUT
    rows0, rows1, rows2, rows3,  # part p's rows
    block1, block2, block3,  # part p's first column block (the grid's axis 1); _NO_PART if absent
    S_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    slot, m0, count = _slot_tile(counts_ptr, S, S_PAD, BLOCK_M)
    if slot >= S:
        return
    pid_n = tl.program_id(1)
    part = (pid_n >= block1).to(tl.int32) + (pid_n >= block2).to(tl.int32) + (pid_n >= block3).to(tl.int32)
    part_start = tl.where(part == 0, start0, tl.where(part == 1, start1, tl.where(part == 2, start2, start3)))
    part_rows = tl.where(part == 0, rows0, tl.where(part == 1, rows1, tl.where(part == 2, rows2, rows3)))
    first_block = tl.where(part == 0, 0, tl.where(part == 1, block1, tl.where(part == 2, block2, block3)))
    local = (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = local < part_rows
    cols = (part_start + local).to(tl.int64)

    offs = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs < count
    start = tl.load(starts_ptr + slot)
    rows = tl.load(ids_ptr + start + offs, mask=row_ok, other=0).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < R

    s_at = s_ptr + rows[:, None] * stride_sm + (part * R + rs)[None, :]
    shrunk = tl.load(s_at, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    b_at = b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :] * R + rs[:, None]  # [BLOCK_R, BLOCK_N]
    b = tl.load(b_at, mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    if UPCAST_DOT:
        delta = tl.dot(shrunk, b.to(tl.float32), input_precision=PRECISION)
    else:
        delta = tl.dot(shrunk.to(b.dtype), b, input_precision=PRECISION)
    y_at = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y_ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_at, mask=y_ok, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_ok)


# -- launches ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class LoraScratch:
    """What a split-K shrink needs besides its output, allocated once before graphs are captured
    (`lora_scratch`); one serves every layer up to its sizes, one launch at a time."""

    partials: torch.Tensor  # float32, split * T * P*R partial sums
    counters: torch.Tensor  # int32 tile counters, zero between launches (each launch resets its own)


def lora_scratch(
    max_tokens: int, max_slots: int, max_cols: int, device: torch.device | str
) -> LoraScratch:
    """The scratch of a split-K shrink for up to `max_tokens` rows, `max_slots` slots and
    `max_cols` = P*R shrunk columns (the widest layer's), for any K."""
    return LoraScratch(
        torch.empty(shrink_scratch_numel(max_tokens, max_cols), dtype=torch.float32, device=device),
        torch.zeros(shrink_counters(max_tokens, max_slots, max_cols), dtype=torch.int32, device=device),
    )


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    out: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    slot_counts: torch.Tensor,
    *,
    scratch: LoraScratch | None = None,
    tiles: LoraTiles | None = None,
) -> None:
    """out[t, :] = x[t] @ lora_a[slot(t)].T (float32 out [T, P*R]) for every token with a slot;
    other rows of out are not written.

    With a `scratch`, K is split as the tile table says (few tokens); without one, never.
    `tiles` overrides the table (tests, tuning)."""
    num_tokens, k = x.shape
    num_slots, n, k_a = lora_a.shape
    _check_mapping(sorted_token_ids, slot_starts, slot_counts, num_slots)
    if k_a != k or out.shape != (num_tokens, n) or out.dtype != torch.float32:
        raise ValueError(
            f"lora_shrink: x {tuple(x.shape)} and lora_a {tuple(lora_a.shape)} need a float32 out of "
            f"[T, P*R] = [{num_tokens}, {n}]; got {out.dtype} {tuple(out.shape)}"
        )
    _check_inner_contiguous(x=x, out=out)
    if not lora_a.is_contiguous():
        raise ValueError("lora_shrink: lora_a must be contiguous [S, P*R, K]")
    if num_tokens == 0:
        return
    t = tiles or shrink_tiles(num_tokens, n, k)
    split_k = t.split_k if scratch is not None else 1
    grid = (_m_programs(num_tokens, num_slots, t.block_m), triton.cdiv(n, t.block_n), split_k)
    partials, counters = out, slot_counts  # not read unsplit
    if split_k > 1:
        assert scratch is not None
        partials, counters = scratch.partials, scratch.counters
        if partials.numel() < split_k * num_tokens * n or counters.numel() < grid[0] * grid[1]:
            raise ValueError(
                f"lora_shrink: the scratch holds {partials.numel()} partial sums and {counters.numel()} "
                f"counters; T={num_tokens}, P*R={n}, {num_slots} slots need {split_k * num_tokens * n} "
                f"and {grid[0] * grid[1]} (size it with lora_scratch for the largest layer)"
            )
    k_per_split = triton.cdiv(triton.cdiv(k, t.block_k), split_k) * t.block_k
    _shrink_kernel[grid](
        x, lora_a, out, partials, counters, sorted_token_ids, slot_starts, slot_counts,
        num_slots, n, k, k_per_split, x.stride(0), lora_a.stride(0), out.stride(0), num_tokens * n,
        SPLIT_K=split_k, S_PAD=_s_pad(num_slots), EVEN_K=k % t.block_k == 0,
        PRECISION=_precision(x.dtype), UPCAST_DOT=_upcast_dot(x),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip


def lora_expand(
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    slot_counts: torch.Tensor,
    part_starts: Sequence[int],
    part_rows: Sequence[int],
    rank: int,
    *,
    tiles: LoraTiles | None = None,
) -> None:
    """y[t, part p] += shrunk[t, p*R:(p+1)*R] @ lora_b[slot(t), part p].T in place, in y's dtype
    (accumulated in float32), for every token with a slot; other rows of y are untouched.

    `y` may be a column slice of a wider output: its rows need only a contiguous last dimension."""
    num_slots, out_rows, r = lora_b.shape
    num_parts = len(part_starts)
    _check_mapping(sorted_token_ids, slot_starts, slot_counts, num_slots)
    _check_parts(part_starts, part_rows, out_rows)
    if r != rank or shrunk.dtype != torch.float32 or shrunk.shape != (y.shape[0], num_parts * rank):
        raise ValueError(
            f"lora_expand: lora_b {tuple(lora_b.shape)} with rank {rank} and {num_parts} parts needs a float32 "
            f"shrunk of [T, P*R] = [{y.shape[0]}, {num_parts * rank}]; got {shrunk.dtype} {tuple(shrunk.shape)}"
        )
    if y.dim() != 2 or y.shape[1] != out_rows:
        raise ValueError(f"lora_expand: y must be [T, {out_rows}], got {tuple(y.shape)}")
    _check_inner_contiguous(shrunk=shrunk, y=y)
    if not lora_b.is_contiguous():
        raise ValueError("lora_expand: lora_b must be contiguous [S, OUT, R]")
    num_tokens = y.shape[0]
    if num_tokens == 0:
        return
    t = tiles or expand_tiles(num_tokens, out_rows, rank)
    blocks = [triton.cdiv(rows, t.block_n) for rows in part_rows]
    firsts = [sum(blocks[:p]) if p < num_parts else _NO_PART for p in range(1, MAX_PARTS)]
    starts = list(part_starts) + [0] * (MAX_PARTS - num_parts)
    rows = list(part_rows) + [0] * (MAX_PARTS - num_parts)
    grid = (_m_programs(num_tokens, num_slots, t.block_m), sum(blocks))
    _expand_kernel[grid](
        shrunk, lora_b, y, sorted_token_ids, slot_starts, slot_counts,
        num_slots, rank, shrunk.stride(0), lora_b.stride(0), y.stride(0),
        *starts, *rows, *firsts,
        S_PAD=_s_pad(num_slots), PRECISION=_precision(lora_b.dtype), UPCAST_DOT=_upcast_dot(lora_b),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    slot_counts: torch.Tensor,
    part_starts: Sequence[int],
    part_rows: Sequence[int],
    shrunk: torch.Tensor,
    scratch: LoraScratch,
) -> None:
    """y[t] += the LoRA delta of x[t] through its slot's adapter (all P parts), in place: the shrink
    into `shrunk` (float32 [T, P*R], e.g. a view of a buffer sized for the largest layer) with the
    table's split-K over `scratch`, then the expand."""
    num_parts = len(part_starts)
    if lora_a.shape[1] % num_parts:
        raise ValueError(f"lora_apply: lora_a has {lora_a.shape[1]} rows, not a multiple of the {num_parts} parts")
    lora_shrink(x, lora_a, shrunk, sorted_token_ids, slot_starts, slot_counts, scratch=scratch)
    lora_expand(
        shrunk, lora_b, y, sorted_token_ids, slot_starts, slot_counts, part_starts, part_rows,
        lora_a.shape[1] // num_parts,
    )  # fmt: skip


# -- helpers ----------------------------------------------------------------------------------------


def _m_programs(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Programs on the M axis: enough for every (slot, tile) pair of any mapping of T tokens."""
    return triton.cdiv(num_tokens, block_m) + min(num_slots, num_tokens)


def _s_pad(num_slots: int) -> int:
    return max(16, triton.next_power_of_2(num_slots))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(t: torch.Tensor) -> bool:
    """The CPU interpreter multiplies bf16 tiles wrongly (Triton 3.9): float32 dots there."""
    return t.device.type != "cuda" and t.dtype != torch.float32


def _check_mapping(ids: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, num_slots: int) -> None:
    for name, t in (("sorted_token_ids", ids), ("slot_starts", starts), ("slot_counts", counts)):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"lora: {name} must be a contiguous 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if starts.numel() != num_slots or counts.numel() != num_slots:
        raise ValueError(
            f"lora: slot_starts and slot_counts need one entry per slot ({num_slots}), "
            f"got {starts.numel()} and {counts.numel()}"
        )


def _check_parts(part_starts: Sequence[int], part_rows: Sequence[int], out_rows: int) -> None:
    if not 1 <= len(part_starts) <= MAX_PARTS or len(part_rows) != len(part_starts):
        raise ValueError(
            f"lora_expand: 1 to {MAX_PARTS} parts with one start and one row count each; "
            f"got starts {tuple(part_starts)} and rows {tuple(part_rows)}"
        )
    expected = 0
    for start, rows in zip(part_starts, part_rows, strict=True):
        if start != expected or rows <= 0:
            raise ValueError(
                f"lora_expand: the parts must tile OUT in order without gaps; got starts {tuple(part_starts)} "
                f"and rows {tuple(part_rows)}"
            )
        expected += rows
    if expected != out_rows:
        raise ValueError(f"lora_expand: the parts cover {expected} rows but lora_b has {out_rows}")


def _check_inner_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"lora: {name} needs a contiguous last dimension, got strides {t.stride()}")
