"""The sampler: one token per row from a batch of logits, vectorised and free of host syncs.

Order (vLLM's): allowed_token_ids -> banned tokens (bad words, stop tokens under min_tokens) ->
logit_bias -> penalties -> greedy rows take the argmax -> temperature
-> min_p -> top_k -> top_p (masked to -inf) -> sample with the exponential-race trick
(`argmax(probs / q)`, q ~ Exponential(1), as gpt-fast does), which needs no torch.multinomial and
so no sync. Rows with their own generator draw their own noise, so a seeded request samples the
same tokens whatever else shares its batch.

Logprobs are those of the raw model distribution (log_softmax of the logits before penalties and
temperature), like vLLM's default. Bringing results to the host (one `.tolist()`) is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.outputs import TokenLogprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.penalties import apply_penalties, ban_tokens


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); on the CPU, where this process has loaded the C++ kernels, their
    `argmax_rows` (the same indices, NaN rows included; torch's took 1.3-2.9 ms of a 64-row decode
    step over SmolLM2's 49152 logits)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
    ):
        from tokenmill.kernels.cpu import build

        if build.kernels_loaded():
            return torch.ops.tokenmill_cpu.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # Only when some row asked for logprobs (k = md.max_num_logprobs):
    logprob_token_ids: torch.Tensor | None = None  # [N, k+1] int64: sampled token, then top-k
    logprobs: torch.Tensor | None = None  # [N, k+1] float32
    sampled_ranks: torch.Tensor | None = None  # [N] int64, rank of the sampled token (1 = best)

    def to_token_logprobs(self, md: SamplingMetadata) -> list[TokenLogprobs | None] | None:
        """Per-row logprobs on the host, trimmed to what each row asked (a sync: call once)."""
        if self.logprobs is None:
            return None
        assert self.logprob_token_ids is not None and self.sampled_ranks is not None
        token_ids = self.logprob_token_ids.tolist()
        logprobs = self.logprobs.tolist()
        ranks = self.sampled_ranks.tolist()
        result: list[TokenLogprobs | None] = []
        for i, k in enumerate(md.num_logprobs):
            if k is None:
                result.append(None)
            else:
                result.append(TokenLogprobs(token_ids[i][: k + 1], logprobs[i][: k + 1], ranks[i]))
        return result


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = self.processed_logits(logits, md)
        if md.all_greedy:
            sampled = greedy_argmax(logits)
        else:
            sampled = self._sample_random(logits, md)
            if md.greedy_mask is not None:
                sampled = torch.where(md.greedy_mask, logits.argmax(dim=-1), sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled)
        assert md.max_num_logprobs is not None
        sampled_logprob, ranks, top_ids, top_logprobs = gather_logprobs(
            raw_logprobs, sampled, md.max_num_logprobs
        )
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
            logprobs=torch.cat([sampled_logprob.unsqueeze(1), top_logprobs], dim=1),
            sampled_ranks=ranks,
        )

    @staticmethod
    def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The float32 logits after the logits processors, bans and penalties: greedy rows take
        their argmax. Each step returns a new tensor: the caller still reads its own logits."""
        if md.allowed_tokens is not None:
            logits = md.allowed_tokens.apply(logits)
        logits = ban_tokens(logits, md)
        if md.logit_bias is not None:
            logits = md.logit_bias.apply(logits)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)
        return logits

    @staticmethod
    def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows draw from: processed logits / temperature, then min_p,
        top_k and top_p, softmax (greedy rows get a temperature of 1.0 here; their row is unused)."""
        assert md.temperature is not None
        logits = logits / md.temperature.unsqueeze(1)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        if md.top_p is not None:
            max_top_k = md.max_top_k if md.top_k_on_all_random_rows else None
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p, max_top_k)
        elif md.top_k is not None:
            logits = apply_top_k(logits, md.top_k, md.max_top_k)
        return torch.softmax(logits, dim=-1)

    @classmethod
    def _sample_random(cls, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        return exponential_race(cls.random_probs(logits, md), md.generators)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exponential(1) is a draw from `probs` and needs no sync.

    q is drawn as -log(u), u ~ U[0, 1): the same law as `exponential_`, at a third of its cost on CPU.
    Rows with their own generator draw their own u, so their samples do not depend on the batch.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.uniform_()
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    # clamp: a q of 0 (u = 1 on some devices) would make 0/0 = NaN on a masked token, which argmax picks.
    noise = noise.log_().neg_().clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keeps each row's k largest logits (ties with the k-th kept); top_k >= vocab means off."""
    vocab_size = logits.shape[-1]
    max_top_k = min(max_top_k, vocab_size)
    top_values = logits.topk(max_top_k, dim=-1).values
    kth_index = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)
    threshold = top_values.gather(1, kth_index)
    threshold = threshold.masked_fill((top_k >= vocab_size).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, max_top_k: int | None
) -> torch.Tensor:
    """top_k, then top_p: keep the smallest set of most likely tokens whose mass reaches p (at
    least the top token; ties with the last kept token are kept too).

    Works on the logits sorted in descending order; when every sampled row has a top_k
    (`max_top_k` given) only the `max_top_k` largest are needed, which on CPU is far cheaper
    than a full sort. The cut is turned back into a per-row logit threshold, so no scatter.
    """
    vocab_size = logits.shape[-1]
    if max_top_k is not None:
        candidates = logits.topk(min(max_top_k, vocab_size), dim=-1).values
    else:
        candidates = logits.sort(dim=-1, descending=True).values
    if top_k is not None:
        positions = torch.arange(candidates.shape[-1], device=logits.device)
        candidates = candidates.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(candidates, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely candidates
    top_p = top_p.unsqueeze(1)
    # p = 1 keeps everything, whatever rounding does to the cumulative sum.
    num_kept = ((mass_before < top_p) | (top_p >= 1.0)).sum(dim=-1, keepdim=True)
    if top_k is not None:
        num_kept = torch.minimum(num_kept, top_k.unsqueeze(1))
    num_kept = num_kept.clamp(min=1)
    threshold = candidates.gather(1, num_kept - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_alternatives: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    token_logprob = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    rank = (logprobs > token_logprob.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_alternatives, dim=-1)
    return token_logprob, rank, top_ids, top_logprobs


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_alternatives: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of given tokens (prompt logprobs): logits [M, V], token_ids [M] ->
    (token logprob [M], rank [M] (1 = best), top ids [M, k], top logprobs [M, k])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, token_ids.to(torch.int64), num_alternatives)
