"""The quality gate's text set: a few KB of English prose, Python code and lists shipped with the
package (quality/texts/*.txt, written for tokenmill), tokenized with the model's tokenizer and
cut into windows; and the prompts of the greedy continuations, taken from the same texts.

Torch-free: the text set is built from a tokenizer alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

# The texts, one kind each, so that windows of every kind take turns (see `build_text_set`).
TEXT_FILES = ("prose.txt", "code.txt", "lists.txt")
# A last window shorter than this many text tokens is dropped: it would score almost nothing.
MIN_WINDOW_TEXT_TOKENS = 8


@dataclass(frozen=True, slots=True)
class TextSetOptions:
    """How the texts become windows and greedy prompts (each a flag of `tokenmill quality-gate`)."""

    window: int = 128  # tokens per window, the tokenizer's leading special tokens included
    max_windows: int | None = None  # None: every window of the set
    greedy_prompts: int = 16  # prompts continued greedily by both models (0: no greedy metric)
    greedy_prompt_tokens: int = 32  # tokens of each greedy prompt
    greedy_tokens: int = 16  # tokens generated from each prompt

    def check(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be at least 2 tokens, got {self.window}")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"max_windows must be at least 1 (or None: all), got {self.max_windows}")
        if self.greedy_prompts < 0:
            raise ValueError(
                f"greedy_prompts must be 0 (no greedy metric) or more, got {self.greedy_prompts}"
            )
        if self.greedy_prompt_tokens < 1 or self.greedy_tokens < 1:
            raise ValueError(
                "greedy_prompt_tokens and greedy_tokens must be at least 1, got "
                f"{self.greedy_prompt_tokens} and {self.greedy_tokens}"
            )


@dataclass(frozen=True, slots=True)
class TextSet:
    """Token windows scored by both models, and the prompts both continue greedily."""

    windows: tuple[tuple[int, ...], ...]
    greedy_prompts: tuple[tuple[int, ...], ...]
    greedy_tokens: int

    @property
    def num_scored_tokens(self) -> int:
        """Positions scored: in a window of n tokens, positions 0..n-2 predict tokens 1..n-1."""
        return sum(len(w) - 1 for w in self.windows)

    @property
    def longest_sequence(self) -> int:
        """The most positions one sequence of the gate takes (a window, or a prompt and its
        continuation): what max_model_len must hold."""
        lengths = [len(w) for w in self.windows]
        lengths += [len(p) + self.greedy_tokens for p in self.greedy_prompts]
        return max(lengths)


def read_texts() -> list[str]:
    """The shipped texts, in TEXT_FILES order."""
    folder = resources.files("tokenmill.quality") / "texts"
    return [(folder / name).read_text(encoding="utf-8") for name in TEXT_FILES]


def special_prefix(tokenizer: Any) -> list[int]:
    """The tokens the tokenizer puts before a text of its own accord (a BOS for Llama-style
    tokenizers, nothing for SmolLM2's); every window starts with them, as every prompt would."""
    text = "Hello"
    with_specials = tokenizer.encode(text)
    plain = tokenizer.encode(text, add_special_tokens=False)
    for start in range(len(with_specials) - len(plain) + 1):
        if with_specials[start : start + len(plain)] == plain:
            return list(with_specials[:start])
    return []


def build_text_set(tokenizer: Any, options: TextSetOptions) -> TextSet:
    """Each text cut into consecutive windows of `options.window` tokens (the special prefix plus
    text tokens); the windows of the texts interleaved (prose, code, list, prose, ...) so that the
    first few are varied, then cut to `max_windows`. Greedy prompts are the openings of windows
    spread over the whole set."""
    options.check()
    prefix = special_prefix(tokenizer)
    per_window = options.window - len(prefix)
    if per_window < 1:
        raise ValueError(
            f"window={options.window} leaves no room for text after the tokenizer's {len(prefix)} "
            "leading special token(s); use a larger window"
        )
    by_text: list[list[tuple[int, ...]]] = []
    for text in read_texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        chunks = [ids[i : i + per_window] for i in range(0, len(ids), per_window)]
        shortest = min(MIN_WINDOW_TEXT_TOKENS, per_window)
        by_text.append([tuple(prefix + c) for c in chunks if len(c) >= shortest])
    windows = [w for row in _interleave(by_text) for w in row]
    if not windows:
        raise ValueError("the text set gave no windows: the tokenizer encoded the texts to nothing")
    prompts: list[tuple[int, ...]] = []
    if options.greedy_prompts:
        count = min(options.greedy_prompts, len(windows))
        starts = [windows[i * len(windows) // count] for i in range(count)]
        prompts = [w[: len(prefix) + options.greedy_prompt_tokens] for w in starts]
    if options.max_windows is not None:
        windows = windows[: options.max_windows]
    return TextSet(tuple(windows), tuple(prompts), options.greedy_tokens)


def _interleave(rows: list[list[tuple[int, ...]]]) -> list[list[tuple[int, ...]]]:
    """[[a1, a2], [b1], [c1, c2]] -> [[a1, b1, c1], [a2, c2]]."""
    depth = max((len(r) for r in rows), default=0)
    return [[r[i] for r in rows if i < len(r)] for i in range(depth)]
