"""Round-to-nearest quantizers of a float weight [N, K] into the canonical FP8 and INT4 forms, and
the dequantizers that give the float weight back. Torch code for any device.

The canonical forms are what every quantized checkpoint is unpacked to (loader/int4_checkpoint.py
for AWQ / GPTQ; FP8 checkpoints are already in it) and what the kernels' `prepare_*_weights` take:

- FP8: `weight` float8_e4m3fn [N, K] and float32 `weight_scale`, per-tensor [1], per-channel [N],
  or per (bn, bk) block [ceil(N/bn), ceil(K/bk)] (the last row / column of blocks may be partial).
  W = weight.float() * scale, the scale broadcast over its row or tile.
- INT4: `q` uint8 [N, K] in 0..15, 16-bit `scales` [N, G], uint8 `zeros` [N, G] in 0..15, and
  int32 `g_idx` [K], the group of each input column (k // group_size unless act-order permuted it).
  W[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]].

`--quantization fp8` quantizes a 16-bit checkpoint at load with these, and the tests build their
quantized checkpoints from them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT4_MAX = 15


class QuantizedFp8(NamedTuple):
    """Fields in the order `prepare_fp8_weights(weight, weight_scale, block)` takes them."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # float32 [1] | [N] | [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] | None  # (bn, bk) for block scales, else None


class QuantizedInt4(NamedTuple):
    """Fields in the order `prepare_int4_weights(q, scales, zeros, group_size, g_idx)` takes them."""

    q: torch.Tensor  # uint8 [N, K], 0..15
    scales: torch.Tensor  # 16-bit [N, G]
    zeros: torch.Tensor  # uint8 [N, G], 0..15 (8 for symmetric)
    group_size: int  # input columns per group (K for one group per row)
    g_idx: torch.Tensor  # int32 [K], the group of each input column


# ----------------------------------------------------------------------------------------------- FP8


def _fp8_scale(absmax: torch.Tensor) -> torch.Tensor:
    """absmax / 448 in float32; an all-zero row or tile gets scale 1 (any scale dequantizes zeros to
    zero, and 1 keeps 1/scale finite for kernels that divide)."""
    absmax = absmax.float()
    return torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    """Round to nearest e4m3, saturating: the cast would turn anything past +-448 into NaN."""
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_matrix(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what} takes a weight [out_features, in_features]; got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{what} takes a float weight; got {w.dtype}")


def quantize_fp8_per_tensor(w: torch.Tensor) -> QuantizedFp8:
    """One float32 scale [1] for the whole weight."""
    _check_matrix(w, "quantize_fp8_per_tensor")
    scale = _fp8_scale(w.abs().amax()).reshape(1)
    return QuantizedFp8(_to_fp8(w.float() / scale), scale, None)


def quantize_fp8_per_channel(w: torch.Tensor, row_absmax: torch.Tensor | None = None) -> QuantizedFp8:
    """One float32 scale per output row, [N]. `row_absmax` [N]: each row's absmax over more columns
    than `w` holds (a tensor-parallel shard of the input columns quantized as the whole row is)."""
    _check_matrix(w, "quantize_fp8_per_channel")
    scale = _fp8_scale(w.abs().amax(dim=1) if row_absmax is None else row_absmax)
    return QuantizedFp8(_to_fp8(w.float() / scale[:, None]), scale, None)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> QuantizedFp8:
    """One float32 scale per (bn, bk) tile, [ceil(N/bn), ceil(K/bk)]; the tiles of the last rows and
    columns may be partial (their scale is the absmax of the part that exists)."""
    _check_matrix(w, "quantize_fp8_block")
    bn, bk = _check_block(block)
    n, k = w.shape
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    # Zero padding to whole tiles changes no absmax.
    padded = torch.nn.functional.pad(w.float().abs(), (0, cols * bk - k, 0, rows * bn - n))
    scale = _fp8_scale(padded.view(rows, bn, cols, bk).amax(dim=(1, 3)))
    return QuantizedFp8(_to_fp8(w.float() / _expand_block_scale(scale, (bn, bk), n, k)), scale, (bn, bk))


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) != b or b <= 0 for b in block):
        raise ValueError(f"an FP8 block is two positive integers (rows, columns); got {block!r}")
    return int(block[0]), int(block[1])


