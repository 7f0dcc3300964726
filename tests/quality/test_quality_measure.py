"""The quality gate's numbers on tiny checkpoints, against the same numbers computed here from
transformers' logits and greedy continuations on the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy, load_hf
from tests.model import quantized_checkpoints
from tests.quality.broken_checkpoints import write_noisy_copy
from tokenmill.args import EngineArgs
from tokenmill.quality.gate import plan_gate, run_gate
from tokenmill.quality.metrics import greedy_agreement
from tokenmill.quality.text_set import TextSetOptions, build_text_set
from tokenmill.quality.verdict import Thresholds

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint  # the session fixture

OPTIONS = TextSetOptions(window=40, max_windows=4, greedy_prompts=3, greedy_prompt_tokens=8, greedy_tokens=6)


def _log_probs(path, window: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        logits = load_hf(str(path))(torch.tensor([list(window)])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1)


def test_metrics_equal_transformers(tiny_llama_dir, tiny_tokenizer, tmp_path):
    noisy = write_noisy_copy(tiny_llama_dir, tmp_path / "noisy", relative_noise=0.3)
    candidate = EngineArgs(model=str(noisy), device="cpu", max_model_len=64, num_kv_blocks=16)
    report = run_gate(plan_gate(candidate, str(tiny_llama_dir)), OPTIONS, Thresholds())
    metrics = report.metrics

    text_set = build_text_set(tiny_tokenizer, OPTIONS)
    assert metrics.num_windows == 4 and metrics.num_scored_tokens == text_set.num_scored_tokens
    nll = {"base": 0.0, "candidate": 0.0}
    kl_sum, agree, kls = 0.0, 0, []
    for window in text_set.windows:
        targets = torch.tensor(window[1:])[:, None]
        base, cand = _log_probs(tiny_llama_dir, window), _log_probs(noisy, window)
        nll["base"] -= base.gather(1, targets).sum().item()
        nll["candidate"] -= cand.gather(1, targets).sum().item()
        kl = (base.exp() * (base - cand)).sum(-1)
        kls.append(kl)
        kl_sum += kl.sum().item()
        agree += int((base.argmax(-1) == cand.argmax(-1)).sum())
    n = text_set.num_scored_tokens
    assert metrics.base_perplexity == pytest.approx(math.exp(nll["base"] / n), rel=1e-4)
    assert metrics.candidate_perplexity == pytest.approx(math.exp(nll["candidate"] / n), rel=1e-4)
    assert metrics.mean_kl == pytest.approx(kl_sum / n, rel=1e-4, abs=1e-6)
    assert metrics.max_kl == pytest.approx(torch.cat(kls).max().item(), rel=1e-4)
    assert metrics.top1_agreement == agree / n
    base_greedy = [hf_greedy(str(tiny_llama_dir), list(p), 6)[0] for p in text_set.greedy_prompts]
    cand_greedy = [hf_greedy(str(noisy), list(p), 6)[0] for p in text_set.greedy_prompts]
    agreement, lengths = greedy_agreement(base_greedy, cand_greedy)
    assert list(metrics.greedy_prefix_lengths) == lengths and metrics.greedy_agreement == agreement
    # The noise is large enough that the comparison means something: the models differ.
    assert metrics.mean_kl > 0.01 and metrics.top1_agreement < 1.0
    assert report.candidate == f"{noisy} (device=cpu)" and report.base == f"{tiny_llama_dir} (device=cpu)"


def test_candidate_with_another_tokenizer_is_refused(tiny_llama_dir, tmp_path, default_model_path):
    candidate = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=64, num_kv_blocks=16)
    plan = plan_gate(candidate, str(default_model_path))
    with pytest.raises(ValueError, match="tokenizes the text set differently"):
        run_gate(plan, TextSetOptions(window=16, max_windows=1, greedy_prompts=0), Thresholds())


@pytest.mark.parametrize("layout", ["ct-fp8-channel", "gptq-g32-sym-actorder"])
def test_a_quantized_checkpoint_against_its_dequantized_weights(quantized_checkpoint, layout):
    """A checkpoint in a published layout needs --base; against its own dequantized weights it
    loses nothing but float rounding (the CPU multiplies with exactly those weights)."""
    checkpoint = quantized_checkpoint(layout)
    candidate = EngineArgs(model=str(checkpoint.path), device="cpu", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"is a quantized checkpoint \(.*\).*pass --base"):
        plan_gate(candidate)
    report = run_gate(plan_gate(candidate, str(checkpoint.reference)), OPTIONS, Thresholds())
    assert report.passed and report.metrics.mean_kl < 1e-6 and report.metrics.top1_agreement == 1.0


def test_a_model_with_non_finite_logits_fails_instead_of_erroring(tiny_llama_dir, tmp_path):
    nan_copy = write_noisy_copy(tiny_llama_dir, tmp_path / "nan", relative_noise=math.nan)
    candidate = EngineArgs(model=str(nan_copy), device="cpu", max_model_len=64, num_kv_blocks=16)
    report = run_gate(plan_gate(candidate, str(tiny_llama_dir)), OPTIONS, Thresholds())
    assert not report.passed
    assert {c.metric for c in report.verdict.failures} == {
        "perplexity_ratio", "mean_kl", "top1_agreement", "greedy_agreement"
    }  # fmt: skip
    assert report.metrics.greedy_prefix_lengths == (0, 0, 0)  # its requests ended with an error
