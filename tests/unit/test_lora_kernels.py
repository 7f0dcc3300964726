"""The batched multi-LoRA kernels (kernels/triton/lora.py) on the CPU under TRITON_INTERPRET=1, tiny
shapes, against a plain-torch loop over slots (`reference_shrink` / `reference_expand`, also used by
tests/gpu/test_lora_kernels_gpu.py). The tile table (lora_tiles.py) is checked without kernels.

As in test_int4_kernels.py: TRITON_INTERPRET must be set before triton is first imported; if this
process imported triton compiled, the kernel cases skip and one test reruns this file in an
interpreter subprocess.
"""

from __future__ import annotations

import dataclasses
import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.kernels.triton.lora import lora_apply, lora_expand, lora_scratch, lora_shrink  # noqa: E402
from tokenmill.kernels.triton.lora_tiles import (  # noqa: E402
    MAX_SPLIT_K,
    LoraTiles,
    expand_tiles,
    shrink_counters,
    shrink_scratch_numel,
    shrink_tiles,
)

INTERPRETED_RUN = interpreted_run(__file__)  # run by the subprocess test below

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)


# -- the reference and the inputs (shared with the GPU tests) ----------------------------------------


@dataclasses.dataclass
class Mapping:
    slot_of: torch.Tensor  # [T] int64, -1: no slot
    sorted_token_ids: torch.Tensor  # [T_cap] int32
    slot_starts: torch.Tensor  # [S] int32
    slot_counts: torch.Tensor  # [S] int32

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sorted_token_ids, self.slot_starts, self.slot_counts


def make_mapping(
    slot_of: torch.Tensor, num_slots: int, *, t_cap: int | None = None, seed: int = 0, device: str = "cpu"
) -> Mapping:
    """The kernels' mapping of `slot_of` (-1: no slot): ids grouped by slot in a shuffled order
    within each slot, padded to `t_cap` with a junk id the counts never reach."""
    gen = torch.Generator().manual_seed(seed)
    ids, starts, counts = [], [], []
    for s in range(num_slots):
        mine = torch.nonzero(slot_of == s).flatten()
        mine = mine[torch.randperm(mine.numel(), generator=gen)]
        starts.append(len(ids))
        counts.append(mine.numel())
        ids.extend(mine.tolist())
    t_cap = max(t_cap or 0, len(ids), 1)
    ids += [slot_of.numel() + 12345] * (t_cap - len(ids))  # out of range: reading it would fault / differ
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return Mapping(slot_of.to(device), as_i32(ids), as_i32(starts), as_i32(counts))


def random_slots(num_tokens: int, num_slots: int, *, empty: tuple[int, ...] = (), no_slot: float = 0.2, seed: int = 0):
    """Each token on a random slot (none of `empty`), or on none with probability `no_slot`."""
    gen = torch.Generator().manual_seed(seed)
    used = torch.tensor([s for s in range(num_slots) if s not in empty])
    slot_of = used[torch.randint(0, used.numel(), (num_tokens,), generator=gen)]
    slot_of[torch.rand(num_tokens, generator=gen) < no_slot] = -1
    return slot_of


