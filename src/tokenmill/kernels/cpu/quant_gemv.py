"""The quantized one-row (to four-row) matmul's op wrapper: GGUF Q4_1 / Q8_0 blocks in the C++
kernel's layout (csrc/cpu_quant_gemv.cpp), times float32 activations. The layer method that uses it
is model/layers/quantized_linear.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


# Steps of up to `rows_limit()` rows use the blocks. With AVX-512 the kernel dequantizes each block
# once for up to 4 rows, which is most of its work: a 3072 x 576 Q4_1 matmul on one core took 325 /
# 406 / 486 / 591 us for 1-4 rows against ~820 us for the float32 oneDNN path at any of those, and
# 1112 against 952 at 8 rows (BENCHMARKS.md). An AVX2 build serves one row; a scalar one none.
@functools.cache
def rows_limit() -> int:
    """Rows a step may have to use the blocks on this build of the kernels (0: never)."""
    return int(torch.ops.tokenmill_cpu.quant_gemv_rows())


# Rows the integer-activation few-row kernel (quant_gemv_int8, blocks.vnni) takes; more go to the
# batched 16-bit kernel. The few-row kernel loops over the rows with a chunk of weight rows in cache;
# the batched one first unpacks every weight into panels, a cost it pays at any row count up to its
# 8-row group. On AVX2 (AMD Zen 3, one thread, SmolLM2-135M's shapes) the loop took 0.36-0.7x the
# batched kernel's time at 2-4 rows (gate_up 104 / 220 us against 291 / 447 at 2 / 4 rows), and the
# two crossed at 5-6 rows; AVX-512 VNNI builds take 4 rows here too (rows_limit()).
INT8_FEW_ROWS = 4


def int8_rows_limit() -> int:
    """Rows a product may have to use the integer-activation few-row kernel (where blocks.vnni is set)."""
    return max(rows_limit(), INT8_FEW_ROWS)


def blocks_rows_limit(gemm_rows: int) -> int:
    """Rows a step may have to use the blocks at all: the one-row kernel's limit, or `gemm_rows`
    where the batched kernel exists and is asked for (KernelConfig.cpu_quantized_gemm_rows)."""
    return max(rows_limit(), gemm_rows if gemm_rows > 0 and gemm_available() else 0)


# Bytes of one block of 32 weights and, at its start, of its float16 scales (d; d and m for Q4_1).
_BLOCK_BYTES = {0: 20, 1: 34}  # kernel code -> bytes: Q4_1, Q8_0
_SCALE_BYTES = {0: 4, 1: 2}


@dataclass(frozen=True, slots=True)
class QuantizedBlocks:
    # uint8 [out_features, row_bytes] in the float kernels' layout (split_rows); None where the
    # integer-activation kernels serve every row count from `vnni` (AVX-512 VNNI builds), so the
    # float kernels never read it (92 MiB for the default model).
    blocks: torch.Tensor | None
    quant_type: int  # the kernel's code: 0 = Q4_1, 1 = Q8_0
    out_features: int
    # The same blocks in the quantized-activation kernel's layout (quant_gemv_int8.vnni_rows), when
    # that kernel serves the few-row products (KernelConfig.cpu_activation_bits, AVX-512 VNNI or AVX2 builds),
    # and the bits it quantizes the activations to (8 or 16).
    vnni: torch.Tensor | None = None
    activation_bits: int = 16


def split_rows(rows: np.ndarray, quant_type: int) -> np.ndarray:
    """GGUF block rows [N, blocks * block_bytes] -> the kernel's layout: per row, every block's
    quants, then every block's d (then every block's m, for Q4_1); same size, a new array."""
    n = rows.shape[0]
    block_bytes, scale_bytes = _BLOCK_BYTES[quant_type], _SCALE_BYTES[quant_type]
    blocks = rows.reshape(n, -1, block_bytes)
    scales = blocks[:, :, :scale_bytes].reshape(n, -1, scale_bytes // 2, 2).swapaxes(1, 2)
    return np.concatenate([blocks[:, :, scale_bytes:].reshape(n, -1), scales.reshape(n, -1)], axis=1)


@functools.cache
def gemm_available() -> bool:
    """Whether this build has the batched kernel (csrc/cpu_quant_gemm.cpp: AVX-512 or AVX2+FMA)."""
    return bool(torch.ops.tokenmill_cpu.quant_gemm_available())


@functools.cache
def gemm_vnni16_available() -> bool:
    """Whether this build has the batched 16-bit-activation kernel: the CPU it was built on
    (-march=native) has AVX-512 VNNI (csrc/cpu_quant_gemm_vnni.cpp) or AVX2 + FMA + F16C
    (csrc/cpu_quant_gemm_int16_avx2.cpp). It reads the few-row kernel's layout
    (QuantizedBlocks.vnni), so it serves layers that have that layout."""
    return bool(torch.ops.tokenmill_cpu.quant_gemm_vnni16_available())


@functools.cache
def gemm_isa() -> str:
    """The batched kernel's path in this build: "avx512", "avx2" or "" (none)."""
    return str(torch.ops.tokenmill_cpu.quant_gemm_isa())


