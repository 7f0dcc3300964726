"""The W4A16 kernel (kernels/triton/int4_linear.py) on a CUDA GPU at Llama-3.1-8B shapes, against
F.linear in float32 on the dequantized canonical weights (tests/int4_reference.py).

Shapes (K x N): qkv 4096 x 6144, o_proj 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096;
rows 1, 3, 16, 32 (decode, split-K), 100 and 512 (prefill tiles); group sizes 128, 32 and
per-channel, with and without act-order; bias, residual, float32 output, float16 activations;
the inline-PTX unpacking against the plain Triton one; a CUDA graph replayed with new inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from tests.int4_reference import random_int4
from tokenmill.kernels.triton.int4_configs import Int4Config, int4_config

if torch.cuda.is_available():
    # Compile mode for this process: triton must be imported before the CPU tests in tests/unit
    # switch on TRITON_INTERPRET (they then rerun themselves in a subprocess).
    import triton  # noqa: F401

    from tokenmill.bench.timing import capture_graph
    from tokenmill.kernels.triton.int4_linear import dequantize_weights, int4_linear, prepare_int4_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N)
ROWS = [1, 3, 16, 32, 100, 512]


@functools.lru_cache(maxsize=2)
def _weights(k: int, n: int, group_size: int, act_order: bool, scale_dtype: torch.dtype = torch.float16):
    """(kernel weights, float32 dequantized W) of one random INT4 matrix, cached across cases."""
    c = random_int4(
        n, k, group_size, act_order=act_order, scale_dtype=scale_dtype, device="cuda", seed=k + n + group_size
    )
    return prepare_int4_weights(c.q, c.scales, c.zeros, c.group_size, c.g_idx), c.dequantize()


def _x(m: int, k: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=gen, device="cuda").to(dtype)


def _check(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the output's rounding (rtol) plus the 16-bit weight rounding of the scale-before tiles
    (atol, relative to the output's RMS: about 8 standard deviations of that error)."""
    rms = expected.float().pow(2).mean().sqrt().item()
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(y.float(), expected.float(), rtol=ulp, atol=2 * ulp * rms)


@pytest.mark.parametrize("k, n, m", [(k, n, m) for k, n in SHAPES for m in ROWS])
def test_llama_shapes_group_128(k: int, n: int, m: int) -> None:
    w, dense = _weights(k, n, 128, False)
    x = _x(m, k)
    _check(int4_linear(x, w), x.float() @ dense.t(), torch.bfloat16)


@pytest.mark.parametrize(
    "k, group_size, act_order, m",
    [
        (k, g, a, m)
        for k in (4096, 14336)
        for g, a in ((32, False), (32, True), (128, True), (-1, False))
        for m in (1, 16, 100)
    ],
)
def test_group_sizes_and_act_order(k: int, group_size: int, act_order: bool, m: int) -> None:
    """Groups of 32 and per-channel scales; act-order gathered inside the kernel (1, 16 rows) and by
    index_select before it (100 rows)."""
    w, dense = _weights(k, 4096, group_size, act_order)
    x = _x(m, k, seed=m)
    _check(int4_linear(x, w), x.float() @ dense.t(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 100, 512])
