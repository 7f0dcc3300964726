"""The `ngram` proposer (prompt lookup): drafts copied from the request's own earlier tokens.

If the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred before, the
tokens that followed their latest earlier occurrence are the drafts. No model runs: it costs a
vectorised search over the request's tokens, so it pays on copy-heavy work (edits, rewrites,
extraction, code) and proposes nothing where text does not repeat.

It runs for every drafting request every step, so the search is kept cheap: one comparison of
the window with the last token finds the candidate positions (usually few), and only those are
extended backwards, one position at a time up to prompt_lookup_max.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, max_lookback: int = 4096) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # Only the latest tokens are searched: the cost per step stays bounded on long contexts.
        self.max_lookback = max_lookback

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k drafts following the last tokens of `token_ids` ([] when no n-gram matches)."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-self.max_lookback :], dtype=np.int64)
        num_tokens = len(tokens)
        # Occurrences of the last token before it: where every matching n-gram ends.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return []
        lengths = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_n, num_tokens - 1)):
            earlier = ends - back
            alive &= earlier >= 0
            alive[alive] = tokens[earlier[alive]] == tokens[num_tokens - 1 - back]
            if not alive.any():
                break
            lengths += alive
        longest = int(lengths.max())
        if longest < self.min_n:
            return []
        best = ends[lengths == longest]
        # The latest occurrence followed by k tokens (recent text predicts best); else the earliest,
        # followed by the most (in a repeating run the latest is followed by one).
        full = best[best + 1 + k <= num_tokens]
        follow = int(full[-1] if full.size else best[0]) + 1
        return tokens[follow : follow + k].tolist()
