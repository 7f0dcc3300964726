"""The measurements: the base model scores the text set first and leaves its next-token
log-probabilities behind (on the CPU, float32, every position, the full vocabulary); the candidate
then scores the same windows against them. So the two models are never in memory together.

Logits come from the engine's own model path (`worker/prompt_logits.py`: the loaded runner's
model, attention backend and linear methods, one prefill per window); greedy continuations from
`LLM.generate`, the path requests take.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenmill.quality.metrics import GateMetrics, greedy_agreement
from tokenmill.quality.text_set import TextSet
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.prompt_logits import prompt_logits

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Reference:
    """What the base model leaves for the candidate's comparison."""

    log_probs: list[torch.Tensor]  # per window: [n - 1, vocab] float32 on the CPU
    top1: list[torch.Tensor]  # per window: [n - 1] int64, the argmax of log_probs
    nll_sum: float  # of every scored position's target token
    greedy: list[list[int]]  # per greedy prompt, the base's continuation
    vocab_size: int

    def perplexity(self, num_scored: int) -> float:
        return perplexity(self.nll_sum, num_scored)


def perplexity(nll_sum: float, num_scored: int) -> float:
    """exp(mean NLL); inf where a broken model's mean NLL is past what a float holds (NaN stays NaN)."""
    mean = nll_sum / num_scored
    return math.exp(mean) if not mean > 700.0 else math.inf


def check_fits(llm, text_set: TextSet, role: str) -> None:
    """A clear error before any scoring when a window or a continuation is past max_model_len."""
    max_model_len = llm.engine.runner.max_model_len
    if text_set.longest_sequence > max_model_len:
        raise ValueError(
            f"the {role} model's max_model_len is {max_model_len}, but the quality gate needs "
            f"{text_set.longest_sequence} positions (a window, or a greedy prompt and its continuation); "
            "raise --max-model-len or lower --window / --greedy-prompt-tokens / --greedy-tokens"
        )


def _windows(text_set: TextSet, role: str):
    return tqdm(text_set.windows, desc=f"{role}: scoring windows", unit="window", leave=False)


def _targets(window: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(window[1:], dtype=torch.long, device=device)


def score_base(llm, text_set: TextSet) -> Reference:
    check_fits(llm, text_set, "base")
    runner = llm.engine.runner
    log_probs, top1 = [], []
    nll_sum = 0.0
    vocab_size = 0
    for window in _windows(text_set, "base"):
        lp = torch.log_softmax(prompt_logits(runner, window)[:-1], dim=-1)
        vocab_size = lp.shape[-1]
        nll_sum -= lp.gather(1, _targets(window, lp.device)[:, None]).double().sum().item()
        log_probs.append(lp.cpu())
        top1.append(lp.argmax(dim=-1).cpu())
    logger.info(
        "base: %d windows scored; keeping %.1f MiB of its log-probabilities for the candidate",
        len(text_set.windows), text_set.num_scored_tokens * vocab_size * 4 / 2**20,
    )  # fmt: skip
    return Reference(log_probs, top1, nll_sum, greedy_continuations(llm, text_set, "base"), vocab_size)


def score_candidate(llm, text_set: TextSet, reference: Reference) -> GateMetrics:
    check_fits(llm, text_set, "candidate")
    runner = llm.engine.runner
    nll_sum = kl_sum = 0.0
    window_max_kl = []  # torch.max keeps a NaN, so a NaN anywhere shows in max_kl
    agree = 0
    for i, window in enumerate(_windows(text_set, "candidate")):
        lp = torch.log_softmax(prompt_logits(runner, window)[:-1], dim=-1)
        if lp.shape[-1] != reference.vocab_size:
            raise ValueError(
                f"the candidate's logits have {lp.shape[-1]} entries and the base's {reference.vocab_size}: "
                "the two models must share a vocabulary to be compared"
            )
        nll_sum -= lp.gather(1, _targets(window, lp.device)[:, None]).double().sum().item()
        base_lp = reference.log_probs[i].to(lp.device)
        base_p = base_lp.exp()
        # KL(base || candidate) = sum_v p_b (log p_b - log p_c); tokens the base gives probability 0
        # add nothing (where log p_b = -inf the product is NaN and is masked out).
        kl = torch.where(base_p > 0, base_p * (base_lp - lp), 0.0).sum(dim=-1)
        kl_sum += kl.double().sum().item()
        window_max_kl.append(kl.max().cpu())
        # A row with a NaN has no most likely token (argmax would point at the NaN): it never agrees.
        same_top1 = (lp.argmax(dim=-1) == reference.top1[i].to(lp.device)) & ~lp.isnan().any(dim=-1)
        agree += int(same_top1.sum().item())
    num_scored = text_set.num_scored_tokens
    candidate_greedy = greedy_continuations(llm, text_set, "candidate")
    agreement, prefix_lengths = greedy_agreement(reference.greedy, candidate_greedy)
    return GateMetrics(
        base_perplexity=reference.perplexity(num_scored),
        candidate_perplexity=perplexity(nll_sum, num_scored),
        mean_kl=kl_sum / num_scored,
        max_kl=torch.stack(window_max_kl).max().item(),
        top1_agreement=agree / num_scored,
        greedy_agreement=agreement,
        greedy_prefix_lengths=tuple(prefix_lengths),
        num_windows=len(text_set.windows),
        num_scored_tokens=num_scored,
        greedy_tokens=text_set.greedy_tokens,
    )


def greedy_continuations(llm, text_set: TextSet, role: str) -> list[list[int]]:
    """Each greedy prompt continued by `llm` for `greedy_tokens` tokens (EOS ignored, so every
    continuation has the same length), through LLM.generate.

    A request the engine ends with an error (non-finite logits) is a measurement for the
    candidate, an empty continuation that agrees with nothing, and a reason to stop for the base,
    which every number is measured against."""
    if not text_set.greedy_prompts:
        return []
    params = SamplingParams(temperature=0.0, max_tokens=text_set.greedy_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(p)} for p in text_set.greedy_prompts]
    logger.info("%s: %d greedy continuations of %d tokens", role, len(prompts), text_set.greedy_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=True)
    continuations = []
    for out in outputs:
        if out.error and role == "base":
            raise RuntimeError(f"the base model's greedy continuation failed: {out.error}")
        if out.error:
            logger.warning("%s: a greedy continuation ended with an error: %s", role, out.error)
            continuations.append([])
            continue
        continuations.append(list(out.outputs[0].token_ids))
    return continuations