def test_bias_residual_out_dtype(dtype: torch.dtype, m: int) -> None:
    """Split-K decode, fused prefill-size tiles, and (512 rows) dequantize + cuBLAS."""
    k, n = 4096, 6144
    w, dense = _weights(k, n, 128, False)
    x = _x(m, k, dtype, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(m, n, generator=gen, device="cuda").to(dtype)
    product = x.float() @ dense.t()
    _check(int4_linear(x, w, bias), product + bias.float(), dtype)
    updated = residual.clone()
    assert int4_linear(x, w, residual=updated) is updated
    _check(updated, product + residual.float(), dtype)
    logits = int4_linear(x, w, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    _check(logits, product, dtype)


@pytest.mark.parametrize("m", [1, 16, 512])
def test_bfloat16_scales(m: int) -> None:
    k, n = 4096, 4096
    w, dense = _weights(k, n, 128, False, torch.bfloat16)
    x = _x(m, k, seed=3)
    _check(int4_linear(x, w), x.float() @ dense.t(), torch.bfloat16)


@pytest.mark.parametrize(
    "m, config",
    [
        (1, Int4Config(16, 64, 2, num_warps=2)),
        (16, Int4Config(16, 64, 2)),
        (16, Int4Config(16, 128, 4, w_left=False)),
        (32, Int4Config(32, 128, 2)),
        (512, Int4Config(128, 128, 1, 8, 2, False)),  # the fused kernel at a prefill size
    ],
)
def test_inline_ptx_unpacking_matches_plain_triton(m: int, config) -> None:
    """The `pack=2` inline asm pairs the two words of a column pair: if Triton ever handed it other
    pairs (another layout), its products would differ from the plain split/join version's."""
    k, n = 4096, 4096
    w, dense = _weights(k, n, 128, False)
    x = _x(m, k, seed=5)
    fast = int4_linear(x, w, config=config)
    plain = int4_linear(x, w, config=dataclasses.replace(config, asm_dequant=False))
    torch.testing.assert_close(fast, plain, rtol=0, atol=0)
    _check(fast, x.float() @ dense.t(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantized_weights_match_plain_triton_and_torch(dtype: torch.dtype) -> None:
    """The large-M path's 16-bit weight (sorted columns): the same bits with and without the inline
    asm; float16 (the scales' type) is (q - zero) * scale rounded once, bfloat16 within one rounding
    of the scale and one of the product."""
    k, n = 14336, 4096
    w, dense = _weights(k, n, 32, True)
    fast = dequantize_weights(w, dtype)
    torch.testing.assert_close(fast, dequantize_weights(w, dtype, asm=False), rtol=0, atol=0)
    expected = dense[:, w.perm[:k].long()]
    if dtype == torch.float16:
        torch.testing.assert_close(fast, expected.half(), rtol=0, atol=0)
    else:
        torch.testing.assert_close(fast.float(), expected, rtol=2**-7, atol=0)


def test_cuda_graph_replays_with_new_inputs() -> None:
    """One graph: a split-K decode matmul adding into a residual, and a prefill-sized one, replayed
    three times with new x: right each time (the split-K tile counters reset themselves)."""
    k, n = 4096, 4096
    w, dense = _weights(k, n, 128, False)
    assert int4_config(1, n, k).split_k > 1
    x_decode, x_prefill = _x(1, k), _x(100, k)
    residual = torch.zeros(1, n, device="cuda", dtype=torch.bfloat16)
    out = {}

    def step() -> None:
        int4_linear(x_decode, w, residual=residual)
        out["prefill"] = int4_linear(x_prefill, w)

    graph = capture_graph(step)
    for trial in range(3):
        x_decode.copy_(_x(1, k, seed=10 + trial))
        x_prefill.copy_(_x(100, k, seed=20 + trial))
        start = torch.randn(1, n, device="cuda").to(torch.bfloat16)
        residual.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        _check(residual, start.float() + x_decode.float() @ dense.t(), torch.bfloat16)
        _check(out["prefill"], x_prefill.float() @ dense.t(), torch.bfloat16)
    assert w.tile_counters.count_nonzero().item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, config",
    [
        (1, Int4Config(16, 64, 8, num_warps=2, num_stages=2, zero_by_xsum=True)),
        (1, Int4Config(16, 64, 1, num_warps=2, num_stages=4, zero_by_xsum=True)),
        (16, Int4Config(16, 64, 4, zero_by_xsum=True)),
        (64, Int4Config(64, 128, 2, zero_by_xsum=True)),
    ],
)
def test_zero_points_through_the_sum_of_x(dtype: torch.dtype, m: int, config) -> None:
    """ZERO_BY_XSUM: the dots take 128 + q (1024 + q in float16) and each group's partial sums
    lose (128 + zero) * sum(x) from a dot of ones: within the same bound as the per-weight zero
    subtraction, at the two Llama shapes with the most groups per row, with and without bf16 scales."""
    for k, n, scale_dtype in ((4096, 6144, torch.float16), (14336, 4096, torch.bfloat16)):
        w, dense = _weights(k, n, 128, False, scale_dtype)
        x = _x(m, k, dtype, seed=11)
        _check(int4_linear(x, w, config=config), x.float() @ dense.t(), dtype)
