"""The FP8 matmul kernels (kernels/triton/fp8_*.py) on the CPU under TRITON_INTERPRET=1, tiny shapes.

Triton 3.9's interpreter runs float8_e4m3fn loads, stores, conversions and FP8 x FP8 `tl.dot`
(through NumPy), so every Triton path of `fp8_linear` is checked here against the float64
product of the dequantized weights; `torch._scaled_mm` (CUDA only) is covered by the GPU tests
(tests/gpu/test_fp8_kernels_gpu.py), which also run these kernels compiled, at Llama-3.1-8B shapes.

As in test_triton_attention.py, TRITON_INTERPRET must be set before triton is first imported;
when this process imported it compiled, the cases are skipped and a subprocess runs this file.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.fp8_reference import (  # noqa: E402
    BLOCK,
    E4M3_REL,
    assert_close_to,
    dequantize_activations,
    dequantize_weight,
    linear_reference,
    quantize_activations,
    quantize_weight,
)
from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.kernels.triton.fp8_gemv import fp8_gemv  # noqa: E402
from tokenmill.kernels.triton.fp8_linear import (  # noqa: E402
    Fp8Dispatch,
    choose_path,
    fp8_linear,
    prepare_fp8_weights,
)
from tokenmill.kernels.triton.fp8_quant import quantize_per_token, quantize_per_token_group  # noqa: E402
from tokenmill.kernels.triton.fp8_tc_gemv import fp8_tc_gemv  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__)  # run by the subprocess test below

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)

# Error of the float32 sums relative to sum_k |x_k w_k| (a sqrt(K) * 2**-24 estimate with
# headroom). The interpreter multiplies FP8 tiles exactly (through float16 NumPy matmuls), so the
# FP8-activation paths get the same bound here; on the GPU they add the tensor cores'
# reduced-precision FP8 accumulation inside each K step (tests/gpu/test_fp8_kernels_gpu.py).
W8A16_DOT_REL = 2.0**-16
W8A8_DOT_REL = 2.0**-16


def _close(got, exact, magnitude, dot_rel: float, what: str) -> None:
    """assert_close_to with a whole ulp for the output: the interpreter truncates float32 to 16 bits."""
    assert_close_to(got, exact, magnitude, dot_rel, what, out_ulps=1.0)


def _case(n: int, k: int, block, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w_float = torch.randn(n, k, generator=gen) * 0.05
    weight, scale = quantize_weight(w_float, block)
    return prepare_fp8_weights(weight, scale, block), dequantize_weight(weight, scale, block), gen


@interpreted_only
def test_per_token_quantization_matches_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 200, generator=gen) * 3).to(torch.bfloat16)
    x[2] = 0  # a padded row: finite scale, zeros out
    x[3, 7] = 1000.0  # one outlier sets its row's scale
    q, scale = quantize_per_token(x)
    ref_q, ref_scale = quantize_activations(x, None)
    assert scale.shape == (5, 1)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.all(q[2].float() == 0)
    assert q[3, 7].float().item() == 448.0


@interpreted_only
def test_per_group_quantization_matches_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 300, generator=gen) * 2).to(torch.float16)  # 3 groups, the last one partial
    x[1, 130] = -500.0
    q, scale = quantize_per_token_group(x, 128)
    ref_q, ref_scale = quantize_activations(x, 128)
    assert scale.shape == (4, 3) and scale.stride() == (1, 4)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert (dequantize_activations(q, scale, 128) - x.float()).abs().max() <= E4M3_REL * 500.0


PATH_ROWS = {"tc16": [1, 3], "gemv": [1, 3], "skinny16": [1, 5, 20], "skinny8": [2, 17], "gemm": [3, 40]}
A16_PATHS = ("tc16", "gemv", "skinny16")  # 16-bit activations


@interpreted_only
@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("path", list(PATH_ROWS))
def test_each_path_matches_the_dequantized_reference(path: str, block) -> None:
    """N = 160 and K = 384 (block) / 200 (channel): partial N tiles, a partial scale block along N,
    and K not a multiple of the K tile for per-channel weights."""
    if path == "tc16" and block is not None:
        pytest.skip("the tensor-core GEMV takes per-channel weights only")
    n, k = 160, 384 if block else 200
    w, w_deq, gen = _case(n, k, block)
    for m in PATH_ROWS[path]:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        y = fp8_linear(x, w, path=path)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        if path in A16_PATHS:
            exact, magnitude = linear_reference(x.float(), w_deq)
            _close(y, exact, magnitude, W8A16_DOT_REL, f"{path} M={m}")
        else:
            group = None if block is None else 128
            xq, x_scale = quantize_activations(x, group)
            x_deq = dequantize_activations(xq, x_scale, group)
            exact, magnitude = linear_reference(x_deq, w_deq)
            _close(y, exact, magnitude, W8A8_DOT_REL, f"{path} M={m} vs FP8 activations")
            exact, magnitude = linear_reference(x.float(), w_deq)
            _close(y, exact, magnitude, E4M3_REL + W8A8_DOT_REL, f"{path} M={m} vs 16-bit activations")


@interpreted_only
@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("path", list(PATH_ROWS))
def test_bias_residual_and_out_dtype(path: str, block) -> None:
    if path == "tc16" and block is not None:
        pytest.skip("the tensor-core GEMV takes per-channel weights only")
    n, k = 144, 256
    w, w_deq, gen = _case(n, k, block, seed=3)
    m = PATH_ROWS[path][-1]
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    x_used = x.float()
    if path in ("skinny8", "gemm"):
        group = None if block is None else 128
        x_used = dequantize_activations(*quantize_activations(x, group), group)
    dot_rel = W8A16_DOT_REL if path in A16_PATHS else W8A8_DOT_REL

    y = fp8_linear(x, w, bias=bias, out_dtype=torch.float32, path=path)
    assert y.dtype == torch.float32
    exact, magnitude = linear_reference(x_used, w_deq, bias.float())
    _close(y, exact, magnitude, dot_rel, f"{path} bias, float32 out")

    residual = torch.randn(m, n, generator=gen).to(torch.float16)
    before = residual.clone()
    y = fp8_linear(x, w, residual=residual, path=path)
    # The seam's contract: residual + product, returned; in place except on the one-row GEMV path.
    assert (y.data_ptr() == residual.data_ptr()) == (path not in ("gemv", "tc16"))
    exact, magnitude = linear_reference(x_used, w_deq, residual=before.float())
    _close(y, exact, magnitude, dot_rel, f"{path} residual")


@interpreted_only
def test_leading_dimensions_and_empty_batches() -> None:
    w, w_deq, gen = _case(48, 64, None, seed=4)
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    y = fp8_linear(x, w)
    assert y.shape == (2, 3, 48)
    flat = fp8_linear(x.reshape(6, 64), w)
    assert torch.equal(y.reshape(6, 48), flat)
    assert fp8_linear(x[:0], w).shape == (0, 3, 48)
    empty = fp8_linear(torch.empty(0, 64, dtype=torch.bfloat16), w)
    assert empty.shape == (0, 48)


@interpreted_only
@pytest.mark.parametrize("rows", [1, 4])
def test_gemv_k_split_matches_the_reference_and_leaves_its_counters_zero(rows: int) -> None:
    """K = 200 in 64-column steps (4 steps, the last partial) over 1, 3 (two steps, then one, then
    none), 4 and 8 splits (the last four with no K at all); N = 40 in 16-wide tiles (the last partial); bias
    and residual. Every split count gives the same sums as the reference, the same bits on a second
    call (the counts were reset: a stale count would hand the epilogue to the wrong program and
    drop splits), and the counters end at zero."""
    n, k = 40, 200
    w, w_deq, gen = _case(n, k, None, seed=5)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, n, generator=gen).to(torch.bfloat16)
    exact, magnitude = linear_reference(x.float(), w_deq, bias.float(), residual=residual.float())
    for split in (1, 3, 4, 8):
        config = (16, 64, 4, 1, split)
        kwargs = dict(bias=bias, residual=residual, config=config, tile_counters=w.tile_counters)
        y = fp8_gemv(x, w.weight, w.scale, None, **kwargs)
        _close(y, exact, magnitude, W8A16_DOT_REL, f"gemv split {split} rows {rows}")
        assert torch.equal(fp8_gemv(x, w.weight, w.scale, None, **kwargs), y)
        assert torch.all(w.tile_counters == 0)


@interpreted_only
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_gemv_splits_k_and_scales_bf16_x_into_float16(x_dtype) -> None:
    """fp8_tc_gemv: K = 200 in 32-column steps over 1, 3 and 4 splits (the last ones short or
    empty), N = 80 in 64-row tiles, 1 and 4 rows, bias and residual; bf16 x with one tiny and one
    large value (float16 holds them only after the 2**-8 prescale); repeat calls bit-equal and the
    counters back at zero."""
    n, k = 80, 200
    w, w_deq, gen = _case(n, k, None, seed=9)
    for rows in (1, 4):
        x = torch.randn(rows, k, generator=gen).to(x_dtype)
        if x_dtype == torch.bfloat16:
            x[0, 3], x[0, 5] = 1e-7, 1.0e5  # below float16's subnormals; above its largest value
        bias = torch.randn(n, generator=gen).to(x_dtype)
        residual = torch.randn(rows, n, generator=gen).to(x_dtype)
        exact, magnitude = linear_reference(x.float(), w_deq, bias.float(), residual=residual.float())
        for split in (1, 3, 4):
            kwargs = dict(bias=bias, residual=residual, config=(64, 32, 2, 1, split))
            y = fp8_tc_gemv(x, w.weight, w.scale, w.tile_counters, **kwargs)
            _close(y, exact, magnitude, W8A16_DOT_REL, f"tc16 split {split}, {rows} rows, {x_dtype}")
            assert torch.equal(fp8_tc_gemv(x, w.weight, w.scale, w.tile_counters, **kwargs), y)
            assert torch.all(w.tile_counters == 0)


def test_gemv_k_split_refuses_what_it_cannot_reduce() -> None:
    w, _, _ = _case(40, 200, None)
    x = torch.zeros(1, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs int32 tile_counters .* at least 3 entries"):
        fp8_gemv(x, w.weight, w.scale, None, config=(16, 64, 4, 1, 2))
    with pytest.raises(ValueError, match="at least 3 entries"):
        fp8_gemv(x, w.weight, w.scale, None, config=(16, 64, 4, 1, 2), tile_counters=w.tile_counters[:2])
    wb, _, _ = _case(128, 256, BLOCK)
    with pytest.raises(ValueError, match="per-channel weights only"):
        config = (16, 128, 4, 1, 2)
        fp8_gemv(x.new_zeros(1, 256), wb.weight, wb.scale, BLOCK, config=config, tile_counters=wb.tile_counters)


def test_dispatch_by_rows_and_width() -> None:
    narrow = prepare_fp8_weights(torch.zeros(256, 256, dtype=torch.float8_e4m3fn), torch.ones(256), None)
    wide = prepare_fp8_weights(torch.zeros(512, 256, dtype=torch.float8_e4m3fn), torch.ones(512), None)
    dispatch = Fp8Dispatch(
        tc16_max_rows=0, gemv_max_rows=2, gemv_max_rows_wide=1, wide_n=300, skinny16_max_rows=8, skinny8_max_rows=32
    )
    rows = (1, 2, 3, 8, 9, 32, 33, 512)
    # CPU tensors never take torch._scaled_mm (cuBLASLt): the Triton GEMM serves large M here.
    assert [choose_path(torch.empty(m, 256), narrow, dispatch) for m in rows] == [
        "gemv", "gemv", "skinny16", "skinny16", "skinny8", "skinny8", "gemm", "gemm"
    ]
    assert [choose_path(torch.empty(m, 256), wide, dispatch) for m in rows][:2] == ["gemv", "skinny16"]
    default = [choose_path(torch.empty(m, 256), narrow) for m in (1, 2, 3, 4, 5, 64, 65)]
    # Per-channel weights: the CUDA-core GEMV at one row, the tensor-core one at two (measured on an
    # H200), skinny16 off; KernelConfig.fp8_tensor_core_gemv moves one row to tc16 too.
    assert default == ["gemv", "tc16", "skinny8", "skinny8", "skinny8", "skinny8", "gemm"]
    with_tc16 = Fp8Dispatch(tc16_min_rows=1, tc16_max_rows=4)
    assert [choose_path(torch.empty(m, 256), narrow, with_tc16) for m in (1, 2, 4, 5)] == ["tc16", "tc16", "tc16", "skinny8"]
    block = prepare_fp8_weights(torch.zeros(256, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 2), BLOCK)
    # tc16 reads per-channel weights only: block-scaled ones keep the GEMV up to its rows
    assert [choose_path(torch.empty(m, 256), block, with_tc16) for m in (1, 2, 3)] == ["gemv", "gemv", "skinny8"]
    with pytest.raises(ValueError, match="row limits"):
        Fp8Dispatch(gemv_max_rows=8)
    with pytest.raises(ValueError, match="row limits"):
        Fp8Dispatch(tc16_max_rows=5)
    with pytest.raises(ValueError, match="row limits"):
        Fp8Dispatch(tc16_min_rows=0)


def test_prepare_rejects_what_the_kernels_cannot_read() -> None:
    weight = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        prepare_fp8_weights(weight.to(torch.bfloat16), torch.ones(200), None)
    with pytest.raises(ValueError, match="needs 200 scales"):
        prepare_fp8_weights(weight, torch.ones(100), None)
    with pytest.raises(ValueError, match=r"needs scales \(2, 3\)"):
        prepare_fp8_weights(weight, torch.ones(2, 2), BLOCK)
    with pytest.raises(ValueError, match="supported for blocks"):
        prepare_fp8_weights(weight, torch.ones(4, 5), (64, 64))
    w = prepare_fp8_weights(weight, torch.ones(200, 1, dtype=torch.bfloat16), None)
    assert w.scale.shape == (200,) and w.scale.dtype == torch.float32 and w.scale_row.shape == (1, 200)
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        fp8_linear(torch.zeros(1, 300), w)


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the cases in the interpreter")
def test_cases_pass_in_an_interpreter_subprocess() -> None:
    INTERPRETED_RUN.assert_passes()


@interpreted_only
def test_the_kernel_config_sends_one_row_to_the_tensor_core_gemv(monkeypatch) -> None:
    """KernelConfig.fp8_tensor_core_gemv reaches fp8_linear's choice through the linear method: one
    row goes to tc16 with it, to the CUDA-core GEMV without (the default); both equal the product."""
    from tokenmill.config import KernelConfig
    from tokenmill.kernels.triton import fp8_linear as fp8
    from tokenmill.model.layers.fp8_linear import Fp8LinearMethod
    from tokenmill.model.layers.linear_method import LinearMethod
    from tokenmill.model.loader.quant_config import at_load_quantization

    w, w_deq, _ = _case(64, 256, None)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    taken: list[str] = []
    for name in ("tc16", "gemv"):
        monkeypatch.setitem(fp8.PATHS, name, lambda *a, _f=fp8.PATHS[name], _n=name: taken.append(_n) or _f(*a))
    for on, path in ((True, "tc16"), (False, "gemv")):
        method = Fp8LinearMethod(
            at_load_quantization("fp8"), LinearMethod(), use_kernels=True,
            kernel=KernelConfig(fp8_tensor_core_gemv=on),
        )  # fmt: skip
        y = method.apply_kernels(w, x, None, None, None)
        assert taken[-1] == path
        _close(y, x.float() @ w_deq.t(), (x.float().abs() @ w_deq.abs().t()), W8A16_DOT_REL, path)
