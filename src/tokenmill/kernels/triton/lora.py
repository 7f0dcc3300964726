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
    lora_apply:   both, with the shrink's K split over a caller-owned scratch

CUDA-graph safe: no host syncs, no allocations, and grids from static shapes only. The M axis
of both grids enumerates the step's (slot, M tile) pairs compactly: each program reads the S
counts, takes the running sum of their tiles and finds its own pair; the grid has
cdiv(T, BLOCK_M) + min(S, T) programs on that axis (an upper bound on the pairs whatever the
counts: each slot wastes at most one partial tile), and programs past the step's pairs exit at
once. Tiles by shape class: lora_tiles.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.lora_tiles import LoraTiles, expand_tiles, shrink_scratch_numel, shrink_tiles

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
    out_ptr,  # [SPLIT_K, T, N] float32, last dimension contiguous
    ids_ptr,  # [T_cap] int32
    starts_ptr,  # [S] int32
    counts_ptr,  # [S] int32
    S,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_as,
    stride_os,
    stride_om,
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
    out_at = out_ptr + tl.program_id(2) * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_at, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expand_kernel(
    s_ptr,  # [NUM_SPLITS, T, P*R] float32 (partial sums of the shrink), last dimension contiguous
    b_ptr,  # [S, OUT, R] contiguous
    y_ptr,  # [T, >= OUT], last dimension contiguous
    ids_ptr,
    starts_ptr,
    counts_ptr,
    S,
    R,
    stride_ss,
    stride_sm,
    stride_bs,
    stride_ym,
    start0, start1, start2, start3,  # part p's first row of OUT
    rows0, rows1, rows2, rows3,  # part p's rows
    block1, block2, block3,  # part p's first column block (the grid's axis 1); _NO_PART if absent
    NUM_SPLITS: tl.constexpr,
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
    shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        shrunk += tl.load(s_at + split * stride_ss, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
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


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    out: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    slot_counts: torch.Tensor,
    *,
    tiles: LoraTiles | None = None,
) -> None:
    """out[t, :] = x[t] @ lora_a[slot(t)].T for every token with a slot; other rows are not written.

    `out` is float32 [T, P*R], or [SPLIT_K, T, P*R]: then K is split SPLIT_K ways, plane i holds
    split i's partial sums and the result is their sum (lora_expand takes the planes as they are).
    `tiles` overrides the shape-class table (tests, tuning); its split_k is ignored here."""
    planes = out if out.dim() == 3 else out.unsqueeze(0)
    num_tokens, k = x.shape
    num_slots, n, k_a = lora_a.shape
    _check_mapping(sorted_token_ids, slot_starts, slot_counts, num_slots)
    if k_a != k or planes.shape[1:] != (num_tokens, n) or planes.dtype != torch.float32:
        raise ValueError(
            f"lora_shrink: x {tuple(x.shape)} and lora_a {tuple(lora_a.shape)} need a float32 out of "
            f"[T, P*R] = [{num_tokens}, {n}] (or [splits, {num_tokens}, {n}]); got {out.dtype} {tuple(out.shape)}"
        )
    _check_inner_contiguous(x=x, out=planes)
    if not lora_a.is_contiguous():
        raise ValueError("lora_shrink: lora_a must be contiguous [S, P*R, K]")
    if num_tokens == 0:
        return
    t = tiles or shrink_tiles(num_tokens, n, k)
    split_k = planes.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, t.block_k), split_k) * t.block_k
    grid = (_m_programs(num_tokens, num_slots, t.block_m), triton.cdiv(n, t.block_n), split_k)
    _shrink_kernel[grid](
        x, lora_a, planes, sorted_token_ids, slot_starts, slot_counts,
        num_slots, n, k, k_per_split, x.stride(0), lora_a.stride(0), planes.stride(0), planes.stride(1),
        S_PAD=_s_pad(num_slots), EVEN_K=k % t.block_k == 0, PRECISION=_precision(x.dtype),
        UPCAST_DOT=_upcast_dot(x), BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
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

    `shrunk` is float32 [T, P*R] or the [SPLIT_K, T, P*R] planes of a split shrink (summed here).
    `y` may be wider than OUT (a view into a larger output is fine: its rows need only a
    contiguous last dimension)."""
    planes = shrunk if shrunk.dim() == 3 else shrunk.unsqueeze(0)
    num_slots, out_rows, r = lora_b.shape
    num_parts = len(part_starts)
    _check_mapping(sorted_token_ids, slot_starts, slot_counts, num_slots)
    _check_parts(part_starts, part_rows, out_rows)
    if r != rank or planes.dtype != torch.float32 or planes.shape[1:] != (y.shape[0], num_parts * rank):
        raise ValueError(
            f"lora_expand: lora_b {tuple(lora_b.shape)} with rank {rank} and {num_parts} parts needs a float32 "
            f"shrunk of [T, P*R] = [{y.shape[0]}, {num_parts * rank}] (or [splits, T, P*R]); "
            f"got {shrunk.dtype} {tuple(shrunk.shape)}"
        )
    if y.dim() != 2 or y.shape[1] < out_rows:
        raise ValueError(f"lora_expand: y must be [T, >= {out_rows}], got {tuple(y.shape)}")
    _check_inner_contiguous(shrunk=planes, y=y)
    if not lora_b.is_contiguous():
        raise ValueError("lora_expand: lora_b must be contiguous [S, OUT, R]")
    num_tokens = y.shape[0]
    if num_tokens == 0:
        return
    t = tiles or expand_tiles(num_tokens, out_rows, rank)
    blocks = [triton.cdiv(rows, t.block_n) for rows in part_rows]
    firsts = [sum(blocks[:p]) for p in range(1, MAX_PARTS)]
    firsts = [f if p < num_parts else _NO_PART for p, f in enumerate(firsts, start=1)]
    starts = list(part_starts) + [0] * (MAX_PARTS - num_parts)
    rows = list(part_rows) + [0] * (MAX_PARTS - num_parts)
    grid = (_m_programs(num_tokens, num_slots, t.block_m), sum(blocks))
    _expand_kernel[grid](
        planes, lora_b, y, sorted_token_ids, slot_starts, slot_counts,
        num_slots, rank, planes.stride(0), planes.stride(1), lora_b.stride(0), y.stride(0),
        *starts, *rows, *firsts,
        NUM_SPLITS=planes.shape[0], S_PAD=_s_pad(num_slots), PRECISION=_precision(lora_b.dtype),
        UPCAST_DOT=_upcast_dot(lora_b), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip


def lora_scratch(max_tokens: int, num_parts: int, rank: int, k: int, device: torch.device | str) -> torch.Tensor:
    """The float32 scratch that `lora_apply` needs for up to `max_tokens` rows of a layer with K
    inputs and P*R shrunk columns; allocate once, before capturing graphs (the largest layer's
    serves every layer)."""
    return torch.empty(shrink_scratch_numel(max_tokens, num_parts * rank, k), dtype=torch.float32, device=device)


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
    scratch: torch.Tensor,
) -> None:
    """y[t] += the LoRA delta of x[t] through its slot's adapter (all P parts), in place: the shrink
    with the table's split-K into `scratch` (1-D float32, from `lora_scratch`), then the expand."""
    num_tokens, k = x.shape
    n = lora_a.shape[1]
    num_parts = len(part_starts)
    if n % num_parts:
        raise ValueError(f"lora_apply: lora_a has {n} rows, not a multiple of the {num_parts} parts")
    split_k = shrink_tiles(num_tokens, n, k).split_k
    need = split_k * num_tokens * n
    if scratch.dim() != 1 or scratch.dtype != torch.float32 or scratch.numel() < need:
        raise ValueError(
            f"lora_apply: scratch must be 1-D float32 with >= {need} elements for T={num_tokens}, "
            f"P*R={n}, K={k} (see lora_scratch); got {scratch.dtype} {tuple(scratch.shape)}"
        )
    planes = scratch[:need].view(split_k, num_tokens, n)
    lora_shrink(x, lora_a, planes, sorted_token_ids, slot_starts, slot_counts)
    lora_expand(
        planes, lora_b, y, sorted_token_ids, slot_starts, slot_counts, part_starts, part_rows, n // num_parts
    )


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
