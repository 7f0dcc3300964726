"""The round-to-nearest quantizers and dequantizers of model/layers/quantize_weights.py: the forms
they produce, their error bounds (FP8: e4m3's half ulp; INT4: half a scale step), partial FP8
blocks, all-zero rows and groups, act-order group assignment, and the errors for bad shapes."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.model.layers.quantize_weights import (
    FP8_MAX,
    dequantize_fp8,
    dequantize_int4,
    quantize_fp8_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    quantize_int4,
)

# e4m3: 3 mantissa bits, so a normal value rounds to within 2^-4 of itself (half an ulp); below the
# smallest normal (2^-6) the step is 2^-9, so the absolute error is at most 2^-10 (times the scale).
E4M3_HALF_ULP = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10


def _wide_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Values over many binades, so normal and subnormal e4m3 codes both occur."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, k, generator=gen) * 2)


def _fp8_scale_per_element(scale: torch.Tensor, n: int, k: int, block) -> torch.Tensor:
    """Each element's scale, spelled out with loops (independently of the code under test)."""
    out = torch.empty(n, k)
    if block is None:
        return out.copy_(scale.reshape(-1, 1).expand(n, k) if scale.numel() == n else scale.reshape(1, 1))
    for i in range(n):
        for j in range(k):
            out[i, j] = scale[i // block[0], j // block[1]]
    return out


def _assert_fp8_bound(w: torch.Tensor, quantized) -> None:
    weight, scale, block = quantized
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert not torch.isnan(weight.float()).any()
    per_element = _fp8_scale_per_element(scale, *w.shape, block)
    error = (w - dequantize_fp8(weight, scale, block)).abs()
    # The bound, plus float32 rounding of w / scale and of the product (a few ulp of fp32).
    bound = torch.maximum(E4M3_HALF_ULP * w.abs(), E4M3_SUBNORMAL_HALF_STEP * per_element) + 1e-6 * w.abs()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item()}"


@pytest.mark.parametrize(
    "quantize",
    [quantize_fp8_per_tensor, quantize_fp8_per_channel, lambda w: quantize_fp8_block(w, (128, 128))],
    ids=["tensor", "channel", "block"],
)
def test_fp8_error_within_half_ulp(quantize):
    w = _wide_weight(160, 200, seed=1)
    _assert_fp8_bound(w, quantize(w))


def test_fp8_scale_shapes_and_absmax_maps_to_448():
    w = _wide_weight(200, 300, seed=2)
    tensor = quantize_fp8_per_tensor(w)
    channel = quantize_fp8_per_channel(w)
    block = quantize_fp8_block(w, (128, 128))
    assert tensor.weight_scale.shape == (1,) and tensor.block is None
    assert channel.weight_scale.shape == (200,) and channel.block is None
    assert block.weight_scale.shape == (2, 3) and block.block == (128, 128)
    torch.testing.assert_close(tensor.weight_scale, w.abs().max().reshape(1) / FP8_MAX)
    torch.testing.assert_close(channel.weight_scale, w.abs().amax(dim=1) / FP8_MAX)
    # Each row's largest value lands on the largest e4m3 code.
    rows = torch.arange(200)
    top = channel.weight.float()[rows, w.abs().argmax(dim=1)].abs()
    assert (top == FP8_MAX).all()


def test_fp8_partial_blocks_scale_by_the_part_that_exists():
    # N = 200 and K = 300 leave partial tiles along both axes: rows 128..199, columns 256..299.
    w = _wide_weight(200, 300, seed=3)
    quantized = quantize_fp8_block(w, (128, 128))
    for i, rows in enumerate([slice(0, 128), slice(128, 200)]):
        for j, cols in enumerate([slice(0, 128), slice(128, 256), slice(256, 300)]):
            expected = w[rows, cols].abs().max() / FP8_MAX
            torch.testing.assert_close(quantized.weight_scale[i, j], expected)
    _assert_fp8_bound(w, quantized)
    # A block smaller than the weight's dims in one axis only, and one larger than the weight.
    _assert_fp8_bound(w, quantize_fp8_block(w, (64, 512)))
    small = _wide_weight(5, 7, seed=4)
    assert quantize_fp8_block(small, (128, 128)).weight_scale.shape == (1, 1)
    _assert_fp8_bound(small, quantize_fp8_block(small, (128, 128)))