def reference_shrink(x: torch.Tensor, lora_a: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """float32 [T, P*R]: x[t] @ A[slot].T for the tokens with a slot (in float64, a loop over
    slots), NaN on the rows of tokens without one."""
    result = torch.full((x.shape[0], lora_a.shape[1]), float("nan"), device=x.device)
    for s in range(lora_a.shape[0]):
        tokens = torch.nonzero(slot_of == s).flatten()
        if tokens.numel():
            result[tokens] = (x[tokens].double() @ lora_a[s].double().T).float()
    return result


def reference_expand(
    shrunk: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slot_of: torch.Tensor, part_starts, part_rows, rank
) -> torch.Tensor:
    """A new y: y[t, part p] + shrunk[t, p-th R columns] @ B[slot, part p].T, in y's dtype."""
    out = y.clone()
    for s in range(lora_b.shape[0]):
        tokens = torch.nonzero(slot_of == s).flatten()
        if not tokens.numel():
            continue
        for p, (start, rows) in enumerate(zip(part_starts, part_rows, strict=True)):
            delta = shrunk[tokens, p * rank : (p + 1) * rank].double() @ lora_b[s, start : start + rows].double().T
            out[tokens, start : start + rows] = (y[tokens, start : start + rows].double() + delta).to(y.dtype)
    return out


def random_adapters(num_slots, k, part_rows, rank, dtype, *, seed=0, device="cpu"):
    """lora_a [S, P*R, K] and lora_b [S, OUT, R] scaled so the delta is about as large as y."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = (torch.randn(num_slots, len(part_rows) * rank, k, generator=gen) / k**0.5).to(dtype)
    lora_b = (torch.randn(num_slots, sum(part_rows), rank, generator=gen) / rank**0.5).to(dtype)
    return lora_a.to(device), lora_b.to(device)


def starts_of(part_rows) -> tuple[int, ...]:
    return tuple(sum(part_rows[:p]) for p in range(len(part_rows)))


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """float32: the kernels' own float32 sums; 16-bit: y's rounding plus the 16-bit shrunk values
    that the GPU's expand multiplies (each a relative 2^-8 of a delta of about y's size)."""
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-5}


# -- the tile table ---------------------------------------------------------------------------------------


def test_split_k_falls_as_tokens_grow_and_the_scratch_serves_every_size() -> None:
    for n, k in ((48, 4096), (16, 14336), (32, 4096), (192, 4096), (8, 64)):
        splits = [shrink_tiles(t, n, k).split_k for t in range(1, 8193, 37)]
        assert splits == sorted(splits, reverse=True) and min(splits) >= 1 and max(splits) <= MAX_SPLIT_K
        for max_tokens in (1, 100, 512, 513, 1000, 4096, 8192):
            numel, counters = shrink_scratch_numel(max_tokens, n), shrink_counters(max_tokens, 32, n)
            for t in range(1, max_tokens + 1, 7):
                tiles = shrink_tiles(t, n, k)
                assert tiles.split_k * t * n <= numel, (n, k, max_tokens, t)
                programs = (-(-t // tiles.block_m) + min(32, t)) * -(-n // tiles.block_n)
                assert programs <= counters, (n, k, max_tokens, t)
    for t in (1, 64, 512, 4096, 8192):
        for cfg in (shrink_tiles(t, 48, 4096), expand_tiles(t, 28672, 16)):
            cfg.check()
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        LoraTiles(16, 24, 16).check()


def test_refuses_bad_calls() -> None:
    x = torch.zeros(4, 32)
    lora_a, lora_b = random_adapters(2, 32, (16, 8), 8, torch.float32)
    m = make_mapping(torch.tensor([0, 1, -1, 0]), 2)
    with pytest.raises(ValueError, match=r"float32 out of \[T, P\*R\] = \[4, 16\]"):
        lora_shrink(x, lora_a, torch.zeros(4, 8), *m.args())
    with pytest.raises(ValueError, match="contiguous 1-D int32"):
        lora_shrink(x, lora_a, torch.zeros(4, 16), m.sorted_token_ids.long(), m.slot_starts, m.slot_counts)
    with pytest.raises(ValueError, match="one entry per slot"):
        lora_shrink(x, lora_a, torch.zeros(4, 16), m.sorted_token_ids, m.slot_starts[:1], m.slot_counts)
    with pytest.raises(ValueError, match="the scratch holds"):
        small = lora_scratch(1, 1, 8, "cpu")  # 16 splits of 1 row of 8 columns
        split_16 = dataclasses.replace(SMALL, split_k=16)
        lora_shrink(x, lora_a, torch.zeros(4, 16), *m.args(), scratch=small, tiles=split_16)
    with pytest.raises(ValueError, match="tile OUT in order"):
        lora_expand(torch.zeros(4, 16), lora_b, torch.zeros(4, 24), *m.args(), (0, 8), (16, 8), 8)
    with pytest.raises(ValueError, match="cover 20 rows"):
        lora_expand(torch.zeros(4, 16), lora_b, torch.zeros(4, 24), *m.args(), (0, 16), (16, 4), 8)
    with pytest.raises(ValueError, match=r"y must be \[T, 24\]"):
        lora_expand(torch.zeros(4, 16), lora_b, torch.zeros(4, 32), *m.args(), (0, 16), (16, 8), 8)


# -- the kernels, interpreted ----------------------------------------------------------------------------

SMALL = LoraTiles(16, 16, 16, num_warps=1, num_stages=1)

def _run_shrink(x, lora_a, mapping, tiles=None):
    """The shrink's out as written (NaN: not written), split-K over a scratch when tiles say so."""
    out = torch.full((x.shape[0], lora_a.shape[1]), float("nan"))
    scratch = lora_scratch(x.shape[0], lora_a.shape[0], lora_a.shape[1], "cpu")
    lora_shrink(x, lora_a, out, *mapping.args(), scratch=scratch, tiles=tiles)
    assert not scratch.counters.any()  # every tile's count reset for the next launch
    return out


