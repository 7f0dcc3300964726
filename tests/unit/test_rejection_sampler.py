"""The verification sampler: greedy keeps drafts exactly while they equal the argmax; random mode
emits tokens distributed as the target (a chi-square test on a small vocabulary)."""

from __future__ import annotations

import torch

from tokenmill.sample.metadata import RowSamplingInfo, SamplingMetadata, make_generator
from tokenmill.sample.rejection_sampler import VerifyLayout, verify_drafts
from tokenmill.sampling_params import SamplingParams

# Chi-square critical value for 7 degrees of freedom at p = 0.001: a correct sampler fails 1 in 1000.
CHI2_7DOF_P001 = 24.32


def _metadata(params: list[SamplingParams], vocab: int, generators=None) -> SamplingMetadata:
    infos = [
        RowSamplingInfo(params=p, prompt_token_ids=[1], output_token_ids=[], generator=(generators or {}).get(i))
        for i, p in enumerate(params)
    ]
    return SamplingMetadata.build(infos, "cpu", vocab)


def test_greedy_keeps_the_matching_run_and_adds_the_argmax():
    vocab = 6
    # Request 0: 3 drafts, argmax per row 2, 4, 1, 5 -> drafts [2, 4, 0] keep 2 and emit [2, 4, 1].
    # Request 1: no drafts -> its argmax 3. Request 2: 2 drafts [1, 1], all right -> + bonus 0.
    argmax = [2, 4, 1, 5, 3, 1, 1, 0]
    logits = torch.full((len(argmax), vocab), -1.0)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    drafts = [[2, 4, 0], [], [1, 1]]
    layout = VerifyLayout.build(drafts, torch.device("cpu"))
    md = _metadata([SamplingParams(temperature=0.0)] * len(argmax), vocab)
    packed = verify_drafts(logits, layout, md).packed.tolist()
    width = 4
    got = [(row[: row[width] + 1], row[width + 1]) for row in packed]
    assert got == [([2, 4, 1], 0), ([3], 0), ([1, 1, 0], 0)]


def test_non_finite_logits_flag_only_their_request():
    logits = torch.zeros(4, 5)
    logits[2, 1] = float("nan")
    layout = VerifyLayout.build([[0], [3]], torch.device("cpu"))
    md = _metadata([SamplingParams(temperature=0.0)] * 4, 5)
    packed = verify_drafts(logits, layout, md).packed.tolist()
    assert [row[-1] for row in packed] == [0, 1]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_random_mode_preserves_the_target_distribution():
    torch.manual_seed(0)
    vocab, n = 8, 20000
    target = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.07, 0.05, 0.03])
    second = torch.tensor([0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.10, 0.10])
    # n requests, each with drafts [1, 2]: row 0 judges draft 1 under `target`, row 1 judges draft 2
    # under `second` (given draft 1 was kept), row 2 is the bonus row.
    row_logits = torch.stack([target.log(), second.log(), target.log()])
    logits = row_logits.repeat(n, 1)
    layout = VerifyLayout.build([[1, 2]] * n, torch.device("cpu"))
    md = _metadata([SamplingParams(temperature=1.0)] * (3 * n), vocab)
    packed = verify_drafts(logits, layout, md).packed
    first = packed[:, 0]
    assert _chi_square(torch.bincount(first, minlength=vocab).double(), target.double()) < CHI2_7DOF_P001
    # Given the first token was the draft (kept), the second follows `second`.
    kept = packed[first == 1]
    assert len(kept) > 0.15 * n
    counts = torch.bincount(kept[:, 1], minlength=vocab).double()
    assert _chi_square(counts, second.double()) < CHI2_7DOF_P001
    # Acceptance of the first draft happens with probability p(draft) = 0.20.
    assert abs((packed[:, 3] >= 1).double().mean().item() - 0.20) < 0.02


def test_a_seeded_request_draws_the_same_whatever_shares_its_batch():
    vocab = 8
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=11)

    def run(extra_rows: int) -> list[int]:
        rows = logits if not extra_rows else torch.cat([torch.randn(extra_rows, vocab), logits])
        drafts = [[]] * extra_rows + [[4, 5]]
        generator = make_generator(11, "cpu")
        gens = {extra_rows + i: generator for i in range(3)}
        md = _metadata([SamplingParams(temperature=1.0)] * extra_rows + [params] * 3, vocab, gens)
        return verify_drafts(rows, VerifyLayout.build(drafts, torch.device("cpu")), md).packed[-1].tolist()

    assert run(0) == run(2)
