"""The batched multi-LoRA kernels (kernels/triton/lora.py) on a CUDA GPU at Llama-3.1-8B shapes with
the tile table's choices, against the torch loop over slots of tests/unit/test_lora_kernels.py.

Layers (K, parts): qkv 4096 -> 4096 + 1024 + 1024, o 4096 -> 4096, gate_up 4096 -> 14336 + 14336,
down 14336 -> 4096; T from 1 to 8192 (every token-class of the table), ranks 8 to 64, up to 32
slots, some empty, some tokens without a slot; one CUDA graph replayed after the mapping buffers
change (the grid does not depend on the counts).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    # Compile mode for this process: triton must be imported before the CPU tests in tests/unit
    # switch on TRITON_INTERPRET (they then rerun themselves in a subprocess).
    import triton  # noqa: F401

    from tests.unit.test_lora_kernels import (
        make_mapping,
        random_adapters,
        random_slots,
        reference_expand,
        reference_shrink,
        starts_of,
    )
    from tokenmill.bench.timing import capture_graph
    from tokenmill.kernels.triton.lora import lora_apply, lora_scratch, lora_shrink

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

LAYERS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


def _check_apply(num_tokens, num_slots, layer, rank, dtype=torch.bfloat16, *, empty=(), no_slot=0.1, seed=0):
    k, part_rows = LAYERS[layer]
    slot_of = random_slots(num_tokens, num_slots, empty=empty, no_slot=no_slot, seed=seed)
    mapping = make_mapping(slot_of, num_slots, t_cap=num_tokens, seed=seed, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=gen, device="cuda").to(dtype)
    y = torch.randn(num_tokens, sum(part_rows), generator=gen, device="cuda").to(dtype)
    lora_a, lora_b = random_adapters(num_slots, k, part_rows, rank, dtype, seed=seed, device="cuda")
    starts = starts_of(part_rows)

    n = len(part_rows) * rank
    scratch = lora_scratch(num_tokens, num_slots, n, "cuda")
    shrunk = torch.full((num_tokens, n), float("nan"), device="cuda")
    lora_shrink(x, lora_a, shrunk, *mapping.args(), scratch=scratch)  # the table's split-K
    expected = reference_shrink(x, lora_a, mapping.slot_of)
    has_slot = mapping.slot_of >= 0
    # 16-bit inputs, float32 sums in another order (or tf32 for float32 inputs)
    torch.testing.assert_close(shrunk[has_slot], expected[has_slot], rtol=2e-3, atol=2e-3)
    assert torch.isnan(shrunk[~has_slot]).all()

    y_ref = reference_expand(expected.nan_to_num(), lora_b, y, mapping.slot_of, starts, part_rows, rank)
    assert not scratch.counters.any()
    unsplit = torch.full_like(shrunk, float("nan"))
    lora_shrink(x, lora_a, unsplit, *mapping.args())
    torch.testing.assert_close(unsplit[has_slot], expected[has_slot], rtol=2e-3, atol=2e-3)
    lora_apply(x, y, lora_a, lora_b, *mapping.args(), starts, part_rows, torch.empty_like(shrunk), scratch)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 * ulp, atol=4 * ulp)
    assert torch.equal(y[~has_slot], y_ref[~has_slot])


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 512, 1000, 4096])
def test_llama_layers_rank_16_eight_slots(layer: str, num_tokens: int) -> None:
    _check_apply(num_tokens, 8, layer, 16, empty=(5,), seed=num_tokens)


@pytest.mark.parametrize("rank", [8, 32, 64])
@pytest.mark.parametrize("num_tokens", [3, 300, 2048])
def test_ranks(rank: int, num_tokens: int) -> None:
    _check_apply(num_tokens, 4, "qkv", rank, seed=rank)


def test_thirty_two_slots_and_the_largest_batch() -> None:
    _check_apply(8192, 32, "qkv", 16, empty=(0, 7, 31), seed=1)
    _check_apply(8192, 2, "down", 16, seed=2)


def test_all_tokens_on_one_slot_and_float32() -> None:
    _check_apply(777, 8, "gate_up", 16, empty=tuple(range(7)), no_slot=0.0, seed=3)
    _check_apply(129, 8, "qkv", 16, torch.float32, seed=4)


def test_a_captured_graph_follows_new_mappings() -> None:
    """Capture once, then rewrite the static mapping buffers (different counts, empty slots, no
    slot at all) and replay: each replay matches the reference of its mapping."""
    num_tokens, num_slots, rank = 256, 8, 16
    k, part_rows = LAYERS["qkv"]
    starts = starts_of(part_rows)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(num_tokens, k, generator=gen, device="cuda").bfloat16()
    y0 = torch.randn(num_tokens, sum(part_rows), generator=gen, device="cuda").bfloat16()
    lora_a, lora_b = random_adapters(num_slots, k, part_rows, rank, torch.bfloat16, seed=5, device="cuda")
    first = make_mapping(random_slots(num_tokens, num_slots, seed=6), num_slots, t_cap=num_tokens, device="cuda")
    ids, slot_starts, slot_counts = (t.clone() for t in first.args())
    y = y0.clone()
    scratch = lora_scratch(num_tokens, num_slots, len(part_rows) * rank, "cuda")
    shrunk = torch.empty(num_tokens, len(part_rows) * rank, device="cuda")
    graph = capture_graph(
        lambda: lora_apply(x, y, lora_a, lora_b, ids, slot_starts, slot_counts, starts, part_rows, shrunk, scratch)
    )
    mappings = [
        random_slots(num_tokens, num_slots, empty=(1, 2, 3), seed=7),
        torch.full((num_tokens,), 4),
        torch.full((num_tokens,), -1),
        random_slots(num_tokens, num_slots, no_slot=0.5, seed=8),
    ]
    for slot_of in mappings:
        m = make_mapping(slot_of, num_slots, t_cap=num_tokens, seed=9, device="cuda")
        for static, new in zip((ids, slot_starts, slot_counts), m.args(), strict=True):
            static.copy_(new)
        y.copy_(y0)
        graph.replay()
        # (a new name: rebinding `shrunk` would free the buffer the graph writes into)
        expected = reference_shrink(x, lora_a, m.slot_of).nan_to_num()
        y_ref = reference_expand(expected, lora_b, y0, m.slot_of, starts, part_rows, rank)
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-6, atol=2**-5)