def _expand_block_scale(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales [rows, cols] repeated over their tiles and cut to [n, k]."""
    return scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]


def dequantize_fp8(
    weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """The float32 weight [N, K] of a canonical FP8 weight. `weight_scale` is per-tensor (one
    element), per-channel ([N] or [N, 1]) or, with `block`, [ceil(N/bn), ceil(K/bk)]."""
    n, k = weight.shape
    scale = weight_scale.float()
    if block is not None:
        bn, bk = _check_block(block)
        expected = (math.ceil(n / bn), math.ceil(k / bk))
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"FP8 block scales of a [{n}, {k}] weight with block ({bn}, {bk}) have shape {expected}; "
                f"got {tuple(scale.shape)}"
            )
        return weight.float() * _expand_block_scale(scale, (bn, bk), n, k)
    if scale.numel() == 1:
        return weight.float() * scale.reshape(())
    if tuple(scale.shape) in ((n,), (n, 1)):
        return weight.float() * scale.reshape(n, 1)
    raise ValueError(
        f"FP8 scales of a [{n}, {k}] weight are per-tensor [1], per-channel [{n}] or [{n}, 1], or "
        f"per block (pass block=); got shape {tuple(scale.shape)}"
    )


# ---------------------------------------------------------------------------------------------- INT4


def default_g_idx(k: int, group_size: int, device=None) -> torch.Tensor:
    """The group of each of `k` input columns without act-order: k // group_size, int32."""
    return (torch.arange(k, device=device) // group_size).to(torch.int32)


def num_int4_groups(k: int, group_size: int) -> int:
    """Groups per row: ceil(k / group_size); group_size -1 (as GPTQ writes it) means one group."""
    if group_size == -1:
        return 1
    if group_size <= 0:
        raise ValueError(f"an INT4 group size is a positive number of input columns or -1; got {group_size}")
    return math.ceil(k / group_size)


def quantize_int4(
    w: torch.Tensor,
    group_size: int,
    symmetric: bool,
    *,
    g_idx: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedInt4:
    """Round-to-nearest 4-bit quantization of `w` [N, K] in groups of input columns.

    Each group's range includes 0 (as GPTQ's quantizer does), so q never clamps by more than half a
    step and |W - dequantized| <= scale / 2 everywhere. Symmetric: scale = 2 * absmax / 15 and
    zero 8 (GPTQ's sym); asymmetric: scale = (max - min) / 15, zero = round(-min / scale) in 0..15.
    `g_idx` [K] assigns columns to groups (act-order checkpoints shuffle it); by default column k is
    in group k // group_size. Scales are stored in `scale_dtype` and rounded up into it, so the bound
    holds for the stored scale; an all-zero group gets the smallest normal scale."""
    _check_matrix(w, "quantize_int4")
    n, k = w.shape
    num_groups = num_int4_groups(k, group_size)
    group_size = k if group_size == -1 else group_size
    if g_idx is None:
        g_idx = default_g_idx(k, group_size, device=w.device)
    check_g_idx(g_idx, k, num_groups, "g_idx")
    w = w.float()
    columns = g_idx.long().expand(n, k)
    # Starting from zeros puts 0 inside every group's range.
    gmax = w.new_zeros(n, num_groups).scatter_reduce(1, columns, w, "amax")
    gmin = w.new_zeros(n, num_groups).scatter_reduce(1, columns, w, "amin")
    if symmetric:
        scale = torch.maximum(gmax, -gmin) * (2 / INT4_MAX)
    else:
        scale = (gmax - gmin) / INT4_MAX
    info = torch.finfo(scale_dtype)
    # Inflating by one epsilon before rounding to the 16-bit dtype keeps the stored scale >= the exact
    # one, so no value lands outside 0..15 by more than the half step the bound allows.
    stored = (scale * (1 + info.eps)).clamp(min=info.tiny).to(scale_dtype)
    s = stored.float()
    if symmetric:
        zeros = torch.full_like(s, 8.0)
    else:
        zeros = torch.round(-gmin / s).clamp(0, INT4_MAX)
    q = torch.round(w / s.gather(1, columns)) + zeros.gather(1, columns)
    q = q.clamp(0, INT4_MAX).to(torch.uint8)
    return QuantizedInt4(q, stored, zeros.to(torch.uint8), group_size, g_idx.to(torch.int32))


def check_g_idx(g_idx: torch.Tensor, k: int, num_groups: int, name: str) -> None:
    """g_idx must be [K] integers in 0..G-1 (a value check: load time only, never in a graph)."""
    if tuple(g_idx.shape) != (k,) or g_idx.is_floating_point():
        raise ValueError(
            f"{name} holds the group of each of the {k} input columns: int [{k}]; got "
            f"{g_idx.dtype} {tuple(g_idx.shape)}"
        )
    if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
        raise ValueError(
            f"{name} names groups {int(g_idx.min())}..{int(g_idx.max())}, but there are {num_groups} "
            f"groups (0..{num_groups - 1})"
        )


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, g_idx: torch.Tensor
) -> torch.Tensor:
    """The float32 weight [N, K] of a canonical INT4 weight:
    W[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]."""
    n, k = q.shape
    num_groups = num_int4_groups(k, group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n, num_groups):
            raise ValueError(
                f"INT4 {name} of a [{n}, {k}] weight in groups of {group_size} have shape "
                f"[{n}, {num_groups}]; got {list(t.shape)}"
            )
    if tuple(g_idx.shape) != (k,):
        raise ValueError(f"INT4 g_idx of a [{n}, {k}] weight has shape [{k}]; got {list(g_idx.shape)}")
    columns = g_idx.long().expand(n, k)
    return (q.float() - zeros.float().gather(1, columns)) * scales.float().gather(1, columns)
