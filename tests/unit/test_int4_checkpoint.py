"""AWQ, GPTQ and compressed-tensors pack-quantized unpacking (model/loader/int4_checkpoint.py):
hand-packed words that pin the nibble orders, round trips through the test-side packers of
tests/model/quantized_checkpoints.py (and compressed-tensors' own pack_to_int32), act-order, the two
GPTQ zero conventions, and the shape checks' errors."""

from __future__ import annotations

import pytest
import torch

from tests.model.quantized_checkpoints import (
    act_order_g_idx,
    pack_along_columns,
    pack_along_rows,
    pack_awq,
    to_int32,
)
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.layers.quantize_weights import dequantize_int4, quantize_int4
from tokenmill.model.loader.int4_checkpoint import (
    check_packed_shapes,
    expected_awq_shapes,
    expected_gptq_shapes,
    expected_pack_quantized_shapes,
    unpack_awq,
    unpack_gptq,
    unpack_pack_quantized,
)


def _word(hex_value: int) -> int:
    """A 32-bit pattern as the int32 a checkpoint stores."""
    return hex_value - 2**32 if hex_value >= 2**31 else hex_value


def test_awq_hand_packed_words():
    # N = 8 output columns, K = 2 input rows, one group of 2. AWQ's word holds, from its lowest
    # nibble up, columns 0 2 4 6 1 3 5 7.
    # Row 0 wants columns [1..8]: nibbles (low to high) 1 3 5 7 2 4 6 8 -> 0x86427531 (negative).
    # Row 1, word 0x12345678: nibbles 8 7 6 5 4 3 2 1 -> columns 0,2,4,6 = 8,7,6,5 and 1,3,5,7 = 4,3,2,1.
    qweight = torch.tensor([[_word(0x86427531)], [_word(0x12345678)]], dtype=torch.int32)
    # Zeros 0..7 in column order: nibbles 0 2 4 6 1 3 5 7 -> 0x75316420.
    qzeros = torch.tensor([[_word(0x75316420)]], dtype=torch.int32)
    scales = torch.arange(1, 9, dtype=torch.float16).reshape(1, 8)
    q, out_scales, zeros, group_size, g_idx = unpack_awq(qweight, qzeros, scales, 2)
    assert q.shape == (8, 2) and q.dtype == torch.uint8
    assert q[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert q[:, 1].tolist() == [8, 4, 7, 3, 6, 2, 5, 1]
    assert zeros[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert out_scales.dtype == torch.float16 and out_scales[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert group_size == 2 and g_idx.tolist() == [0, 0]
    # W[n, 0] = (q - zero) * scale = (n + 1 - n) * (n + 1).
    assert dequantize_int4(q, out_scales, zeros, group_size, g_idx)[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_gptq_hand_packed_words_v1_and_v2_zeros():
    # K = 8 input rows packed in one word per column, k = 0..7 from the lowest nibble up; N = 8.
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    qweight[0, 0] = _word(0x87654321)  # column 0: k -> k + 1
    qweight[0, 3] = _word(0xF000000E)  # column 3: k=0 -> 14, k=7 -> 15
    # qzeros packed along N in plain order: column n's nibble is n (0x76543210).
    qzeros = torch.tensor([[_word(0x76543210)]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    v1 = unpack_gptq(qweight, qzeros, scales, None, 8, sym=False, zeros_offset=1)
    assert v1.q[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert v1.q[3].tolist() == [14, 0, 0, 0, 0, 0, 0, 15]
    assert v1.q[1].tolist() == [0] * 8
    assert v1.zeros[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # "gptq" stores zero - 1
    v2 = unpack_gptq(qweight, qzeros, scales, None, 8, sym=False, zeros_offset=0)
    assert v2.zeros[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # "gptq_v2" stores the zero
    assert v2.g_idx.tolist() == [0] * 8 and v2.scales.shape == (8, 1)
    # Column 0 dequantized: (k + 1 - 1) * 0.5 with v1 zeros, (k + 1) * 0.5 with v2 zeros.
    assert dequantize_int4(*v1)[0].tolist() == [k * 0.5 for k in range(8)]
    assert dequantize_int4(*v2)[0].tolist() == [(k + 1) * 0.5 for k in range(8)]


def test_gptq_v1_zero_of_zero_reads_back():
    # A zero point 0 is stored as -1: the nibble 15, which +1 must bring back to 0, not 16.
    qzeros = torch.tensor([[_word(0x7777777F)]], dtype=torch.int32)
    unpacked = unpack_gptq(
        torch.zeros(1, 8, dtype=torch.int32), qzeros, torch.ones(1, 8, dtype=torch.float16), None, 8, False, 1
    )
    assert unpacked.zeros[:, 0].tolist() == [0, 8, 8, 8, 8, 8, 8, 8]


def _canonical(n: int, k: int, group_size: int, symmetric: bool, g_idx=None, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1 + 0.01
    return quantize_int4(w, group_size, symmetric, g_idx=g_idx)


def _assert_same(unpacked, canonical) -> None:
    for field in ("q", "scales", "zeros", "g_idx"):
        got, want = getattr(unpacked, field), getattr(canonical, field)
        assert got.dtype == want.dtype and torch.equal(got, want), field
    assert unpacked.group_size == canonical.group_size


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_round_trip(group_size):
    canonical = _canonical(64, 256, group_size, symmetric=False)
    qweight = pack_awq(canonical.q.t().contiguous())
    qzeros = pack_awq(canonical.zeros.t().contiguous())
    scales = canonical.scales.t().contiguous()
    assert list(qweight.shape) == [256, 8] and list(qzeros.shape) == [256 // group_size, 8]
    _assert_same(unpack_awq(qweight, qzeros, scales, group_size), canonical)


@pytest.mark.parametrize(
    ("group_size", "sym", "desc_act", "zeros_offset"),
    [
        (128, True, False, 1),
        (32, False, False, 1),
        (32, True, True, 1),
        (64, False, True, 1),
        (32, False, False, 0),
        (32, True, True, 0),
        (-1, False, False, 1),
    ],
)
def test_gptq_round_trip(group_size, sym, desc_act, zeros_offset):
    n, k = 64, 256
    g_idx = act_order_g_idx(k, group_size, seed=5) if desc_act else None
    canonical = _canonical(n, k, group_size, symmetric=sym, g_idx=g_idx)
    stored_zeros = ((canonical.zeros.to(torch.int64) - zeros_offset) & 0xF).to(torch.uint8)
    qweight = pack_along_rows(canonical.q.t().contiguous())
    qzeros = pack_along_columns(stored_zeros.t().contiguous())
    scales = canonical.scales.t().contiguous()
    unpacked = unpack_gptq(qweight, qzeros, scales, canonical.g_idx, group_size, sym, zeros_offset)
    _assert_same(unpacked, canonical)


def test_gptq_act_order_keeps_columns_in_place_and_groups_by_g_idx():
    n, k, group_size = 16, 64, 32
    g_idx = act_order_g_idx(k, group_size, seed=7)
    assert sorted(g_idx.tolist()) == [i // group_size for i in range(k)]
    assert g_idx.tolist() != [i // group_size for i in range(k)]  # really shuffled
    canonical = _canonical(n, k, group_size, symmetric=False, g_idx=g_idx, seed=8)
    unpacked = unpack_gptq(
        pack_along_rows(canonical.q.t().contiguous()),
        pack_along_columns(((canonical.zeros.to(torch.int64) - 1) & 0xF).to(torch.uint8).t().contiguous()),
        canonical.scales.t().contiguous(),
        g_idx,
        group_size,
        False,
        1,
    )
    deq = dequantize_int4(*unpacked)
    # Column k is dequantized with the scale and zero of group g_idx[k], not of k // group_size.
    for col in (0, 1, 33, 63):
        g = int(g_idx[col])
        expected = (unpacked.q[:, col].float() - unpacked.zeros[:, g].float()) * unpacked.scales[:, g].float()
        assert torch.equal(deq[:, col], expected)


def test_gptq_sym_checkpoint_with_wrong_format_is_an_error():
    canonical = _canonical(16, 64, 32, symmetric=True)
    # Written as gptq_v2 (zeros 8 stored as 8) but read as "gptq" (+1): zeros would come out 9.
    qzeros = pack_along_columns(canonical.zeros.t().contiguous())
    with pytest.raises(
        UnsupportedModelError, match=r"layers\.0\.q_proj\.qzeros .*zero points \[9\].*checkpoint_format"
    ):
        unpack_gptq(
            pack_along_rows(canonical.q.t().contiguous()),
            qzeros,
            canonical.scales.t().contiguous(),
            canonical.g_idx,
            32,
            True,
            1,
            layer="layers.0.q_proj",
        )


def test_expected_shapes():
    assert expected_awq_shapes(4096, 11008, 128) == {
        "qweight": (11008, 512),
        "qzeros": (86, 512),
        "scales": (86, 4096),
    }
    assert expected_gptq_shapes(4096, 11008, 128) == {
        "qweight": (1376, 4096),
        "qzeros": (86, 512),
        "scales": (86, 4096),
        "g_idx": (11008,),
    }
    # GPTQ allows a partial last group and group_size -1 (one group).
    assert expected_gptq_shapes(64, 80, 32)["scales"] == (3, 64)
    assert expected_gptq_shapes(64, 80, -1)["qzeros"] == (1, 8)
    assert expected_awq_shapes(64, 256, -1)["scales"] == (1, 64)


def test_shape_errors_name_the_tensor_and_both_shapes():
    tensors = {
        "qweight": torch.zeros(256, 8, dtype=torch.int32),
        "scales": torch.zeros(2, 64),
        "qzeros": None,
    }
    with pytest.raises(UnsupportedModelError) as err:
        check_packed_shapes(
            "model.layers.0.mlp.down_proj", tensors, expected_awq_shapes(64, 256, 32), "awq g32"
        )
    assert "model.layers.0.mlp.down_proj.scales has shape [2, 64]" in str(err.value)
    assert "needs [8, 64]" in str(err.value)
    with pytest.raises(UnsupportedModelError, match="AWQ out_features \\(60\\) must be a multiple of 8"):
        expected_awq_shapes(60, 256, 32)
    with pytest.raises(
        UnsupportedModelError, match="in_features \\(80\\) to be a multiple of group_size \\(32\\)"
    ):
        expected_awq_shapes(64, 80, 32)
    with pytest.raises(UnsupportedModelError, match="GPTQ in_features \\(60\\) must be a multiple of 8"):
        expected_gptq_shapes(64, 60, 32)


def test_unpack_rejects_tensors_that_disagree_with_qweight():
    canonical = _canonical(64, 128, 32, symmetric=False)
    qweight = pack_awq(canonical.q.t().contiguous())
    qzeros = pack_awq(canonical.zeros.t().contiguous())
    scales = canonical.scales.t().contiguous()
    with pytest.raises(UnsupportedModelError, match=r"o_proj\.qzeros has shape \[3, 8\].*needs \[4, 8\]"):
        unpack_awq(qweight, qzeros[:3], scales, 32, layer="o_proj")
    with pytest.raises(UnsupportedModelError, match=r"o_proj\.scales has shape \[4, 63\].*needs \[4, 64\]"):
        unpack_awq(qweight, qzeros, scales[:, :63], 32, layer="o_proj")
    with pytest.raises(UnsupportedModelError, match=r"o_proj\.qweight should be 2-D int32.*torch\.int64"):
        unpack_awq(qweight.long(), qzeros, scales, 32, layer="o_proj")
    with pytest.raises(UnsupportedModelError, match=r"o_proj\.scales should be floating point"):
        unpack_awq(qweight, qzeros, scales.to(torch.int32), 32, layer="o_proj")
    gptq_qweight = pack_along_rows(canonical.q.t().contiguous())
    gptq_zeros = pack_along_columns(canonical.zeros.t().contiguous())
    with pytest.raises(UnsupportedModelError, match=r"o_proj\.g_idx has shape \[127\].*needs \[128\]"):
        unpack_gptq(gptq_qweight, gptq_zeros, scales, canonical.g_idx[:127], 32, False, 0, layer="o_proj")
    bad_g_idx = canonical.g_idx.clone()
    bad_g_idx[5] = 4
    with pytest.raises(
        UnsupportedModelError, match=r"o_proj\.g_idx names groups 0..4, but there are 4 groups"
    ):
        unpack_gptq(gptq_qweight, gptq_zeros, scales, bad_g_idx, 32, False, 0, layer="o_proj")


def test_to_int32_keeps_the_bits():
    words = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    assert to_int32(words).tolist() == [0, 1, 2**31 - 1, -(2**31), -1]


# ------------------------------------------------------------------ compressed-tensors pack-quantized


def test_pack_quantized_hand_packed_words():
    # N = 8 rows, K = 8 columns (one word per row, k = 0..7 from the lowest nibble up), one group.
    # Each nibble is the signed value + 8, i.e. q itself.
    weight_packed = torch.zeros(8, 1, dtype=torch.int32)
    weight_packed[0, 0] = _word(0x87654321)  # row 0: k -> k + 1
    weight_packed[5, 0] = _word(0xF000000E)  # row 5: k=0 -> 14, k=7 -> 15
    # Zero points packed along N: the group's one word holds rows 0..7 from the lowest nibble up.
    zero_point = torch.tensor([[_word(0x76543210)]], dtype=torch.int32)
    scale = torch.full((8, 1), 0.5, dtype=torch.bfloat16)
    asym = unpack_pack_quantized(weight_packed, scale, zero_point, None, 8, weight_shape=torch.tensor([8, 8]))
    assert asym.q.shape == (8, 8) and asym.q.dtype == torch.uint8
    assert asym.q[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert asym.q[5].tolist() == [14, 0, 0, 0, 0, 0, 0, 15]
    assert asym.zeros[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert asym.scales.dtype == torch.bfloat16 and asym.g_idx.tolist() == [0] * 8 and asym.group_size == 8
    assert dequantize_int4(*asym)[0].tolist() == [(k + 1) * 0.5 for k in range(8)]  # row 0's zero is 0
    sym = unpack_pack_quantized(weight_packed, scale, None, None, -1)
    assert sym.zeros.tolist() == [[8]] * 8 and sym.group_size == 8  # symmetric: no tensor, zero 8
    assert dequantize_int4(*sym)[0].tolist() == [(k + 1 - 8) * 0.5 for k in range(8)]


@pytest.mark.parametrize(
    ("group_size", "symmetric", "act_order"),
    [(128, True, False), (32, False, False), (64, False, True), (32, True, True), (-1, False, False)],
)
def test_pack_quantized_round_trip_through_compressed_tensors_packing(group_size, symmetric, act_order):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    n, k = 64, 256
    groups = k if group_size == -1 else group_size
    g_idx = act_order_g_idx(k, groups, seed=3) if act_order else None
    canonical = _canonical(n, k, groups, symmetric, g_idx=g_idx)
    signed_q = (canonical.q.to(torch.int16) - 8).to(torch.int8)
    weight_packed = pack_to_int32(signed_q, 4)
    assert torch.equal(unpack_from_int32(weight_packed, 4, torch.Size((n, k))), signed_q)  # their own reading
    zero_point = None
    if not symmetric:
        zero_point = pack_to_int32((canonical.zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0)
        assert list(zero_point.shape) == [n // 8, canonical.zeros.shape[1]]
    unpacked = unpack_pack_quantized(
        weight_packed, canonical.scales, zero_point, g_idx, group_size, weight_shape=torch.tensor([n, k])
    )
    _assert_same(unpacked, canonical)


def test_pack_quantized_expected_shapes():
    assert expected_pack_quantized_shapes(4096, 11008, 128, symmetric=False) == {
        "weight_packed": (4096, 1376),
        "weight_scale": (4096, 86),
        "weight_shape": (2,),
        "weight_g_idx": (11008,),
        "weight_zero_point": (512, 86),
    }
    assert "weight_zero_point" not in expected_pack_quantized_shapes(64, 256, 32, symmetric=True)
    assert expected_pack_quantized_shapes(64, 256, -1, symmetric=False)["weight_zero_point"] == (8, 1)
    with pytest.raises(UnsupportedModelError, match=r"pack-quantized out_features \(zero points\) \(60\)"):
        expected_pack_quantized_shapes(60, 256, 32, symmetric=False)
    with pytest.raises(UnsupportedModelError, match=r"pack-quantized in_features \(60\) must be a multiple of 8"):
        expected_pack_quantized_shapes(64, 60, 32, symmetric=True)


def test_pack_quantized_rejects_tensors_that_disagree_with_weight_packed():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    canonical = _canonical(64, 128, 32, symmetric=False)
    packed = pack_to_int32((canonical.q.to(torch.int16) - 8).to(torch.int8), 4)
    zero_point = pack_to_int32((canonical.zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0)
    scale = canonical.scales

    def unpack(packed=packed, scale=scale, zero_point=zero_point, g_idx=None, shape=(64, 128)):
        return unpack_pack_quantized(
            packed, scale, zero_point, g_idx, 32, weight_shape=torch.tensor(shape), layer="mlp.down_proj"
        )

    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight_scale has shape \[64, 3\].*needs \[64, 4\]"):
        unpack(scale=scale[:, :3])
    with pytest.raises(
        UnsupportedModelError, match=r"down_proj\.weight_zero_point has shape \[64, 4\].*needs \[8, 4\]"
    ):  # written unpacked, one zero per row
        unpack(zero_point=canonical.zeros.to(torch.int32))
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight_shape holds \[64, 120\].*\[64, 128\]"):
        unpack(shape=(64, 120))
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight_shape has shape \[3\]"):
        unpack(shape=(64, 128, 1))
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight_g_idx has shape \[127\].*needs \[128\]"):
        unpack(g_idx=canonical.g_idx[:127])
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight_packed should be 2-D int32.*torch\.uint8"):
        unpack(packed=canonical.q)
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight_scale should be floating point"):
        unpack(scale=scale.to(torch.int32))