def test_fp8_all_zero_rows_and_tiles_are_exact_and_finite():
    w = _wide_weight(256, 256, seed=5)
    w[3] = 0  # an all-zero row
    w[128:, 128:] = 0  # an all-zero tile
    for quantized in (quantize_fp8_per_channel(w), quantize_fp8_block(w, (128, 128))):
        assert torch.isfinite(quantized.weight_scale).all() and (quantized.weight_scale > 0).all()
        deq = dequantize_fp8(*quantized)
        assert (deq[3] == 0).all() and (deq[128:, 128:] == 0).all()
    zero = quantize_fp8_per_tensor(torch.zeros(8, 16))
    assert torch.isfinite(zero.weight_scale).all()
    assert (dequantize_fp8(*zero) == 0).all()


def test_fp8_works_from_16_bit_weights():
    w = _wide_weight(64, 256, seed=6).to(torch.bfloat16)
    _assert_fp8_bound(w.float(), quantize_fp8_block(w, (128, 128)))
    _assert_fp8_bound(w.float(), quantize_fp8_per_channel(w))


def test_dequantize_fp8_takes_checkpoint_scale_shapes_and_names_wrong_ones():
    w = _wide_weight(16, 32, seed=7)
    weight, scale, _ = quantize_fp8_per_channel(w)
    torch.testing.assert_close(dequantize_fp8(weight, scale[:, None]), dequantize_fp8(weight, scale))
    tensor_weight, tensor_scale, _ = quantize_fp8_per_tensor(w)
    torch.testing.assert_close(
        dequantize_fp8(tensor_weight, tensor_scale.reshape(())), dequantize_fp8(tensor_weight, tensor_scale)
    )
    with pytest.raises(ValueError, match=r"got shape \(15,\)"):
        dequantize_fp8(weight, scale[:15])
    with pytest.raises(ValueError, match=r"have shape \(1, 1\); got \(2, 1\)"):
        dequantize_fp8(weight, torch.ones(2, 1), (128, 128))
    with pytest.raises(ValueError, match="block is two positive integers"):
        quantize_fp8_block(w, (128, 0))
    with pytest.raises(ValueError, match="weight \\[out_features, in_features\\]"):
        quantize_fp8_per_channel(w[0])


