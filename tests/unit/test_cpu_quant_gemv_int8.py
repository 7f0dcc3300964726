"""The quantized-activation few-row kernel (csrc/cpu_quant_gemv_int8.cpp, 8- and 16-bit activations)
against a float64 reference: exact where the activations are already integers of that width per
block, within the activations' rounding bound else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from tests.unit.test_cpu_quant_gemv import TYPES, random_blocks
from tokenmill.kernels.cpu.build import cpu_kernels_available
from tokenmill.kernels.cpu.quant_gemv import QuantizedBlocks, quantized_linear, rows_limit, split_rows

pytestmark = pytest.mark.skipif(not cpu_kernels_available()[0], reason="the CPU kernels cannot be built here")

SHAPES = [
    (1, 32, 1),
    (5, 64, 1),
    (3, 96, 2),
    (7, 224, 1),
    (300, 576, 1),
    (65, 576, 3),
    (192, 1536, 4),
    (9, 288, 1),
]
# K = 32..288 blocks: chunks of 4 plus every remainder (1, 2, 3 = 2 + 1); m up to the 4 rows served.


def _int8_kernel():
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_available

    if not int8_available():
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI or AVX2")
    return torch.ops.tokenmill_cpu.quant_gemv_int8


def _scaled_quants(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """|d * q| per weight [n, k] float64: what multiplies the activations' rounding error."""
    n = rows.shape[0]
    if qtype == GGMLQuantizationType.Q4_1:
        blocks = rows.reshape(n, -1, 20)
        d = blocks[:, :, :2].copy().view(np.float16).astype(np.float64)
        q = np.concatenate([blocks[:, :, 4:] & 15, blocks[:, :, 4:] >> 4], axis=2).astype(np.float64)
    else:
        blocks = rows.reshape(n, -1, 34)
        d = blocks[:, :, :2].copy().view(np.float16).astype(np.float64)
        q = blocks[:, :, 2:].copy().view(np.int8).astype(np.float64)
    return np.abs(d * q).reshape(n, -1)


def _vnni_blocks(rows: np.ndarray, code: int, n: int, bits: int = 8) -> QuantizedBlocks:
    from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows

    return QuantizedBlocks(
        torch.from_numpy(split_rows(rows, code)), code, n, torch.from_numpy(vnni_rows(rows, code)), bits
    )


BITS = [8, 16]
LEVELS = {8: 127, 16: 32767}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, m", SHAPES)
def test_exact_when_activations_are_integers(bits: int, name: str, n: int, k: int, m: int) -> None:
    """Activations that are integers with a +-127 (+-32767) in every block quantize without error:
    the result must then be the float product (up to float32 summation), which checks the layouts."""
    kernel = _int8_kernel()
    qtype, code = TYPES[name]
    rng = np.random.default_rng(7 * n + k + m)
    rows = random_blocks(rng, qtype, n, k)
    weight = torch.from_numpy(dequantize(rows, qtype).astype(np.float64))
    levels = LEVELS[bits]
    x = torch.from_numpy(rng.integers(-levels, levels + 1, size=(m, k)).astype(np.float32))
    x.view(m, -1, 32)[:, :, 0] = float(levels)
    out = torch.full((m, n), float("nan"))
    kernel(out, x, _vnni_blocks(rows, code, n).vnni, code, bits)
    expected = x.double() @ weight.t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, m", SHAPES)
