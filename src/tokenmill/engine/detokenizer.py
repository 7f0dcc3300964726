"""Incremental detokenization: text for newly sampled tokens, never broken UTF-8.

Decoding token by token and concatenating is wrong in two ways: a multi-byte character split
across byte-level tokens decodes to U+FFFD until its last byte arrives, and decoders such as
Metaspace make a token's text depend on what precedes it (a leading space is dropped at the
start of a string). So each call decodes a short window instead: the tokens of the previous
emission (`prefix_offset:read_offset`), then the same window plus the new tokens, and emits the
difference. A decode that ends in U+FFFD is an unfinished character: nothing is emitted and the
offsets stay, so the next call retries with more bytes. Each call costs O(window), not O(all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token (enough for any decoder's
# look-behind: a leading-space rule, or a character of up to 4 bytes).
INITIAL_CONTEXT_TOKENS = 5


def _decoder(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """A `decode(ids) -> str` without clean-up of tokenization spaces (it would look across the
    window's edges); the Rust tokenizer directly when there is one (much less overhead)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        # The last few prompt tokens, then every output token.
        self.token_ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.num_context_tokens = len(self.token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_context_tokens :]

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the text that became final (possibly "")."""
        self.token_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the request: releases text held back for an unfinished character
        (it stays as U+FFFD, as a decode of all the tokens shows it)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(window_text) <= len(prefix_text):
            return ""  # nothing visible yet (e.g. skipped special tokens): keep the window
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        new_text = window_text[len(prefix_text) :]
        # The window's start moves up to the old read offset: its text is a complete character
        # run (it did not end in U+FFFD), so later windows decode exactly as the whole text does.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += new_text
        return new_text


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own (logprob alternatives' `decoded_token`); a byte-level
    token holding part of a character decodes to U+FFFD."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode([token_id], skip_special_tokens=False)
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
