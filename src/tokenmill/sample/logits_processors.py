"""The request-level logits processors (vLLM's names): logit_bias, allowed_token_ids, bad words.

`SamplingMetadata.build` turns each row's parameters into flat (row, token) index tensors once per
step; the functions here apply them to the whole batch with a few indexed writes, without host
syncs. They return new tensors: the caller's logits are also read by the model runner (its
non-finite check) and must not gain -inf entries.

Bad words are decided on the host while building (the output tokens are there already) and end as
(row, token) bans next to the min_tokens ban (`penalties.ban_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogitBias:
    """Add `values[i]` to the logit of (`row_indices[i]`, `token_ids[i]`)."""

    row_indices: torch.Tensor  # [B] int64
    token_ids: torch.Tensor  # [B] int64
    values: torch.Tensor  # [B] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put((self.row_indices, self.token_ids), self.values.to(logits.dtype), accumulate=True)


@dataclass(slots=True)
class AllowedTokens:
    """Rows in `restricted` (an [N] bool mask) may sample only their (row, token) pairs."""

    restricted: torch.Tensor  # [N] bool: the row has allowed_token_ids
    row_indices: torch.Tensor  # [A] int64
    token_ids: torch.Tensor  # [A] int64

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        num_rows, vocab_size = logits.shape
        # Start from "every token of a restricted row is banned", then lift the allowed ones.
        banned = self.restricted.unsqueeze(1).expand(num_rows, vocab_size).clone()
        banned.index_put_((self.row_indices, self.token_ids), torch.zeros((), dtype=torch.bool, device=banned.device))
        return logits.masked_fill(banned, float("-inf"))


def bad_word_bans(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> set[int]:
    """Tokens a row must not sample next: the last token of each bad word whose other tokens end
    the output so far (a one-token word is always banned). vLLM's rule; it looks at the output
    only, not the prompt."""
    banned: set[int] = set()
    num_output = len(output_token_ids)
    for word in bad_words:
        prefix_len = len(word) - 1
        if prefix_len > num_output:
            continue
        if prefix_len == 0 or _ends_with(output_token_ids, word, prefix_len):
            banned.add(word[-1])
    return banned


def _ends_with(output_token_ids: Sequence[int], word: Sequence[int], prefix_len: int) -> bool:
    start = len(output_token_ids) - prefix_len
    return all(output_token_ids[start + j] == word[j] for j in range(prefix_len))
