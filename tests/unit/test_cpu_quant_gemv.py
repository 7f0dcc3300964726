"""The C++ one-row matmul over GGUF Q4_1 / Q8_0 blocks against gguf's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.kernels.cpu.build import cpu_kernels_available
from tokenmill.kernels.cpu.quant_gemv import QuantizedBlocks, quantized_linear, split_rows

pytestmark = pytest.mark.skipif(not cpu_kernels_available()[0], reason="the CPU kernels cannot be built here")

TYPES = {"Q4_1": (GGMLQuantizationType.Q4_1, 0), "Q8_0": (GGMLQuantizationType.Q8_0, 1)}


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    """Random valid blocks: float16 scales (and Q4_1 minimums) of either sign, random quants."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, size=(n, k // 32, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // 32, 2)) * 0.05).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q4_1:
        rows[..., :4] = scales.reshape(n, k // 32, 4)  # d, m
    else:
        rows[..., :2] = scales.reshape(n, k // 32, 4)[..., :2]  # d
    return rows.reshape(n, -1)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    "n, k, m",
    [
        (1, 32, 1),
        (7, 64, 1),
        (3, 288, 1),
        (300, 576, 1),
        (192, 1536, 1),
        (65, 576, 2),
        (65, 576, 3),
        (9, 64, 4),
        (33, 96, 7),
    ],
)  # 288: 9 blocks, not a multiple of the 8 scales converted at a time; 7 rows: passes of 4 and 3
def test_quant_gemv_equals_dequantize_then_matmul(name: str, n: int, k: int, m: int) -> None:
    qtype, code = TYPES[name]
    rng = np.random.default_rng(n * 1000 + k + m)
    rows = random_blocks(rng, qtype, n, k)
    weight = torch.from_numpy(dequantize(rows, qtype).astype(np.float32))  # [n, k]
    assert weight.shape == (n, k) and torch.isfinite(weight).all()
    x = torch.randn(m, k, dtype=torch.float64).float()
    bias = torch.randn(n)
    blocks = QuantizedBlocks(torch.from_numpy(split_rows(rows, code)), code, n)
    out = quantized_linear(x, blocks, bias)
    expected = (x.double() @ weight.double().t() + bias.double()).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_quant_gemv_refuses_bad_shapes_naming_them() -> None:
    rng = np.random.default_rng(0)
    blocks = QuantizedBlocks(
        torch.from_numpy(split_rows(random_blocks(rng, GGMLQuantizationType.Q4_1, 4, 64), 0)), 0, 4
    )
    with pytest.raises(RuntimeError, match="K = 96 needs"):
        quantized_linear(torch.randn(1, 96), blocks, None)
    with pytest.raises(RuntimeError, match="quant_type must be 0"):
        out = torch.empty(1, 4)
        torch.ops.tokenmill_cpu.quant_gemv(out, torch.randn(1, 64), blocks.blocks, 5)


def test_steps_of_more_rows_than_this_build_serves_keep_the_float32_weights() -> None:
    from tokenmill.kernels.cpu.quant_gemv import rows_limit
    from tokenmill.model.layers.linear import ReplicatedLinear
    from tokenmill.model.layers.quantized_linear import attach_quantized_blocks

    limit = rows_limit()
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX"):
        assert limit == 4  # the kernels are built with -march=native: the AVX-512 path
    layer = ReplicatedLinear(64, 4)
    rng = np.random.default_rng(1)
    blocks = QuantizedBlocks(
        torch.from_numpy(split_rows(random_blocks(rng, GGMLQuantizationType.Q8_0, 4, 64), 1)), 1, 4
    )
    attach_quantized_blocks(layer, blocks)
    blocks_for_rows = layer.method.blocks_for_rows
    assert blocks_for_rows(limit + 1) is None
    if limit:
        assert blocks_for_rows(1) is blocks and blocks_for_rows(limit) is blocks


def require_gemm() -> None:
    """Skip where the batched kernel has no path; fail where it should have one (-march=native
    builds the AVX-512 path on AVX-512 machines, the AVX2+FMA one on AVX2 machines), so that a CI
    machine of either kind runs the kernel these tests check."""
    from tokenmill.kernels.cpu.quant_gemv import gemm_available

    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AMX"):
        assert gemm_available(), "the batched quantized kernel should build on this CPU"
    elif not gemm_available():
        pytest.skip("the batched quantized kernel needs AVX-512 or AVX2+FMA")


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    "n, k, m",
    [(1, 32, 5), (24, 64, 16), (25, 96, 17), (49, 288, 40), (300, 576, 33), (7, 1536, 64), (30, 64, 2), (13, 96, 8), (50, 128, 24)],
)  # n not a multiple of the 24-row panel (nor of the AVX2 tiles' 6 and 12); m across 16-row groups
# (AVX-512) and 8-row groups in pairs plus an odd last one (AVX2), the last group padded
def test_quant_gemm_equals_dequantize_then_matmul(name: str, n: int, k: int, m: int) -> None:
    require_gemm()
    qtype, code = TYPES[name]
    rng = np.random.default_rng(n * 1000 + k + m)
    rows = random_blocks(rng, qtype, n, k)
    weight = torch.from_numpy(dequantize(rows, qtype).astype(np.float32))
    x = torch.randn(m, k, dtype=torch.float64).float()
    blocks = QuantizedBlocks(torch.from_numpy(split_rows(rows, code)), code, n)
    out = torch.full((m, n), float("nan"))
    torch.ops.tokenmill_cpu.quant_gemm(out, x, blocks.blocks, code)
    expected = (x.double() @ weight.double().t()).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    bias = torch.randn(n)
    with_bias = expected + bias
    torch.testing.assert_close(
        quantized_linear(x, blocks, bias), with_bias, rtol=1e-5, atol=1e-5 * with_bias.abs().max().item()
    )


