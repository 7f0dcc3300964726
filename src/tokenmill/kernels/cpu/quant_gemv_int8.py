"""The int8-activation one-to-four-row kernel's weight layout (csrc/cpu_quant_gemv_int8.cpp), made
once at load from the GGUF's Q4_1 / Q8_0 block rows, and whether this build has the kernel (AVX-512
VNNI or AVX2: one layout for both)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from tokenmill.kernels.cpu.quant_gemv import split_rows


@functools.cache
def int8_available() -> bool:
    """Whether this build has the kernel: AVX-512 VNNI, or AVX2 (the CPU's flags, -march=native)."""
    return bool(torch.ops.tokenmill_cpu.quant_gemv_int8_available())


@functools.cache
def int8_isa() -> str:
    """The instructions this build's kernel uses: "avx512_vnni", "avx2", or "" (no kernel)."""
    return str(torch.ops.tokenmill_cpu.quant_gemv_int8_isa())


def _chunks(num_blocks: int) -> list[tuple[int, int]]:
    """(first block, blocks) of each chunk: 4 at a time, then 2 and / or 1 for the remainder."""
    chunks, start = [], 0
    while start < num_blocks:
        left = num_blocks - start
        size = 4 if left >= 4 else (2 if left >= 2 else 1)
        chunks.append((start, size))
        start += size
    return chunks


def _weights(rows: np.ndarray, quant_type: int) -> np.ndarray:
    """GGUF block rows [N, blocks * block_bytes] -> the quants [N, blocks, 32] (uint8 0..15 for
    Q4_1, int16 -128..127 for Q8_0), in weight order."""
    n = rows.shape[0]
    if quant_type == 0:
        qs = rows.reshape(n, -1, 20)[:, :, 4:]
        return np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return rows.reshape(n, -1, 34)[:, :, 2:].view(np.int8).astype(np.int16)


def vnni_rows(rows: np.ndarray, quant_type: int) -> np.ndarray:
    """GGUF block rows [N, blocks * block_bytes] -> the int8 kernel's layout, same size: per row the
    chunks' quants in sequence order (4-byte groups interleaved across the chunk's blocks; Q4_1
    nibble-packed first half low / second half high, Q8_0 as q + 128), then the float16 scales as
    split_rows leaves them."""
    n = rows.shape[0]
    quants = _weights(rows, quant_type)
    num_blocks = quants.shape[1]
    parts = []
    for start, size in _chunks(num_blocks):
        chunk = quants[:, start : start + size].reshape(n, size, 8, 4)  # block, group, byte
        # 4-byte group g of the sequence = group g // size of block g % size
        seq = chunk.transpose(0, 2, 1, 3).reshape(n, 32 * size)
        if quant_type == 0:
            half = 16 * size
            parts.append((seq[:, :half] | (seq[:, half:] << 4)).astype(np.uint8))
        else:
            parts.append((seq + 128).astype(np.uint8))
    quant_bytes = num_blocks * (16 if quant_type == 0 else 32)
    scales = split_rows(rows, quant_type)[:, quant_bytes:]
    return np.ascontiguousarray(np.concatenate([*parts, scales], axis=1))