# Rows without limit: every product, prefill chunks included.
ALL_ROWS = 1 << 62


def prefill_rows_limit(gemm_rows: int, integer_activations: bool = False) -> int:
    """`gemm_rows` (KernelConfig.cpu_quantized_gemm_rows), raised to every row count where this
    build's batched kernel also beats oneDNN's float32 product on prefill chunks: its AVX2+FMA
    path (AMD Zen 3, one thread: 1.09-1.32x per matmul at 128 and 512 rows over SmolLM2-135M's
    shapes, a 512-token prefill step 7-10 % less CPU; docs/CPU_PERFORMANCE.md), and the AVX-512
    VNNI 16-bit kernel where the layers get its layout (`integer_activations`: AMD Zen 4, one
    thread: 1.2-1.6x oneDNN at 64-512 rows). The float AVX-512 path keeps oneDNN above
    `gemm_rows` (oneDNN was the faster there). 0 stays 0 (kernel off)."""
    if gemm_rows <= 0 or not gemm_available():
        return gemm_rows
    if integer_activations and gemm_vnni16_available():
        return ALL_ROWS
    return ALL_ROWS if gemm_isa() == "avx2" else gemm_rows


@functools.cache
def _linear_vnni16() -> torch._ops.OpOverload:
    return torch.ops.tokenmill_cpu.quant_linear_vnni16.default


@functools.cache
def _gemm_float() -> torch._ops.OpOverload:
    return torch.ops.tokenmill_cpu.quant_gemm.default


@functools.cache
def _linear_int8() -> torch._ops.OpOverload:
    # The resolved overload: calling it skips the packet's overload lookup (~2 us of a decode
    # step's ~120 products each).
    return torch.ops.tokenmill_cpu.quant_linear_int8.default


def quantized_linear(x: torch.Tensor, blocks: QuantizedBlocks, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 @ dequant(blocks)^T (+ bias) -> float32 [M, out_features]: the one-row
    kernel up to rows_limit() rows (its quantized-activation form where `blocks.vnni` is set), the
    batched one (dequantize once, panel x rows) above (on AVX-512 VNNI builds, with `blocks.vnni`,
    its 16-bit-activation form)."""
    few_rows = x.shape[0] <= (int8_rows_limit() if blocks.vnni is not None else rows_limit())
    if blocks.vnni is not None and (few_rows or gemm_vnni16_available()):
        if few_rows:
            # The hot decode path: the kernel allocates its output (no torch.empty from Python).
            out = _linear_int8()(x.contiguous(), blocks.vnni, blocks.quant_type, blocks.activation_bits)
        else:
            # Batched rows (AVX-512 VNNI or AVX2): 16-bit activations and integer products, as the
            # few-row kernel at 16 bits (any activation_bits: 8 is for the few-row kernel's speed only).
            out = _linear_vnni16()(x.contiguous(), blocks.vnni, blocks.quant_type)
    elif blocks.blocks is None:
        raise RuntimeError(
            f"these GGUF blocks have only the integer-activation layout, which this build cannot multiply "
            f"[{x.shape[0]} rows] with (rows_limit() = {rows_limit()}, VNNI batched kernel: {gemm_vnni16_available()})"
        )
    else:
        out = torch.empty((x.shape[0], blocks.out_features), dtype=torch.float32)
        if few_rows:
            torch.ops.tokenmill_cpu.quant_gemv(out, x.contiguous(), blocks.blocks, blocks.quant_type)
        else:
            _gemm_float()(out, x.contiguous(), blocks.blocks, blocks.quant_type)
    if bias is not None:
        out += bias
    return out
