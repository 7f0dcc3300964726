"""The batched 16-bit-activation kernel (csrc/cpu_quant_gemm_vnni.cpp on AVX-512 VNNI,
csrc/cpu_quant_gemm_int16_avx2.cpp on AVX2) against numpy doing the same quantization and exact
integer block products, and the dispatch that picks it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.test_cpu_quant_gemv import TYPES, random_blocks
from tests.unit.test_cpu_quant_gemv_int8 import _dequantized_parts, _quantize_like_the_kernel, _vnni_blocks
from tokenmill.kernels.cpu.build import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available()[0], reason="the CPU kernels cannot be built here")

# K: chunks of 4 blocks plus each remainder (1, 2, 3 = 2 + 1); N: panels of 24 and a partial one
# (and a partial second tile of 12); M: one group of 16, partial groups, several groups (AVX2:
# groups of 8, tiles of two groups and a last odd one).
SHAPES = [
    (24, 128, 5),
    (7, 32, 16),
    (50, 96, 17),
    (37, 224, 33),
    (192, 576, 64),
    (13, 288, 130),
]


def _vnni16_kernel() -> torch._ops.OpOverloadPacket:
    from tokenmill.kernels.cpu.quant_gemv import gemm_vnni16_available

    if not gemm_vnni16_available():
        pytest.skip("the batched 16-bit kernel needs AVX-512 VNNI or AVX2")
    return torch.ops.tokenmill_cpu.quant_gemm_vnni16


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, m", SHAPES)
def test_equals_the_same_integer_math_in_numpy(name: str, n: int, k: int, m: int) -> None:
    """Per (row, output, block) the exact integer dot of the 16-bit activations and the weights,
    scaled by d_x d_w, plus Q4_1's m * (float sum of x): a mis-ordered unpack, a wrong block's
    scale or a dropped tile moves results far beyond float32 summation error."""
    kernel = _vnni16_kernel()
    qtype, code = TYPES[name]
    rng = np.random.default_rng(13 * n + k + 5 * m)
    rows = random_blocks(rng, qtype, n, k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, size=(m, k // 32)).repeat(32, axis=1)).astype(
        np.float32
    )
    q_x, d_x = _quantize_like_the_kernel(x, 16)
    q_w, d_w, m_w = _dequantized_parts(rows, qtype)
    int_dots = np.einsum("mbj,nbj->mnb", q_x.reshape(m, -1, 32), q_w.reshape(n, -1, 32))
    block_sums = x.astype(np.float64).reshape(m, -1, 32).sum(axis=2)
    terms = int_dots * d_w[None] * d_x.astype(np.float64)[:, None]
    expected = terms.sum(axis=2) + block_sums @ m_w.T
    out = torch.full((m, n), float("nan"))
    kernel(out, torch.from_numpy(x), _vnni_blocks(rows, code, n, 16).vnni, code)
    scale = np.abs(terms).sum(axis=2) + np.abs(block_sums) @ np.abs(m_w).T
    error = np.abs(out.double().numpy() - expected)
    assert (error <= 1e-5 * scale + 1e-30).all(), (error / scale).max()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_many_panels_a_thread_equal_numpy(name: str, threads: int) -> None:
    """Several panels a thread, the last one partial: each panel prefetches the next one's weight
    rows while it computes (the prefetch must neither read past the last row nor change a result)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        test_equals_the_same_integer_math_in_numpy(name, 24 * 9 + 7, 96, 20)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name", TYPES)
def test_matches_the_few_row_kernel(name: str) -> None:
    """Same quantization as the 1-4-row kernel at 16 bits: a row's outputs agree to float32
    summation order whether its step has 4 rows (that kernel) or more (this one)."""
    kernel = _vnni16_kernel()
    qtype, code = TYPES[name]
    rng = np.random.default_rng(5)
    rows = random_blocks(rng, qtype, 40, 576)
    blocks = _vnni_blocks(rows, code, 40, 16)
    x = torch.randn(20, 576)
    batched = torch.empty(20, 40)
    kernel(batched, x, blocks.vnni, code)
    few = torch.empty(4, 40)
    torch.ops.tokenmill_cpu.quant_gemv_int8(few, x[:4].contiguous(), blocks.vnni, code, 16)
    torch.testing.assert_close(batched[:4], few, rtol=1e-5, atol=1e-5 * few.abs().max().item())


def test_non_finite_activations_reach_the_output() -> None:
    kernel = _vnni16_kernel()
    rows = random_blocks(np.random.default_rng(3), TYPES["Q4_1"][0], 30, 128)
    x = torch.randn(18, 128)
    x[0, 40], x[17, 100] = float("nan"), float("inf")
    out = torch.empty(18, 30)
    kernel(out, x, _vnni_blocks(rows, 0, 30, 16).vnni, 0)
    assert not torch.isfinite(out[0]).any() and not torch.isfinite(out[17]).any()
    assert torch.isfinite(out[1:17]).all()


