"""Splitting a thinking model's output into `reasoning_content` and `content`, whole or streamed.

Both supported families mark reasoning with `<think>` ... `</think>`. Where the output starts
depends on the prompt: a chat template may already have opened `<think>` (the output starts
inside reasoning and only `</think>` appears), or opened and closed it (thinking disabled:
all output is content, and output constraints apply from the first token).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from tokenmill.server.tools.text_scan import text_before_marker

START = "<think>"
END = "</think>"


class ReasoningDelta(NamedTuple):
    reasoning: str | None
    content: str | None


def split_reasoning(text: str, in_reasoning: bool) -> ReasoningDelta:
    """The whole-output rule. A `<think>` that opens the output (after blanks) starts reasoning
    whatever `in_reasoning` says; reasoning runs to `</think>`, or to the end if it never
    closes (generation stopped while thinking)."""
    lead = len(text) - len(text.lstrip())
    if text.startswith(START, lead):
        text, in_reasoning = text[lead + len(START) :], True
    if not in_reasoning:
        return ReasoningDelta(None, text or None)
    reasoning, found, content = text.partition(END)
    return ReasoningDelta(reasoning or None, (content or None) if found else None)


class ReasoningStream:
    """One output's streaming state: `feed()` each detokenized delta, then `finish()`.

    Markers split across deltas are held back until decided, so the concatenated deltas equal
    `split_reasoning` of the whole text.
    """

    def __init__(self, in_reasoning: bool) -> None:
        self._in_reasoning = in_reasoning
        self._text = ""
        self._pos = 0
        self._state = "lead"  # -> "reasoning" -> "content"; or "lead" -> "content"
        self._finished = False

    @property
    def reasoning_ended(self) -> bool:
        """True once output is content: the server starts tool parsing / constraints there."""
        return self._state == "content"

    def feed(self, delta_text: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta(None, None)
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        text = self._text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == "lead":
                rest = text.lstrip()
                if rest.startswith(START):
                    self._pos, self._state = len(text) - len(rest) + len(START), "reasoning"
                elif not final and START.startswith(rest):  # blanks, or a growing <think>
                    break
                else:
                    self._state = "reasoning" if self._in_reasoning else "content"
            elif self._state == "reasoning":
                piece, end, found = text_before_marker(text, self._pos, END, final)
                reasoning.append(piece)
                if not found:
                    self._pos = end
                    break
                self._pos, self._state = end + len(END), "content"
            else:
                content.append(text[self._pos :])
                self._pos = len(text)
                break
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)


class ReasoningParser:
    """A `--reasoning-parser`: stateless, shared by all requests."""

    name: ClassVar[str]
    start_marker: ClassVar[str] = START
    # The server tokenizes this to gate output constraints (StructuredOutputsParams.start_after_token_ids).
    end_marker: ClassVar[str] = END

    def reasoning_ended_in_prompt(self, prompt_text: str) -> bool:
        """The prompt closed reasoning itself (thinking disabled: `<think>\\n\\n</think>\\n\\n`), so
        the output is content from its first token."""
        return prompt_text.rstrip().endswith(self.end_marker)

    def starts_in_reasoning(self, prompt_text: str | None) -> bool:
        """Whether the output begins inside reasoning, given the rendered prompt."""
        raise NotImplementedError

    def extract(self, text: str, *, in_reasoning: bool | None = None) -> ReasoningDelta:
        """(reasoning_content, content) of a whole output; `in_reasoning` as from starts_in_reasoning()."""
        return split_reasoning(text, self._default(in_reasoning))

    def stream(self, *, in_reasoning: bool | None = None) -> ReasoningStream:
        return ReasoningStream(self._default(in_reasoning))

    def _default(self, in_reasoning: bool | None) -> bool:
        return self.starts_in_reasoning(None) if in_reasoning is None else in_reasoning
