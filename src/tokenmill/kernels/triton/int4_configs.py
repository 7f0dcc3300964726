"""Tile configurations of the W4A16 kernel (int4_kernel.py) by matmul shape.

Decode sizes (a few rows) are a weight read: the tile must leave enough programs to keep every
SM streaming, which few output columns cannot do alone, so K is split among programs (split-K).
Prefill sizes are tensor-core bound: big tiles, one program per output tile.
"""

from __future__ import annotations

import dataclasses
import functools

from tokenmill.kernels.triton.int4_pack import COUNTER_ROWS, N_ALIGN, PACK_K

MAX_SPLIT_K_ROWS = COUNTER_ROWS  # the tile counters of Int4Weights are sized for this many rows


@dataclasses.dataclass(frozen=True, slots=True)
class Int4Config:
    block_m: int  # rows of x per program (>= 16: tl.dot's smallest side)
    block_n: int  # output features per program: 16, 32, 64 or 128 (divides int4_pack.N_ALIGN)
    split_k: int = 1  # programs sharing one output tile's K range
    num_warps: int = 4
    num_stages: int = 4
    scale_after: bool = True  # scale per-group partial sums in float32 (else scale weights in 16-bit)
    # Weights as the dot's left operand (wgmma once a warpgroup has 64 of them, mma.sync below), else
    # right (mma.sync for block_m < 64).
    w_left: bool = True
    asm_dequant: bool = True  # on CUDA: unpack with inline PTX (else the interpreter's plain Triton)
    # Zero points through sum(x) (int4_kernel.py ZERO_BY_XSUM); needs scale_after and w_left.
    zero_by_xsum: bool = False
    dequantize: bool = False  # dequantize the whole weight to 16 bits and use cuBLAS (tiles unused)

    def check(self) -> None:
        if self.block_n not in (16, 32, 64, 128) or N_ALIGN % self.block_n:
            raise ValueError(f"Int4Config.block_n must be 16, 32, 64 or 128, got {self.block_n}")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"Int4Config.block_m must be a power of two >= 16, got {self.block_m}")
        if self.split_k < 1:
            raise ValueError(f"Int4Config.split_k must be >= 1, got {self.split_k}")
        if self.zero_by_xsum and not (self.scale_after and self.w_left):
            raise ValueError("Int4Config.zero_by_xsum needs scale_after and w_left")


def block_m_for(m: int) -> int:
    return max(16, 1 << (max(m, 1) - 1).bit_length())


@functools.cache
def _num_sms(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Beyond this many rows: dequantize + cuBLAS. On an H100 (benchmarks/results/int4-linear-microbench-*)
# the fused kernel won at 128 rows on 3 of Llama-3.1-8B's 4 shapes and lost on all at 512.
MAX_FUSED_ROWS = 256


def int4_config(m: int, n: int, k: int, num_sms: int = 132) -> Int4Config:
    """The config for x [m, k] times an INT4 [n, k] weight on a GPU with `num_sms` SMs: the best of
    the microbenchmark's sweep on an H100 at Llama-3.1-8B's shapes, as rules.

    Tiles keep 32 weight rows per warp (with 16, Triton re-loads the scales outside its software
    pipeline); up to 32 rows of x, two warps on 64 weight rows (mma.sync, no waits between the
    per-plane dots); K is split until there are about two programs per SM (64 rows: about 0.7, the
    tiles being four times larger)."""
    if m > MAX_FUSED_ROWS:
        return Int4Config(128, 128, dequantize=True)
    if m > MAX_SPLIT_K_ROWS:
        return Int4Config(64, 128, 1, num_warps=4, num_stages=4)
    block_m = block_m_for(m)
    if block_m == 64:
        return Int4Config(64, 128, _split_k(m, n, k, 64, 128, 0.7 * num_sms), num_warps=4, num_stages=4)
    if block_m == 32 and -(-n // 64) >= 2 * num_sms:  # wide (gate_up): tiles enough, 4 warps on 128 rows
        return Int4Config(32, 128, 1, num_warps=4, num_stages=4, w_left=False)
    if m == 1:
        return _one_row_config(n, k, num_sms)
    return Int4Config(block_m, 64, _split_k(m, n, k, block_m, 64, 1.9 * num_sms), num_warps=2, num_stages=4)


def _one_row_config(n: int, k: int, num_sms: int) -> Int4Config:
    """One row (a single request decoding) has the least work per weight tile, and an H200 sweep
    (int4-linear-sweep-h200.json, int4-linear-sweep2-h200.json) took twice the programs where K
    is split at all:
    split 8 for down (13.94 / 14.05 against 15.31 / 15.32 us split 4) and qkv (8.77 against 9.47,
    with 2 stages), o_proj 7.48 against 7.57. A split of at most two packs runs 2 stages: a deeper
    pipeline only loads past its end (qkv split 8 with 4 stages: 11.86 us)."""
    split_k = _split_k(1, n, k, 16, 64, 1.9 * num_sms)
    if split_k > 1:  # too few tiles (not gate_up: split 2 there, 27.42 against 25.00 us unsplit)
        split_k = _split_k(1, n, k, 16, 64, 3.8 * num_sms)
    num_packs = -(-k // PACK_K)
    packs_per_split = -(-num_packs // split_k)
    return Int4Config(16, 64, split_k, num_warps=2, num_stages=2 if packs_per_split <= 2 else 4)


def _split_k(m: int, n: int, k: int, block_m: int, block_n: int, min_programs: float) -> int:
    """Split K until there are `min_programs` programs, each streaming at least two packs of K."""
    tiles = -(-n // block_n) * -(-m // block_m)
    num_packs = -(-k // PACK_K)
    split_k = 1
    while tiles * split_k < min_programs and split_k < 8 and num_packs // (2 * split_k) >= 2:
        split_k *= 2
    return split_k


def device_sms(device) -> int:
    """Multiprocessor count of a CUDA device (cached); an H100's for the CPU (the interpreter)."""
    if device.type != "cuda":
        return 132
    import torch

    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


__all__ = ["MAX_FUSED_ROWS", "MAX_SPLIT_K_ROWS", "Int4Config", "block_m_for", "device_sms", "int4_config"]