def test_quant_gemm_refuses_bad_shapes_naming_them() -> None:
    require_gemm()
    rng = np.random.default_rng(0)
    blocks = torch.from_numpy(split_rows(random_blocks(rng, GGMLQuantizationType.Q4_1, 4, 64), 0))
    with pytest.raises(RuntimeError, match="K = 96 needs"):
        torch.ops.tokenmill_cpu.quant_gemm(torch.empty(8, 4), torch.randn(8, 96), blocks, 0)
    with pytest.raises(RuntimeError, match=r"out must be \[8, 4\]"):
        torch.ops.tokenmill_cpu.quant_gemm(torch.empty(8, 5), torch.randn(8, 64), blocks, 0)


def test_decode_batches_up_to_gemm_rows_read_the_blocks() -> None:
    from tokenmill.kernels.cpu.quant_gemv import gemm_available, rows_limit
    from tokenmill.model.layers.linear import ReplicatedLinear
    from tokenmill.model.layers.quantized_linear import attach_quantized_blocks

    layer = ReplicatedLinear(64, 4)
    rng = np.random.default_rng(2)
    blocks = QuantizedBlocks(
        torch.from_numpy(split_rows(random_blocks(rng, GGMLQuantizationType.Q4_1, 4, 64), 0)), 0, 4
    )
    attach_quantized_blocks(layer, blocks, gemm_rows=32)
    limit = 32 if gemm_available() else rows_limit()
    assert layer.method.blocks_for_rows(limit) is blocks
    assert layer.method.blocks_for_rows(limit + 1) is None


