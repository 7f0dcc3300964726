"""The packed layout of INT4 expert weights (kernels/triton/moe_int4_layout.py): which CHUNK a
shape gets, where each column's nibble lies, and the round trip. The kernels' results on these
words are tested in test_fused_moe_int4_triton.py."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.triton.moe_int4_layout import int4_chunk, pack_int4_experts, unpack_int4_experts


@pytest.mark.parametrize(
    ("columns", "group", "chunk"),
    [
        (2048, 128, 32),  # Qwen3-30B-A3B gate/up: a pack of 256 columns holds two groups
        (768, 128, 32),  # its down projection: 3 packs
        (768, 768, 32),  # one group per row
        (2048, 32, 32),  # a group per plane
        (64, 32, 8),  # a tiny test model: packs of 64 columns
        (192, 64, 8),  # 192 is no multiple of 128: packs of 64, one group each
        (48, 24, 1),  # groups of 24: only single-word planes keep a plane in one group
    ],
)  # fmt: skip
def test_chunk_of_each_shape(columns, group, chunk):
    assert int4_chunk(columns, group) == chunk


@pytest.mark.parametrize(("columns", "group"), [(60, 20), (64, 24), (64, 12)])
def test_shapes_the_kernels_refuse_are_refused(columns, group):
    with pytest.raises(ValueError, match="multiples of 8"):
        int4_chunk(columns, group)


def test_each_column_lies_in_the_documented_nibble():
    """Word p of pack t holds column t * 8C + j * C + p in bits 4j..4j+3 (C = 16 for K 128 in one
    group)."""
    columns, chunk = 128, int4_chunk(128, 128)
    assert chunk == 16
    for column in (0, 1, 15, 16, 17, 100, 127):
        q = torch.zeros((1, 1, columns), dtype=torch.int32)
        q[0, 0, column] = 0xF
        words = pack_int4_experts(q, None)
        pack, rest = divmod(column, 8 * chunk)
        plane, p = divmod(rest, chunk)
        expected = torch.zeros(columns // 8, dtype=torch.int64)
        expected[pack * chunk + p] = 0xF << (4 * plane)
        assert torch.equal(words[0, 0].to(torch.int64) & 0xFFFFFFFF, expected), column


@pytest.mark.parametrize(("columns", "group"), [(256, 64), (96, 32), (48, 24), (512, None)])
def test_pack_then_unpack_gives_the_codes_back(columns, group):
    q = torch.randint(0, 16, (3, 5, columns), generator=torch.Generator().manual_seed(columns))
    words = pack_int4_experts(q, group)
    assert words.dtype == torch.int32 and words.shape == (3, 5, columns // 8)
    assert torch.equal(unpack_int4_experts(words, group), q.to(torch.int32))
