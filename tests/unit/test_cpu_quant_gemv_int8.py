"""The quantized-activation few-row kernel (csrc/cpu_quant_gemv_int8.cpp, 8- and 16-bit activations)
against a float64 reference: exact where the activations are already integers of that width per
block, within the activations' rounding bound else."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from tests.unit.test_cpu_quant_gemv import TYPES, random_blocks
from tokenmill.kernels.cpu.build import cpu_kernels_available
from tokenmill.kernels.cpu.quant_gemv import QuantizedBlocks, quantized_linear, split_rows

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
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI")
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
    _int8_kernel()
    qtype, code = TYPES[name]
    rng = np.random.default_rng(n * 1000 + k + m)
    rows = random_blocks(rng, qtype, n, k)
    weight = torch.from_numpy(dequantize(rows, qtype).astype(np.float64))
    torch.manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, dtype=torch.float64).float()
    bias = torch.randn(n)
    out = quantized_linear(x, _vnni_blocks(rows, code, n, bits), bias)
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
