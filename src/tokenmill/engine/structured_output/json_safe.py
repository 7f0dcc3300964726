"""Tokens a JSON constraint may never produce: those spelling a raw control character.

JSON forbids unescaped control characters (U+0000-U+001F) inside strings, and outside them only
allows space, tab, newline and carriage return as whitespace. xgrammar 0.2.8's string rule for
schemas with minLength / maxLength is `[^"\\\r\n]`, which lets a tab or \x01 into a string, so a
sampled model can produce text `json.loads` rejects. JSON constraints therefore also mask every
token holding such a character (tab included: it could be whitespace, but it is never needed).
"""

from __future__ import annotations

import numpy as np

# Control bytes JSON text never needs: all but newline and carriage return, which xgrammar's string
# rules already exclude and which its whitespace uses.
_FORBIDDEN = frozenset(range(0x20)) - {0x0A, 0x0D}


def json_safe_words(decoded_vocab: list[bytes], vocab_size: int) -> np.ndarray:
    """A bitmask row (int32 words, xgrammar's layout: bit i of word i // 32 = token i allowed) with
    every token allowed except those whose bytes hold a forbidden control character."""
    num_words = -(-vocab_size // 32)
    allowed = np.ones(num_words * 32, dtype=bool)
    for token_id, text in enumerate(decoded_vocab[:vocab_size]):
        if not _FORBIDDEN.isdisjoint(text):
            allowed[token_id] = False
    bits = allowed.reshape(num_words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(axis=1).astype(np.uint32).view(np.int32)
