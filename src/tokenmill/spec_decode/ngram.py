"""The `ngram` proposer (prompt lookup): drafts copied from the request's own earlier tokens.

If the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred before, the
tokens that followed their latest earlier occurrence are the drafts. No model runs: it costs a
vectorised search over the request's tokens, so it pays on copy-heavy work (edits, rewrites,
extraction, code) and proposes nothing where text does not repeat.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        start = max(0, num_tokens - self.max_lookback)
        tokens = np.asarray(token_ids[start:], dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Windows that start before the suffix itself and are followed by at least one token.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The latest occurrence followed by k tokens (recent text predicts best); else the
                # earliest, followed by the most (in a repeating run the latest is followed by one).
                full = hits[hits + n + k <= len(tokens)]
                follow = int(full[-1] if full.size else hits[0]) + n
                return tokens[follow : follow + k].tolist()
        return []