@interpreted_only
@pytest.mark.parametrize(
    "num_tokens, num_slots, k, part_rows, rank, dtype, splits, tiles, empty",
    [
        (24, 4, 64, (64, 32, 32), 8, torch.float32, 1, None, (2,)),  # qkv of the tiny model, default tiles
        (24, 4, 64, (64, 32, 32), 8, torch.bfloat16, 1, None, (2,)),
        (37, 3, 72, (40, 24), 16, torch.float32, 3, SMALL, ()),  # K % BLOCK_K != 0, split-K planes
        (37, 3, 72, (40, 24), 16, torch.bfloat16, 2, SMALL, (0,)),
        (1, 2, 64, (64,), 8, torch.float32, 2, SMALL, ()),  # one token
        (50, 5, 48, (24,), 32, torch.float32, 1, LoraTiles(32, 32, 16), (1, 3)),
    ],
)
def test_shrink_and_expand_match_the_reference(num_tokens, num_slots, k, part_rows, rank, dtype, splits, tiles, empty):
    slot_of = random_slots(num_tokens, num_slots, empty=empty, seed=num_tokens)
    mapping = make_mapping(slot_of, num_slots, t_cap=num_tokens + 5, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    lora_a, lora_b = random_adapters(num_slots, k, part_rows, rank, dtype, seed=3)

    if tiles is not None:
        tiles = dataclasses.replace(tiles, split_k=splits)
    shrunk = _run_shrink(x, lora_a, mapping, tiles)
    expected = reference_shrink(x, lora_a, slot_of)
    has_slot = slot_of >= 0
    # float32 sums of exact products either way
    torch.testing.assert_close(shrunk[has_slot], expected[has_slot], rtol=1e-5, atol=1e-5)
    assert torch.isnan(shrunk[~has_slot]).all()  # tokens with no slot: never written
    if splits > 1:  # the same sums in the same order: bit for bit on a second launch
        assert torch.equal(_run_shrink(x, lora_a, mapping, tiles)[has_slot], shrunk[has_slot])

    shrunk = torch.nan_to_num(shrunk)
    y = torch.randn(num_tokens, sum(part_rows), generator=gen).to(dtype)
    y_ref = reference_expand(shrunk, lora_b, y, slot_of, starts_of(part_rows), part_rows, rank)
    lora_expand(shrunk, lora_b, y, *mapping.args(), starts_of(part_rows), part_rows, rank, tiles=tiles)
    torch.testing.assert_close(y, y_ref, **tolerances(dtype))
    assert torch.equal(y[slot_of < 0], y_ref[slot_of < 0])  # untouched rows: bit for bit


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_with_all_tokens_on_one_slot(dtype) -> None:
    """Every token on the last slot: it spans several M tiles, the other slots are empty."""
    num_tokens, num_slots, k, part_rows, rank = 40, 3, 256, (32, 16), 8  # K 256: split-K 4
    slot_of = torch.full((num_tokens,), num_slots - 1)
    mapping = make_mapping(slot_of, num_slots)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(part_rows), generator=gen).to(dtype)
    lora_a, lora_b = random_adapters(num_slots, k, part_rows, rank, dtype, seed=5)
    shrunk = reference_shrink(x, lora_a, slot_of)
    y_ref = reference_expand(shrunk, lora_b, y, slot_of, starts_of(part_rows), part_rows, rank)
    scratch = lora_scratch(num_tokens, num_slots, len(part_rows) * rank, "cpu")
    out = torch.empty(num_tokens, len(part_rows) * rank)
    lora_apply(x, y, lora_a, lora_b, *mapping.args(), starts_of(part_rows), part_rows, out, scratch)
    torch.testing.assert_close(y, y_ref, **tolerances(dtype))


@interpreted_only
def test_apply_leaves_every_row_alone_when_no_token_has_a_slot() -> None:
    num_tokens, k, part_rows, rank = 20, 32, (16,), 8
    mapping = make_mapping(torch.full((num_tokens,), -1), 4, t_cap=num_tokens)
    lora_a, lora_b = random_adapters(4, k, part_rows, rank, torch.float32)
    y = torch.randn(num_tokens, 16)
    before = y.clone()
    scratch = lora_scratch(num_tokens, 4, rank, "cpu")
    out = torch.empty(num_tokens, rank)
    lora_apply(torch.randn(num_tokens, k), y, lora_a, lora_b, *mapping.args(), (0,), part_rows, out, scratch)
    assert torch.equal(y, before)


@interpreted_only
def test_expand_into_a_wider_output_view() -> None:
    """y may be a column slice of a wider buffer (row stride > OUT): only its own columns change."""
    num_tokens, num_slots, rank, part_rows = 18, 2, 8, (24, 8)
    slot_of = random_slots(num_tokens, num_slots, seed=6)
    mapping = make_mapping(slot_of, num_slots)
    _, lora_b = random_adapters(num_slots, 16, part_rows, rank, torch.float32, seed=7)
    shrunk = torch.randn(num_tokens, 2 * rank)
    wide = torch.randn(num_tokens, 48)
    y_ref = reference_expand(shrunk, lora_b, wide[:, 8:40], slot_of, (0, 24), part_rows, rank)
    before = wide.clone()
    lora_expand(shrunk, lora_b, wide[:, 8:40], *mapping.args(), (0, 24), part_rows, rank, tiles=SMALL)
    torch.testing.assert_close(wide[:, 8:40], y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 40:], before[:, 40:])


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the cases in the interpreter")
def test_cases_pass_in_an_interpreter_subprocess() -> None:
    INTERPRETED_RUN.assert_passes()