def test_blocks_serving_every_row_count_free_the_onednn_weights() -> None:
    """Where the blocks serve every product (the AVX2 build's prefill too), the packed float32
    copy oneDNN kept is freed (~300 MiB of the default model's RSS); the products still equal the
    dequantized weights', and an input the blocks cannot take is refused by name. With a bounded
    row count the float weights stay for the larger products."""
    from tokenmill.kernels.cpu.quant_gemv import ALL_ROWS, gemm_available, rows_limit
    from tokenmill.model.layers.linear import ReplicatedLinear
    from tokenmill.model.layers.onednn_linear import OneDNNLinearMethod, onednn_packing_available
    from tokenmill.model.layers.quantized_linear import attach_quantized_blocks

    if not onednn_packing_available(torch.float32) or not gemm_available() or rows_limit() < 1:
        pytest.skip("needs oneDNN packing and the batched quantized kernel")
    rng = np.random.default_rng(3)
    gguf_rows = random_blocks(rng, GGMLQuantizationType.Q8_0, 24, 64)
    dense = torch.from_numpy(dequantize(gguf_rows, GGMLQuantizationType.Q8_0).reshape(24, 64).astype(np.float32))
    layers = {}
    for name, gemm_rows in (("all", ALL_ROWS), ("bounded", 4)):
        layer = ReplicatedLinear(64, 24, method=OneDNNLinearMethod())
        layer.weight.data.copy_(dense)
        layer.method.process_layers_after_loading([layer])
        blocks = QuantizedBlocks(torch.from_numpy(split_rows(gguf_rows, 1)), 1, 24)
        attach_quantized_blocks(layer, blocks, gemm_rows=gemm_rows)
        layers[name] = layer
    assert layers["all"].packed_weight is None and layers["all"].plain_weight is None
    assert layers["bounded"].packed_weight is not None
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    for layer in layers.values():
        torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="keeps only its GGUF blocks"):
        layers["all"](x.double())


def test_prefill_rows_limit_takes_every_row_on_avx2_and_vnni_only(monkeypatch):
    # Prefill chunks join the batched kernel where its path beats oneDNN (AVX2, VNNI); AVX-512 keeps the
    # configured decode limit, and 0 (kernel off) or a build without the kernel stay as they are.
    from tokenmill.kernels.cpu import quant_gemv

    assert quant_gemv.gemm_isa() in ("avx512", "avx2", "")
    monkeypatch.setattr(quant_gemv, "gemm_available", lambda: True)
    monkeypatch.setattr(quant_gemv, "gemm_isa", lambda: "avx2")
    assert quant_gemv.prefill_rows_limit(64) == quant_gemv.ALL_ROWS
    assert quant_gemv.prefill_rows_limit(0) == 0
    monkeypatch.setattr(quant_gemv, "gemm_isa", lambda: "avx512")
    assert quant_gemv.prefill_rows_limit(64) == 64
    # AVX-512 with VNNI: the 16-bit integer kernel takes prefill too, where layers have its layout.
    for vnni in (False, True):
        monkeypatch.setattr(quant_gemv, "gemm_vnni16_available", lambda vnni=vnni: vnni)
        assert quant_gemv.prefill_rows_limit(64) == 64
        assert quant_gemv.prefill_rows_limit(64, integer_activations=True) == (quant_gemv.ALL_ROWS if vnni else 64)
        assert quant_gemv.prefill_rows_limit(0, integer_activations=True) == 0
    monkeypatch.setattr(quant_gemv, "gemm_available", lambda: False)
    assert quant_gemv.prefill_rows_limit(64) == 64


def test_batched_kernel_on_prefill_sized_products_matches_dequantized_weights():
    # A 512-row product (a prefill chunk) through quant_gemm: the float32 product of the
    # dequantized weights up to summation order.
    from tokenmill.kernels.cpu.quant_gemv import gemm_available

    if not gemm_available():
        pytest.skip("no batched kernel in this build")
    rng = np.random.default_rng(7)
    n, k = 96, 576
    raw = random_blocks(rng, GGMLQuantizationType.Q4_1, n, k)
    weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).reshape(n, k).astype(np.float32))
    blocks = QuantizedBlocks(torch.from_numpy(split_rows(raw, 0)), 0, n)
    x = torch.randn(512, k)
    expected = (x.double() @ weights.double().t()).float()
    out = quantized_linear(x, blocks, None)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
