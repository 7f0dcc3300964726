"""The CPU argmax over logit rows (csrc/cpu_layer_ops.cpp, argmax_rows) against torch.argmax, and
the sampler's greedy path that uses it."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu.build import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available()[0], reason="the CPU kernels cannot be built here")


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill_cpu.argmax_rows(logits)


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (5, 16), (4, 17), (64, 49152), (9, 1000)])
def test_equals_torch_argmax_on_random_rows(rows: int, vocab: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.equal(_argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [5, 16, 40, 49152])
def test_ties_take_the_first_index_and_nan_wins_as_in_torch(vocab: int) -> None:
    rows = []
    for first, second in [(0, 1), (3, vocab - 1), (vocab - 2, vocab - 1), (1, 17), (16, 32)]:
        if second >= vocab or first >= second:
            continue
        tie = torch.zeros(vocab)
        tie[first] = tie[second] = 2.0  # a tie in different lanes, the later one in the tail
        rows.append(tie)
        nan = torch.randn(vocab)
        nan[second] = float("nan")
        rows.append(nan)
        two_nans = torch.randn(vocab)
        two_nans[first] = two_nans[second] = float("nan")
        rows.append(two_nans)
        inf = torch.randn(vocab)
        inf[second] = float("inf")
        rows.append(inf)
    rows.append(torch.full((vocab,), float("-inf")))
    rows.append(torch.zeros(vocab))
    negative_zero = torch.zeros(vocab)
    negative_zero[0] = -0.0
    rows.append(negative_zero)
    logits = torch.stack(rows)
    assert torch.equal(_argmax_rows(logits), logits.argmax(dim=-1))


def test_the_sampler_greedy_path_uses_it_and_agrees() -> None:
    from tokenmill.sample.sampler import greedy_argmax

    logits = torch.randn(8, 3000)
    logits[2, 100] = float("nan")
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    doubles = logits.double()  # other dtypes: torch's argmax
    assert torch.equal(greedy_argmax(doubles), doubles.argmax(dim=-1))


def test_refuses_bad_input() -> None:
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be"):
        _argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be"):
        _argmax_rows(torch.zeros(4))
