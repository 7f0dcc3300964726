"""Greedy sampling on the GPU in two short launches: argmax and a non-finite check per row.

`logits.argmax(-1)` gives a single row to a single thread block: at batch 1 with a 128K vocabulary
it took 39 us on an H200, plus 14 us for the `isfinite(logits.sum(-1))` check the runner needs,
out of a 4.7 ms decode step. Here many programs each reduce a slice of a row (max, first index of
the max, count of non-finite values), then one program per row combines the slices and writes
the runner's [2, rows] result (sampled ids, non-finite flags) directly.

Ties go to the lowest index, as torch.argmax does. A row with NaN or inf is flagged; its id is
then meaningless (the runner ends that request with an error).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per slice


@triton.jit
def _slice_argmax_kernel(
    logits_ptr,
    stride_row,
    vocab_size,
    slice_max_ptr,
    slice_idx_ptr,
    slice_bad_ptr,
    num_slices,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < vocab_size
    x = tl.load(logits_ptr + row * stride_row + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    finite = tl.abs(x) < float("inf")  # false for NaN and +-inf
    num_bad = tl.sum((in_row & ~finite).to(tl.int32), axis=0)
    x = tl.where(finite, x, float("-inf"))
    best = tl.max(x, axis=0)
    # First index holding the max (tl.argmax's tie-breaking is not documented as stable).
    first = tl.min(tl.where(x == best, cols, vocab_size), axis=0)
    out = row * num_slices + part
    tl.store(slice_max_ptr + out, best)
    tl.store(slice_idx_ptr + out, first)
    tl.store(slice_bad_ptr + out, num_bad)


# The row count changes with every batch size: not specialized on, so 1 row, 16 and others share
# one compile (the grid carries the rows; the argument only offsets the flags' row).
@triton.jit(do_not_specialize=["num_rows"])
def _combine_slices_kernel(
    slice_max_ptr,
    slice_idx_ptr,
    slice_bad_ptr,
    out_ptr,
    num_rows,
    num_slices,
    vocab_size,
    SLICES_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, SLICES_PAD)
    valid = parts < num_slices
    base = row * num_slices
    best = tl.load(slice_max_ptr + base + parts, mask=valid, other=float("-inf"))
    idx = tl.load(slice_idx_ptr + base + parts, mask=valid, other=vocab_size)
    bad = tl.load(slice_bad_ptr + base + parts, mask=valid, other=0)
    top = tl.max(best, axis=0)
    # Slices hold increasing index ranges: the smallest index among the maxima is the first one.
    token = tl.min(tl.where(best == top, idx, vocab_size), axis=0)
    token = tl.where(token >= vocab_size, 0, token)  # every value non-finite: flagged below
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(out_ptr + num_rows + row, (tl.sum(bad, axis=0) > 0).to(tl.int64))


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits -> int64 [2, rows]: the argmax of each row, then 1 where the row has a
    NaN or inf (0 otherwise)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    out = torch.empty((2, num_rows), dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_slices = triton.cdiv(vocab_size, BLOCK)
    slice_max = torch.empty((num_rows, num_slices), dtype=torch.float32, device=logits.device)
    slice_idx = torch.empty((num_rows, num_slices), dtype=torch.int32, device=logits.device)
    slice_bad = torch.empty((num_rows, num_slices), dtype=torch.int32, device=logits.device)
    _slice_argmax_kernel[(num_rows, num_slices)](
        logits, logits.stride(0), vocab_size, slice_max, slice_idx, slice_bad, num_slices, BLOCK=BLOCK,
        num_warps=8,
    )  # fmt: skip
    _combine_slices_kernel[(num_rows,)](
        slice_max, slice_idx, slice_bad, out, num_rows, num_slices, vocab_size,
        SLICES_PAD=triton.next_power_of_2(num_slices), num_warps=1,
    )  # fmt: skip
    return out