def test_error_within_the_activation_rounding_bound(bits: int, name: str, n: int, k: int, m: int) -> None:
    kernel = _int8_kernel()
    qtype, code = TYPES[name]
    rng = np.random.default_rng(n * 1000 + k + m)
    rows = random_blocks(rng, qtype, n, k)
    weight = torch.from_numpy(dequantize(rows, qtype).astype(np.float64))
    torch.manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, dtype=torch.float64).float()
    bias = torch.randn(n)
    if m <= rows_limit():  # through the layer's wrapper, bias included
        out = quantized_linear(x, _vnni_blocks(rows, code, n, bits), bias)
    else:  # (AVX2 builds send more than one row elsewhere; the kernel itself takes up to 4)
        out = torch.empty(m, n)
        kernel(out, x, _vnni_blocks(rows, code, n).vnni, code, bits)
        out += bias
    expected = x.double() @ weight.t() + bias.double()
    # Each activation moves by at most d_x / 2 (d_x = its block's max |x| / 127 or 32767); the Q4_1
    # offset m * sum(x) is exact. Plus float32 rounding of the sums.
    steps = x.double().view(m, -1, 32).abs().amax(dim=2, keepdim=True) / (2 * LEVELS[bits])
    half_step = steps.expand(m, k // 32, 32)
    bound = half_step.reshape(m, k) @ torch.from_numpy(_scaled_quants(rows, qtype)).t()
    error = (out.double() - expected).abs()
    assert (error <= bound * 1.001 + 1e-5 * expected.abs().max()).all(), (error - bound).max()


def test_refuses_bad_shapes_naming_them() -> None:
    kernel = _int8_kernel()
    rng = np.random.default_rng(0)
    blocks = _vnni_blocks(random_blocks(rng, GGMLQuantizationType.Q4_1, 4, 64), 0, 4).vnni
    with pytest.raises(RuntimeError, match="K = 96 needs"):
        kernel(torch.empty(1, 4), torch.randn(1, 96), blocks, 0, 8)
    with pytest.raises(RuntimeError, match=r"out must be \[1, 4\]"):
        kernel(torch.empty(1, 5), torch.randn(1, 64), blocks, 0, 8)
    with pytest.raises(RuntimeError, match="quant_type must be 0"):
        kernel(torch.empty(1, 4), torch.randn(1, 64), blocks, 3, 8)
    with pytest.raises(RuntimeError, match="bits .* must be 8 or 16, got 4"):
        kernel(torch.empty(1, 4), torch.randn(1, 64), blocks, 0, 4)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", TYPES)
def test_non_finite_activations_reach_the_output(bits: int, name: str) -> None:
    """As with float activations: a NaN or inf in a row makes that row's outputs non-finite (the
    sampler refuses such logits) instead of being quantized away."""
    kernel = _int8_kernel()
    qtype, code = TYPES[name]
    rows = random_blocks(np.random.default_rng(3), qtype, 8, 128)
    x = torch.randn(3, 128)
    x[0, 40], x[2, 100] = float("nan"), float("inf")
    out = torch.empty(3, 8)
    kernel(out, x, _vnni_blocks(rows, code, 8).vnni, code, bits)
    assert not torch.isfinite(out[0]).any() and not torch.isfinite(out[2]).any()
    assert torch.isfinite(out[1]).all()


def _quantize_like_the_kernel(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization in numpy (float32, round half to even like lrintf):
    per block of 32, d_x = max|x| / levels and q = rint(x * (levels / max|x|)). Returns q [m, k]
    (float64 of integers) and d_x [m, k // 32] (float32)."""
    levels = np.float32(LEVELS[bits])
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, levels / amax, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(blocks * inverse, -levels, levels))
    return q.reshape(x.shape).astype(np.float64), (amax[:, :, 0] / levels).astype(np.float32)


def _dequantized_parts(rows: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(integer quants [n, k], d [n, blocks], m [n, blocks] or zeros) of GGUF rows, float64."""
    n = rows.shape[0]
    if qtype == GGMLQuantizationType.Q4_1:
        blocks = rows.reshape(n, -1, 20)
        d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
        mins = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
        q = np.concatenate([blocks[:, :, 4:] & 15, blocks[:, :, 4:] >> 4], axis=2).astype(np.float64)
    else:
        blocks = rows.reshape(n, -1, 34)
        d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
        mins = np.zeros_like(d)
        q = blocks[:, :, 2:].copy().view(np.int8).astype(np.float64)
    return q.reshape(n, -1), d, mins


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, m", SHAPES)
def test_equals_the_same_integer_math_in_numpy(bits: int, name: str, n: int, k: int, m: int) -> None:
    """Random float activations: the kernel (whichever instructions this build uses: AVX-512 VNNI
    or AVX2) equals numpy doing the same quantization and exact integer block dot products, up to
    float32 summation, for every row count it takes (1-4). A saturating or mis-ordered integer
    product, or a scale applied to the wrong block, moves results far beyond that."""
    kernel = _int8_kernel()
    qtype, code = TYPES[name]
    rng = np.random.default_rng(31 * n + k + 7 * m + bits)
    rows = random_blocks(rng, qtype, n, k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, size=(m, k // 32)).repeat(32, axis=1)).astype(np.float32)
    q_x, d_x = _quantize_like_the_kernel(x, bits)
    q_w, d_w, m_w = _dequantized_parts(rows, qtype)
    # Per (row, output, block): the integer dot product, exact in float64 (|sum| < 2^53).
    int_dots = np.einsum("mbj,nbj->mnb", q_x.reshape(m, -1, 32), q_w.reshape(n, -1, 32))
    block_sums = x.astype(np.float64).reshape(m, -1, 32).sum(axis=2)  # the Q4_1 offsets' exact sums
    expected = (int_dots * d_w[None] * d_x.astype(np.float64)[:, None]).sum(axis=2) + block_sums @ m_w.T
    out = torch.full((m, n), float("nan"))
    kernel(out, torch.from_numpy(x), _vnni_blocks(rows, code, n).vnni, code, bits)
    scale = np.abs(int_dots * d_w[None] * d_x.astype(np.float64)[:, None]).sum(axis=2) + np.abs(block_sums) @ np.abs(m_w).T
    error = np.abs(out.double().numpy() - expected)
    assert (error <= 1e-5 * scale + 1e-30).all(), (error / scale).max()


def test_the_build_uses_the_cpus_integer_dot_products() -> None:
    """The int8-activation kernel is there on every CPU with AVX2 (the CI machine: AMD Zen 3, AVX2
    without AVX-512), with AVX-512 VNNI where the CPU has it, so one-row decode steps use it."""
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_available, int8_isa

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags here")
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags)
    avx2 = {"avx2", "fma", "f16c"} <= set(flags)
    expected = "avx512_vnni" if vnni else ("avx2" if avx2 else "")
    assert int8_isa() == expected and int8_available() == bool(expected)
