"""Sampler: each filter and penalty against a naive per-row reference, seeds, logprobs, no NaN."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sample.metadata import RowSamplingInfo, SamplingMetadata, make_generator
from tokenmill.sample.penalties import apply_penalties
from tokenmill.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_k_top_p,
    compute_token_logprobs,
)
from tokenmill.sampling_params import SamplingParams

NEG_INF = float("-inf")


def row(prompt=(1, 2, 3), output=(), generator=None, eos=(), **params) -> RowSamplingInfo:
    return RowSamplingInfo(SamplingParams(**params), list(prompt), list(output), generator, eos)


def sample(logits: torch.Tensor, rows: list[RowSamplingInfo]):
    md = SamplingMetadata.build(rows, logits.device, logits.shape[-1])
    return Sampler()(logits, md), md


def kept(logits: torch.Tensor) -> torch.Tensor:
    return logits > NEG_INF


# --- naive references, one row at a time -------------------------------------------------------


def naive_top_k(row_logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= row_logits.numel():
        return torch.ones_like(row_logits, dtype=torch.bool)
    kth = torch.topk(row_logits, k).values[-1]
    return row_logits >= kth


def naive_top_p(row_logits: torch.Tensor, p: float) -> torch.Tensor:
    probs = torch.softmax(row_logits.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = torch.zeros(len(probs), dtype=torch.bool)
    mass = 0.0
    for i in order:
        if mass >= p:
            break
        keep[i] = True
        mass += probs[i]
    return keep


def naive_min_p(row_logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(row_logits, dim=-1)
    return probs >= min_p * probs.max()


def naive_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.clone()
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


# --- greedy -----------------------------------------------------------------------------------------


def test_all_greedy_takes_argmax_and_returns_no_logprobs():
    logits = torch.randn(6, 100)
    out, md = sample(logits, [row(temperature=0.0) for _ in range(6)])
    assert md.all_greedy and md.no_penalties and md.no_top_k and md.no_top_p and md.no_min_p
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.to_token_logprobs(md) is None


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    logits = torch.randn(8, 50)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.5, top_k=10) for i in range(8)]
    for _ in range(5):
        out, md = sample(logits, rows)
        assert not md.all_greedy and not md.all_random
        assert torch.equal(out.sampled_token_ids[::2], logits[::2].argmax(-1))


def test_input_logits_are_not_modified():
    logits = torch.randn(4, 64) * 3
    before = logits.clone()
    sample(
        logits,
        [
            row(
                temperature=0.7,
                top_p=0.5,
                top_k=5,
                min_p=0.1,
                repetition_penalty=1.3,
                presence_penalty=1.0,
                output=[1, 2],
                logprobs=2,
                min_tokens=3,
                eos=[0],
            )
        ]
        * 4,
    )
    assert torch.equal(logits, before)


# --- filters --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_top_k_matches_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 300
    logits = torch.randn(7, vocab, generator=gen) * 2
    ks = [1, 2, 17, vocab, 0, 299, 5]
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k in ks])
    expected = torch.stack([naive_top_k(logits[i], k) for i, k in enumerate(ks)])
    assert torch.equal(kept(apply_top_k(logits, top_k, max(k for k in ks if 0 < k < vocab))), expected)
    # The sorted path (used when top_p is also on) keeps the same set when top_p is off.
    ones = torch.ones(7)
    assert torch.equal(kept(apply_top_k_top_p(logits, top_k, ones, None)), expected)


@pytest.mark.parametrize("seed", range(5))
def test_top_p_matches_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 200, generator=gen) * 3
    ps = [1e-6, 0.1, 0.5, 0.9, 0.999, 1.0]
    top_p = torch.tensor(ps)
    expected = torch.stack([naive_top_p(logits[i], p) for i, p in enumerate(ps)])
    assert torch.equal(kept(apply_top_k_top_p(logits, None, top_p, None)), expected)


@pytest.mark.parametrize("use_topk_candidates", [False, True])
def test_top_k_then_top_p_renormalises_over_top_k(use_topk_candidates):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 500, generator=gen) * 2
    ks, ps = [3, 40, 1, 500], [0.6, 0.8, 0.5, 0.7]
    expected = []
    for i, (k, p) in enumerate(zip(ks, ps, strict=True)):
        after_k = logits[i].masked_fill(~naive_top_k(logits[i], k), NEG_INF)
        expected.append(naive_top_p(after_k, p) & naive_top_k(logits[i], k))
    top_k = torch.tensor(ks)
    max_top_k = 500 if use_topk_candidates else None
    got = apply_top_k_top_p(logits, top_k, torch.tensor(ps), max_top_k)
    assert torch.equal(kept(got), torch.stack(expected))


@pytest.mark.parametrize("seed", range(3))
def test_min_p_matches_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 100, generator=gen) * 2
    mps = [0.0, 0.01, 0.1, 0.5, 1.0]
    expected = torch.stack([naive_min_p(logits[i], p) for i, p in enumerate(mps)])
    assert torch.equal(kept(apply_min_p(logits, torch.tensor(mps))), expected)


def test_sampled_tokens_stay_inside_the_filtered_set():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 64, generator=gen).repeat(400, 1)
    configs = [dict(top_k=5), dict(top_p=0.3), dict(min_p=0.3), dict(top_k=10, top_p=0.5, min_p=0.05)]
    for cfg in configs:
        out, _ = sample(logits, [row(temperature=1.0, **cfg) for _ in range(400)])
        allowed = torch.ones(64, dtype=torch.bool)
        if "min_p" in cfg:
            allowed &= naive_min_p(logits[0], cfg["min_p"])
        if "top_k" in cfg:
            allowed &= naive_top_k(logits[0].masked_fill(~allowed, NEG_INF), cfg["top_k"])
        if "top_p" in cfg:
            allowed &= naive_top_p(logits[0].masked_fill(~allowed, NEG_INF), cfg["top_p"])
        assert allowed[out.sampled_token_ids].all(), cfg
        assert allowed.sum() > 1, cfg  # a real choice was left
        assert len(set(out.sampled_token_ids.tolist())) > 1, cfg  # and it was sampled from


@pytest.mark.parametrize(
    "params", [dict(top_p=1e-9), dict(top_k=1), dict(min_p=1.0), dict(top_k=1, top_p=1e-9, min_p=1.0)]
)
def test_extreme_filters_leave_the_top_token_and_no_nan(params):
    logits = torch.randn(16, 1000) * 5
    logits[3] = 0.0  # a flat row: every token ties for the top
    out, _ = sample(logits, [row(temperature=1.0, logprobs=3, **params) for _ in range(16)])
    ids = out.sampled_token_ids
    rows = [i for i in range(16) if i != 3]
    assert torch.equal(ids[rows], logits[rows].argmax(-1))
    assert 0 <= ids[3] < 1000
    assert not out.logprobs.isnan().any()


def test_temperature_sampling_follows_softmax():
    vocab, draws, temperature = 8, 8000, 0.7
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=gen)
    torch.manual_seed(0)  # unseeded rows share the global RNG
    out, _ = sample(logits.repeat(draws, 1), [row(temperature=temperature) for _ in range(draws)])
    observed = torch.bincount(out.sampled_token_ids, minlength=vocab).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1) * draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 30.0  # 7 degrees of freedom: p ~ 1e-4


# --- seeds ------------------------------------------------------------------------------------------


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_seeded_row_is_reproducible_whatever_the_batch(device):
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(6, 500, generator=gen).to(device) for _ in range(6)]  # row 0: the seeded one
    target = dict(temperature=1.0, top_p=0.95)

    def run(position: int, others: list[dict]) -> list[int]:
        """Samples the seeded request for every step at `position` among `others`."""
        generator = make_generator(1234, device)
        tokens = []
        for logits in steps:
            rows = [
                row(generator=make_generator(i, device) if p.pop("seeded", False) else None, **p)
                for i, p in enumerate(dict(o) for o in others)
            ]
            rows.insert(position, row(generator=generator, **target))
            other_logits = list(logits[1 : len(others) + 1])
            other_logits.insert(position, logits[0])
            out, _ = sample(torch.stack(other_logits), rows)
            tokens.append(out.sampled_token_ids[position].item())
        return tokens

    alone = run(0, [])
    assert run(2, [dict(temperature=0.0), dict(temperature=0.5, top_k=3), dict(temperature=2.0)]) == alone
    assert run(1, [dict(temperature=0.9, seeded=True), dict(temperature=1.0), dict(top_k=7)]) == alone
    assert run(4, [dict(temperature=1.2)] * 5) == alone
    assert len(set(alone)) > 1


def test_different_seeds_give_different_samples():
    logits = torch.zeros(1, 10_000)
    a, _ = sample(logits, [row(generator=make_generator(1, "cpu"))])
    b, _ = sample(logits, [row(generator=make_generator(2, "cpu"))])
    assert a.sampled_token_ids.item() != b.sampled_token_ids.item()


# --- penalties ---------------------------------------------------------------------------------------


def test_penalties_match_naive_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab, generator=gen) * 3
    cases = [
        dict(prompt=[1, 2, 3, 3], output=[4, 4, 4, 1, 9], presence=0.5, frequency=0.3, repetition=1.3),
        dict(prompt=[5, 6], output=[], presence=1.0, frequency=1.0, repetition=1.7),
        dict(prompt=[7], output=[8, 8], presence=0.0, frequency=0.0, repetition=1.0),
        dict(prompt=[10, 11], output=[11, 12, 12], presence=-0.5, frequency=-1.0, repetition=0.8),
        dict(prompt=[0], output=[39, 39, 0], presence=2.0, frequency=0.0, repetition=1.0),
    ]
    rows = [
        row(
            c["prompt"],
            c["output"],
            temperature=0.0,
            presence_penalty=c["presence"],
            frequency_penalty=c["frequency"],
            repetition_penalty=c["repetition"],
        )
        for c in cases
    ]
    md = SamplingMetadata.build(rows, "cpu", vocab)
    got = apply_penalties(logits, md)
    for i, c in enumerate(cases):
        expected = naive_penalties(
            logits[i], c["prompt"], c["output"], c["presence"], c["frequency"], c["repetition"]
        )
        torch.testing.assert_close(got[i], expected)
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, got.argmax(-1))  # greedy sees the penalised logits


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, -1.0]])
    out, _ = sample(logits, [row(prompt=[1], temperature=0.0, repetition_penalty=1.5)])
    assert out.sampled_token_ids.item() == 2


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]] * 3)
    rows = [
        row(output=[1], eos=[0], temperature=0.0, min_tokens=2, stop_token_ids=[2]),  # banned: 0, 2
        row(output=[1, 1], eos=[0], temperature=0.0, min_tokens=2),  # reached: nothing banned
        row(output=[], eos=[0], temperature=0.0, min_tokens=1, ignore_eos=True),  # eos not a stop
    ]
    out, _ = sample(logits, rows)
    assert out.sampled_token_ids.tolist() == [1, 0, 0]


# --- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=gen)
    rows = [
        row(temperature=0.0, logprobs=3, repetition_penalty=2.0, output=[0, 1, 2]),
        row(temperature=5.0, logprobs=0),
        row(temperature=0.5, top_k=2),
        row(temperature=1.0, logprobs=5, generator=make_generator(0, "cpu")),
    ]
    out, md = sample(logits, rows)
    assert md.max_num_logprobs == 5
    reference = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[:, 1:], reference.topk(5, dim=-1).indices)
    for i in range(4):
        order = reference[i].argsort(descending=True).tolist()
        assert out.sampled_ranks[i].item() == order.index(sampled[i].item()) + 1

    per_row = out.to_token_logprobs(md)
    assert per_row[2] is None
    assert len(per_row[0].token_ids) == 4 and len(per_row[1].token_ids) == 1
    assert len(per_row[3].logprobs) == 6
    assert per_row[1].token_ids[0] == sampled[1].item()
    assert per_row[1].rank == out.sampled_ranks[1].item()
    assert math.isclose(per_row[0].logprobs[0], reference[0, sampled[0]].item(), rel_tol=1e-6)


def test_compute_token_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 20, generator=gen)
    targets = torch.tensor([3, 0, 19, 7, 7])
    token_lp, rank, top_ids, top_lp = compute_token_logprobs(logits, targets, 4)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(token_lp, reference[torch.arange(5), targets])
    assert torch.equal(top_ids, reference.topk(4).indices)
    torch.testing.assert_close(top_lp, reference.topk(4).values)
    expected_rank = (reference > reference[torch.arange(5), targets].unsqueeze(1)).sum(-1) + 1
    assert torch.equal(rank, expected_rank)
    assert top_ids.shape == (5, 4) and compute_token_logprobs(logits, targets, 0)[2].shape == (5, 0)


# --- CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_matches_and_never_syncs():
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 1000, generator=gen) * 3).to(device)
    rows = [
        row(temperature=0.0, repetition_penalty=1.2, output=[1, 2], logprobs=2),
        row(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, presence_penalty=0.5, output=[3]),
        row(temperature=1.0, generator=make_generator(7, device), frequency_penalty=0.2),
        row(temperature=1.0, top_p=0.5, min_tokens=5, eos=[0]),
        row(temperature=0.0),
        row(temperature=1.3, top_k=1),
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = SamplingMetadata.build(rows, device, 1000)
        out = Sampler()(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"
    cpu_rows = list(rows)
    cpu_rows[2] = row(temperature=1.0, generator=make_generator(7, "cpu"), frequency_penalty=0.2)
    cpu_out, _ = sample(logits.cpu(), cpu_rows)
    ids = out.sampled_token_ids.cpu()
    for i in (0, 4, 5):  # the deterministic rows agree with the CPU path
        assert ids[i] == cpu_out.sampled_token_ids[i]
    assert ids[1] in logits[1].topk(20).indices.cpu()
    assert ids[3] != 0  # banned until min_tokens
    # Top alternatives agree everywhere; the sampled token's column only where it is deterministic.
    lps, cpu_lps = out.logprobs.cpu(), cpu_out.logprobs
    torch.testing.assert_close(lps[:, 1:], cpu_lps[:, 1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lps[[0, 4, 5]], cpu_lps[[0, 4, 5]], rtol=1e-4, atol=1e-4)
    assert torch.equal(out.logprob_token_ids.cpu()[:, 1:], cpu_out.logprob_token_ids[:, 1:])


def test_token_ids_outside_the_vocabulary_are_ignored_by_penalties():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    rows = [row(prompt=[1, 4, 10**6], output=[-1, 7, 2], temperature=0.0, repetition_penalty=2.0)]
    md = SamplingMetadata.build(rows, "cpu", 4)
    torch.testing.assert_close(apply_penalties(logits, md), torch.tensor([[1.0, 1.0, -2.0, 0.5]]))
