"""The FP8 matmul kernels compiled on a GPU, at Llama-3.1-8B's projection shapes, against the
float64 product of the dequantized weights (tests/fp8_reference.py), and inside a CUDA graph.

Each product is checked elementwise against a bound made of one rounding to the output dtype
(half an ulp) and a dot-product error proportional to sum_k |x_k w_k|:
- 16-bit activations (gemv, skinny16): float32 summation only, W8A16_DOT_REL;
- FP8 activations (skinny8, gemm, scaled_mm): tightly against the product of the activations
  quantized as the kernels quantize them (bit-exact: test_quantization_is_bit_exact), with the
  tensor cores' FP8 accumulation inside each K step allowed for (W8A8_DOT_REL), and loosely
  against the 16-bit activations, where e4m3's rounding of each activation (2**-4 of it) adds
  E4M3_REL.
"""

from __future__ import annotations

import pytest
import torch

from tests.fp8_reference import (
    BLOCK,
    E4M3_REL,
    assert_close_to,
    dequantize_activations,
    linear_reference,
    quantize_activations,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

W8A16_DOT_REL = 2.0**-16
# Hopper's FP8 tensor-core instructions accumulate with fewer bits than float32; the kernels add
# each K step's partial sum into float32 (max_num_imprecise_acc), cuBLAS without fast accumulation
# promotes too. Measured on an H100 at these shapes with random data, as a fraction of
# sum_k |x_k w_k| beyond the output rounding: up to 3e-5 for the Triton paths, 2.7e-4 for
# torch._scaled_mm (benchmarks/fp8_linear_microbench.py's "dot_rel"); 2**-9 leaves room for
# less random data. The Triton paths' arithmetic is checked exactly in the CPU interpreter
# (tests/unit/test_fp8_kernels.py, bound 2**-16).
W8A8_DOT_REL = 2.0**-9

# Llama-3.1-8B: (out features N, in features K)
SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
ROWS = [1, 2, 7, 16, 33, 128, 512]
A16_PATHS = ("tc16", "gemv", "skinny16")  # 16-bit activations; the others quantize them to FP8
# Each path also runs explicitly at sizes it serves, whatever the dispatch thresholds are.
PATH_ROWS = {"tc16": [1, 4], "gemv": [1, 3], "skinny16": [2, 16], "skinny8": [7, 33], "gemm": [33, 512], "scaled_mm": [128]}


def _serves(path: str, block) -> bool:
    return path not in ("scaled_mm", "tc16") or block is None


def _fp8():
    from tokenmill.kernels.triton import fp8_linear

    return fp8_linear


def _weights(n: int, k: int, block, seed: int):
    """Random FP8 weights with random positive scales: (Fp8Weights, dequantized float64 [N, K]).
    Seeds from 1000 on, so that no activation generator (small seeds) draws the same numbers: with
    x equal to rows of W (a shared seed) the all-positive dot products of those rows came out of
    the FP8 path 1.02x over the W8A8 bound once on an H100 (a 0.5 error at 84)."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_shape = (n,) if block is None else (-(-n // BLOCK[0]), -(-k // BLOCK[1]))
    scale = (torch.rand(scale_shape, device="cuda", generator=gen) + 0.5) * 2e-4
    fp8 = _fp8()
    w = fp8.prepare_fp8_weights(weight, scale, block)
    if block is None:
        w_deq = weight.double() * scale.double()[:, None]
    else:
        full = scale.double().repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
        w_deq = weight.double() * full
    return w, w_deq


def _check(y, x, w_deq, path: str, block, what: str, bias=None, residual=None) -> None:
    bias64 = None if bias is None else bias.double()
    res64 = None if residual is None else residual.double()
    if path in A16_PATHS:
        exact, magnitude = linear_reference(x, w_deq, bias64, res64)
        assert_close_to(y, exact, magnitude, W8A16_DOT_REL, f"{what} ({path})")
        return
    group = None if block is None else BLOCK[1]
    x_deq = dequantize_activations(*quantize_activations(x, group), group)
    exact, magnitude = linear_reference(x_deq, w_deq, bias64, res64)
    assert_close_to(y, exact, magnitude, W8A8_DOT_REL, f"{what} ({path}) vs FP8 activations")
    exact, magnitude = linear_reference(x, w_deq, bias64, res64)
    assert_close_to(y, exact, magnitude, E4M3_REL + W8A8_DOT_REL, f"{what} ({path}) vs 16-bit activations")


@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_llama_shapes_every_row_count_and_path(name: str, block) -> None:
    fp8 = _fp8()
    n, k = SHAPES[name]
    w, w_deq = _weights(n, k, block, seed=len(name))
    gen = torch.Generator(device="cuda").manual_seed(7)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        path = fp8.choose_path(x, w)
        y = fp8.fp8_linear(x, w)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        _check(y, x, w_deq, path, block, f"{name} M={m}")
    for path, rows in PATH_ROWS.items():
        if not _serves(path, block):
            continue
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            _check(fp8.fp8_linear(x, w, path=path), x, w_deq, path, block, f"{name} M={m}")


CASES = {  # name: (shape, bias, residual, out_dtype, x dtype)
    "qkv+bias": ("qkv", True, False, None, torch.bfloat16),
    "o_proj+residual": ("o_proj", False, True, None, torch.bfloat16),
    "down+residual fp16": ("down", False, True, None, torch.float16),
    "lm_head float32 logits": ("lm_head", False, False, torch.float32, torch.bfloat16),
    "gate_up+bias float32": ("gate_up", True, False, torch.float32, torch.float16),
}


@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("case", list(CASES))
def test_bias_residual_and_out_dtype(case: str, block) -> None:
    fp8 = _fp8()
    name, has_bias, has_residual, out_dtype, x_dtype = CASES[case]
    n, k = SHAPES[name]
    w, w_deq = _weights(n, k, block, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(11)
    bias = torch.randn(n, device="cuda", generator=gen).to(x_dtype) if has_bias else None
    for path, rows in PATH_ROWS.items():
        if not _serves(path, block):
            continue
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=x_dtype, generator=gen)
            residual = torch.randn(m, n, device="cuda", generator=gen).to(x_dtype) if has_residual else None
            before = None if residual is None else residual.clone()
            y = fp8.fp8_linear(x, w, bias=bias, residual=residual, out_dtype=out_dtype, path=path)
            assert y.dtype == (out_dtype or x_dtype)
            if residual is not None:  # in place, as the seam asks, except the one-row GEMV's new tensor
                assert (y.data_ptr() == residual.data_ptr()) == (path not in ("gemv", "tc16"))
            _check(y, x, w_deq, path, block, f"{case} M={m}", bias, before)


def test_quantization_is_bit_exact() -> None:
    """The kernels' FP8 activations and scales equal the torch reference's bit for bit (the tight
    W8A8 checks above rely on it), outliers and an all-zero row included."""
    from tokenmill.kernels.triton.fp8_quant import quantize_per_token, quantize_per_token_group

    gen = torch.Generator(device="cuda").manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(512, 14336, device="cuda", generator=gen).to(dtype)
        x[3] = 0
        x[4, 100] = 3000.0
        x[5] *= 1e-4  # subnormal FP8 values in every row's tail
        for group in (None, 128):
            q, scale = quantize_per_token(x) if group is None else quantize_per_token_group(x, group)
            ref_q, ref_scale = quantize_activations(x, group)
            assert torch.equal(scale, ref_scale), f"{dtype} group {group}: scales differ"
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), f"{dtype} group {group}"


@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
def test_every_path_replays_in_a_cuda_graph(block) -> None:
    """Captured once, replayed on new inputs: the same output as an eager call, for each path
    (with a residual, as o_proj / down run in the decode graph)."""
    fp8 = _fp8()
    n, k = SHAPES["o_proj"]
    w, _ = _weights(n, k, block, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for path, rows in PATH_ROWS.items():
        if not _serves(path, block):
            continue
        m = rows[-1]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        residual0 = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        residual = residual0.clone()

        def step(x=x, residual=residual, path=path):
            return fp8.fp8_linear(x, w, path=path), fp8.fp8_linear(x, w, residual=residual, path=path)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, captured_sum = step()  # captured_sum is `residual` itself except on the gemv path
        for _ in range(2):
            x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen))
            residual.copy_(residual0)
            graph.replay()
            assert torch.equal(captured, fp8.fp8_linear(x, w, path=path)), f"{path} M={m}: replay differs"
            eager_residual = fp8.fp8_linear(x, w, residual=residual0.clone(), path=path)
            assert torch.equal(captured_sum, eager_residual), f"{path} M={m}: replayed residual add differs"


@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize("name", ["qkv", "down"])
def test_gemv_k_split_at_llama_shapes_in_a_cuda_graph(name: str, split: int) -> None:
    """The K-split per-channel GEMV (one and four rows, with the residual add): within the W8A16
    bound, the same bits replayed in a CUDA graph as eager (the last program's ordered sum), and
    every tile count back at zero."""
    from tokenmill.kernels.triton.fp8_gemv import fp8_gemv

    n, k = SHAPES[name]
    w, w_deq = _weights(n, k, None, seed=20 + split)
    gen = torch.Generator(device="cuda").manual_seed(21)
    for m in (1, 4):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)

        def call(x=x, residual=residual):
            config = (16, 256, 4, 1, split)
            return fp8_gemv(x, w.weight, w.scale, None, residual=residual, config=config, tile_counters=w.tile_counters)

        eager = call()
        _check(eager, x, w_deq, "gemv", None, f"{name} split {split} M={m}", residual=residual)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager), f"{name} split {split} M={m}: replay differs"
        assert w.tile_counters.count_nonzero().item() == 0