def test_refuses_bad_shapes_naming_them() -> None:
    kernel = _vnni16_kernel()
    blocks = _vnni_blocks(random_blocks(np.random.default_rng(0), TYPES["Q4_1"][0], 4, 64), 0, 4, 16).vnni
    with pytest.raises(RuntimeError, match="K = 96 needs"):
        kernel(torch.empty(8, 4), torch.randn(8, 96), blocks, 0)
    with pytest.raises(RuntimeError, match=r"out must be \[8, 4\]"):
        kernel(torch.empty(8, 5), torch.randn(8, 64), blocks, 0)


def test_dispatch_sends_batched_rows_to_the_vnni_kernel_only_where_it_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """quantized_linear: more rows than the few-row kernel serves go to quant_linear_vnni16 where
    the build has it and the layer has integer-activation blocks, else to the float batched kernel."""
    from tokenmill.kernels.cpu import quant_gemv

    calls: list[str] = []
    monkeypatch.setattr(
        quant_gemv,
        "_linear_vnni16",
        lambda: lambda x, b, q: calls.append("vnni16") or torch.zeros(x.shape[0], 8),
    )
    monkeypatch.setattr(quant_gemv, "_gemm_float", lambda: lambda out, x, b, q: calls.append("float"))
    rows = random_blocks(np.random.default_rng(1), TYPES["Q4_1"][0], 8, 64)
    x = torch.randn(quant_gemv.int8_rows_limit() + 3, 64)
    for available in (True, False):
        monkeypatch.setattr(quant_gemv, "gemm_vnni16_available", lambda available=available: available)
        quant_gemv.quantized_linear(x, _vnni_blocks(rows, 0, 8, 16), None)
    assert calls == ["vnni16", "float"]
    calls.clear()
    monkeypatch.setattr(quant_gemv, "gemm_vnni16_available", lambda: True)
    float_only = _vnni_blocks(rows, 0, 8, 16)
    quant_gemv.quantized_linear(x, type(float_only)(float_only.blocks, 0, 8), None)  # no vnni layout
    assert calls == ["float"]


def test_up_to_four_rows_take_the_few_row_integer_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With integer-activation blocks, 1-4 rows go to quant_linear_int8 on AVX2 builds too (whose
    float few-row kernel serves one row): the batched kernel unpacks every weight first, which at
    2-4 rows cost 1.4-2.8x the few-row kernel's loop over the rows (quant_gemv.INT8_FEW_ROWS)."""
    from tokenmill.kernels.cpu import quant_gemv

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(
        quant_gemv, "_linear_int8", lambda: lambda x, b, q, bits: calls.append(("int8", x.shape[0])) or torch.zeros(x.shape[0], 8)
    )
    monkeypatch.setattr(
        quant_gemv, "_linear_vnni16", lambda: lambda x, b, q: calls.append(("vnni16", x.shape[0])) or torch.zeros(x.shape[0], 8)
    )
    monkeypatch.setattr(quant_gemv, "gemm_vnni16_available", lambda: True)
    monkeypatch.setattr(quant_gemv, "rows_limit", lambda: 1)  # an AVX2 build's float few-row kernel
    rows = random_blocks(np.random.default_rng(1), TYPES["Q4_1"][0], 8, 64)
    for m in (1, 2, 4, 5):
        quant_gemv.quantized_linear(torch.randn(m, 64), _vnni_blocks(rows, 0, 8, 16), None)
    assert calls == [("int8", 1), ("int8", 2), ("int8", 4), ("vnni16", 5)]


def test_vnni16_available_follows_the_cpu_flags() -> None:
    from tokenmill.kernels.cpu.build import _cpu_model
    from tokenmill.kernels.cpu.quant_gemv import gemm_vnni16_available

    flags = _cpu_model().split()
    has_vnni = all(flag in flags for flag in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"))
    has_avx2 = all(flag in flags for flag in ("avx2", "fma", "f16c"))
    assert gemm_vnni16_available() == (has_vnni or has_avx2)


def test_split_layout_left_out_only_where_the_vnni_kernels_serve_every_row_count() -> None:
    """With the VNNI batched kernel the float kernels' layout is never read, so the loader keeps
    only the integer-activation one (and both elsewhere, or with float activations)."""
    from types import SimpleNamespace

    from tokenmill.kernels.cpu.quant_gemv import gemm_vnni16_available, quantized_linear
    from tokenmill.model.loader.gguf_blocks import _blocks_for

    rows = random_blocks(np.random.default_rng(2), TYPES["Q4_1"][0], 24, 64)
    layer = SimpleNamespace(tp_size=1, out_features=24)
    integer = _blocks_for(layer, {None: (0, rows)}, 16)
    floats = _blocks_for(layer, {None: (0, rows)}, 0)
    assert integer is not None and floats is not None
    assert (integer.blocks is None) == gemm_vnni16_available() and floats.blocks is not None
    x = torch.randn(9, 64)
    expected = quantized_linear(x, floats, None)
    if integer.blocks is None:  # every row count still multiplies, from the one layout
        for m in (1, 4, 9):
            # (16-bit activations: ~1e-5 of each block's products off the float32 result)
            torch.testing.assert_close(
                quantized_linear(x[:m], integer, None), expected[:m], rtol=1e-3, atol=1e-3
            )
