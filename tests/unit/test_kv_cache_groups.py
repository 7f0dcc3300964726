"""The KV cache groups plan: layers grouped by attention type into groups of G layers over one pool."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache_groups import max_live_sliding_blocks, plan_kv_cache_groups


def _check_layout(plan, num_layers: int) -> None:
    """Every layer in exactly one group, at the tensor index of its place in that group."""
    seen = sorted(layer for group in plan.groups for layer in group.layers)
    assert seen == list(range(num_layers))
    for g, group in enumerate(plan.groups):
        assert 1 <= len(group.layers) <= plan.num_tensors
        for j, layer in enumerate(group.layers):
            assert plan.layer_group[layer] == g and plan.layer_tensor[layer] == j


def test_all_full_is_one_group_of_every_layer() -> None:
    plan = plan_kv_cache_groups(4, ())
    assert plan.num_groups == 1 and plan.num_tensors == 4 and not plan.has_sliding
    assert plan.groups[0].sliding_window is None and plan.groups[0].layers == (0, 1, 2, 3)
    assert plan.layer_tensor == (0, 1, 2, 3) and plan.layer_group == (0, 0, 0, 0)
    assert plan_kv_cache_groups(3, (None, None, None)) == plan_kv_cache_groups(3, ())


def test_mistral_like_every_layer_sliding_is_one_sliding_group() -> None:
    plan = plan_kv_cache_groups(4, (32,) * 4)
    assert plan.num_groups == 1 and plan.num_tensors == 4 and plan.has_sliding
    assert plan.groups[0].sliding_window == 32 and plan.groups[0].layers == (0, 1, 2, 3)
    _check_layout(plan, 4)


def test_gemma2_like_alternating_layers_make_two_groups_of_half() -> None:
    windows = tuple(8 if i % 2 == 0 else None for i in range(6))  # sliding, full, sliding, ...
    plan = plan_kv_cache_groups(6, windows)
    assert plan.num_tensors == 3
    assert [(g.sliding_window, g.layers) for g in plan.groups] == [(None, (1, 3, 5)), (8, (0, 2, 4))]
    # Layer 0 (sliding) and layer 1 (full) share tensor 0 with different block tables.
    assert plan.layer_tensor[:2] == (0, 0) and plan.layer_group[:2] == (1, 0)
    _check_layout(plan, 6)


def test_gemma3_like_five_to_one_pads_the_last_sliding_group() -> None:
    windows = tuple(None if (i + 1) % 6 == 0 else 16 for i in range(26))  # 4 full, 22 sliding layers
    plan = plan_kv_cache_groups(26, windows)
    assert plan.num_tensors == 4  # the smallest type's layer count
    assert plan.groups[0].sliding_window is None and plan.groups[0].layers == (5, 11, 17, 23)
    sliding = plan.groups[1:]
    assert [len(g.layers) for g in sliding] == [4, 4, 4, 4, 4, 2]  # 22 = 5 x 4 + 2: the last padded
    assert all(g.sliding_window == 16 for g in sliding)
    _check_layout(plan, 26)


def test_near_equal_types_pad_one_group_instead_of_splitting() -> None:
    windows = tuple(None if i < 11 else 64 for i in range(24))  # 11 full, 13 sliding: 13 < 1.25 * 11
    plan = plan_kv_cache_groups(24, windows)
    assert plan.num_tensors == 13 and plan.num_groups == 2
    assert len(plan.groups[0].layers) == 11 and len(plan.groups[1].layers) == 13
    _check_layout(plan, 24)


def test_distinct_windows_are_distinct_groups_in_a_fixed_order() -> None:
    plan = plan_kv_cache_groups(4, (64, None, 8, 64))
    # Full first, then windows ascending; G = 1 (the smallest type), so window 64 takes two groups.
    assert plan.sliding_windows() == [None, 8, 64, 64] and plan.num_tensors == 1
    assert [g.layers for g in plan.groups] == [(1,), (2,), (0,), (3,)]
    _check_layout(plan, 4)


def test_a_window_covering_max_model_len_counts_as_full() -> None:
    plan = plan_kv_cache_groups(4, (128, None, 128, None), max_model_len=128)
    assert plan.num_groups == 1 and not plan.has_sliding
    assert plan_kv_cache_groups(4, (127, None, 127, None), max_model_len=128).num_groups == 2


def test_bad_windows_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="sliding_windows has 3 entries but the model has 4 layers"):
        plan_kv_cache_groups(4, (8, None, 8))
    with pytest.raises(ValueError, match="layer 1 has sliding window 0"):
        plan_kv_cache_groups(2, (8, 0))


def test_blocks_for_one_sequence_bounds_sliding_groups_by_the_window() -> None:
    block_size = 16
    assert max_live_sliding_blocks(32, block_size, 1) == 3  # ceil(32 / 16) + 1
    full = plan_kv_cache_groups(2, ())
    assert full.blocks_for_one_sequence(1000, block_size, 64) == 63  # ceil(1000 / 16), no null block
    hybrid = plan_kv_cache_groups(2, (32, None))
    # full: 63; sliding: ceil((31 + 64) / 16) + 1 = 7; plus the null block.
    assert hybrid.blocks_for_one_sequence(1000, block_size, 64) == 63 + 7 + 1
    # A sequence shorter than its window holds no more than its own blocks.
    assert hybrid.blocks_for_one_sequence(20, block_size, 64) == 2 + 2 + 1


def test_capacity_tokens_is_the_longest_sequence_one_request_can_reach() -> None:
    assert plan_kv_cache_groups(2, ()).capacity_tokens(10, 16, 64, 4096) == 160  # as without groups
    mistral = plan_kv_cache_groups(2, (32, 32))
    # Sliding blocks stop growing at the window: 6 blocks (5 + the null block) serve any length.
    assert mistral.capacity_tokens(6, 16, 32, 4096) == 4096
    assert mistral.capacity_tokens(5, 16, 32, 4096) == 64  # 4 live blocks + the null block: 64 tokens
    hybrid = plan_kv_cache_groups(2, (32, None))
    # The full group bounds it: 40 blocks = 1 null + 5 sliding + 34 full -> 34 * 16 tokens.
    capacity = hybrid.capacity_tokens(40, 16, 32, 4096)
    assert capacity == 34 * 16
    assert hybrid.blocks_for_one_sequence(capacity, 16, 32) <= 40 < hybrid.blocks_for_one_sequence(capacity + 1, 16, 32)
