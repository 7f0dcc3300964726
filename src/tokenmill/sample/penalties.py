"""Logit penalties, vectorised over the batch (no host syncs).

- repetition (Hugging Face semantics): every token seen in the prompt or the output so far has
  its logit divided by the penalty when positive, multiplied when negative;
- frequency / presence (OpenAI semantics), over OUTPUT tokens only: subtract
  `frequency * count + presence * (count > 0)`.

Repetition is applied first, as in vLLM. Rows without a penalty carry neutral values (1.0 / 0.0).
"""

from __future__ import annotations

import torch

from tokenmill.sample.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Returns penalised logits (a new tensor; the input is left as it is)."""
    assert md.output_tokens is not None
    assert md.presence_penalty is not None and md.frequency_penalty is not None
    assert md.repetition_penalty is not None
    num_rows, vocab_size = logits.shape
    output_counts = md.output_tokens.counts(num_rows, vocab_size, logits.dtype)
    seen_in_output = output_counts > 0

    seen = seen_in_output
    if md.prompt_tokens is not None:
        seen_in_prompt = md.prompt_tokens.counts(num_rows, vocab_size, logits.dtype) > 0
        seen = seen | seen_in_prompt
    penalty = torch.where(seen, md.repetition_penalty, 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)

    logits = logits - md.frequency_penalty * output_counts
    return logits - md.presence_penalty * seen_in_output.to(logits.dtype)


def ban_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Forces the banned (row, token) pairs (stop tokens under min_tokens, bad words) to -inf."""
    if md.banned_rows is None:
        return logits
    # torch.full, not torch.tensor(-inf, device=...): the latter is a synchronizing host copy.
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.clone().index_put_((md.banned_rows, md.banned_token_ids), neg_inf)