def _int4_scale_per_element(scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return scales.float()[:, g_idx.long()]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_int4_error_within_half_a_step(symmetric, group_size, scale_dtype):
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(48, 256, generator=gen) * 0.1 + 0.02  # an offset, so asymmetric ranges differ
    quantized = quantize_int4(w, group_size, symmetric, scale_dtype=scale_dtype)
    q, scales, zeros, size, g_idx = quantized
    groups = 1 if group_size == -1 else 256 // group_size
    assert q.dtype == torch.uint8 and q.shape == (48, 256) and int(q.max()) <= 15
    assert scales.dtype == scale_dtype and scales.shape == (48, groups)
    assert zeros.dtype == torch.uint8 and zeros.shape == (48, groups) and int(zeros.max()) <= 15
    assert size == (256 if group_size == -1 else group_size)
    assert g_idx.dtype == torch.int32 and g_idx.tolist() == [k // size for k in range(256)]
    if symmetric:
        assert (zeros == 8).all()
    error = (w - dequantize_int4(*quantized)).abs()
    step = _int4_scale_per_element(scales, g_idx)
    assert (error <= step / 2 * (1 + 1e-6)).all(), f"worst {(error / step).max().item()} steps"


def test_int4_asymmetric_zero_is_rounded_minus_min_over_scale():
    w = torch.tensor([[-0.3, -0.1, 0.2, 0.45] * 8])  # one row, one group of 32
    q, scales, zeros, _, _ = quantize_int4(w, 32, symmetric=False)
    scale = scales.float()[0, 0]
    # The range is [-0.3, 0.45]: a step of 0.75 / 15 (rounded up into fp16) and zero round(0.3 / step).
    assert 0.05 <= scale <= 0.05 * (1 + 2**-9)
    assert zeros[0, 0] == round(0.3 / scale.item()) == 6
    assert q[0, :4].tolist() == [0, 4, 10, 15]
    # Symmetric: 2 * absmax / 15 with zero 8.
    _, sym_scales, sym_zeros, _, _ = quantize_int4(w, 32, symmetric=True)
    assert 0.06 <= sym_scales.float()[0, 0] <= 0.06 * (1 + 2**-9) and sym_zeros[0, 0] == 8


def test_int4_range_includes_zero_so_one_signed_groups_keep_the_bound():
    w = torch.rand(8, 64, generator=torch.Generator().manual_seed(9)) + 1.0  # all in [1, 2)
    for symmetric in (True, False):
        quantized = quantize_int4(w, 32, symmetric)
        step = _int4_scale_per_element(quantized.scales, quantized.g_idx)
        assert ((w - dequantize_int4(*quantized)).abs() <= step / 2 * (1 + 1e-6)).all()


def test_int4_all_zero_groups_dequantize_to_zero():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(10))
    w[2] = 0
    w[5, 32:] = 0
    for symmetric in (True, False):
        quantized = quantize_int4(w, 32, symmetric)
        assert torch.isfinite(quantized.scales.float()).all() and (quantized.scales.float() > 0).all()
        deq = dequantize_int4(*quantized)
        assert (deq[2] == 0).all() and (deq[5, 32:] == 0).all()


def test_int4_act_order_groups_follow_g_idx():
    k, size = 128, 32
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(11))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // size).to(torch.int32)
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(12))
    quantized = quantize_int4(w, size, symmetric=False, g_idx=g_idx)
    assert torch.equal(quantized.g_idx, g_idx)
    # Group g's scale covers exactly the columns g_idx puts in it: the columns perm[32g:32g+32].
    for g in range(k // size):
        columns = perm[g * size : (g + 1) * size]
        span = torch.maximum(w[:, columns].amax(dim=1), torch.zeros(16)) - torch.minimum(
            w[:, columns].amin(dim=1), torch.zeros(16)
        )
        torch.testing.assert_close(quantized.scales.float()[:, g], span / 15, rtol=2e-3, atol=0)
    step = _int4_scale_per_element(quantized.scales, g_idx)
    assert ((w - dequantize_int4(*quantized)).abs() <= step / 2 * (1 + 1e-6)).all()


def test_int4_bad_inputs_name_what_is_wrong():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="names groups 0..2, but there are 2 groups"):
        quantize_int4(w, 32, True, g_idx=(torch.arange(64) // 32 + (torch.arange(64) == 40)).to(torch.int32))
    with pytest.raises(ValueError, match="positive number of input columns or -1"):
        quantize_int4(w, 0, True)
    q, scales, zeros, size, g_idx = quantize_int4(w, 32, True)
    with pytest.raises(
        ValueError, match=r"scales of a \[8, 64\] weight in groups of 32 have shape \[8, 2\]; got \[8, 1\]"
    ):
        dequantize_int4(q, scales[:, :1], zeros, size, g_idx)
    with pytest.raises(ValueError, match=r"g_idx of a \[8, 64\] weight has shape \[64\]; got \[63\]"):
        dequantize_int4(q, scales, zeros, size, g_idx[:63])


def test_int4_groups_need_not_divide_k():
    # GPTQ allows K % group_size != 0: the last group is partial (ceil(K / G) groups).
    w = torch.randn(8, 80, generator=torch.Generator().manual_seed(13))
    quantized = quantize_int4(w, 32, symmetric=False)
    assert quantized.scales.shape == (8, math.ceil(80 / 32))
    step = _int4_scale_per_element(quantized.scales, quantized.g_idx)
    assert ((w - dequantize_int4(*quantized)).abs() <= step / 2 * (1 + 1e-6)).all()
