"""Qwen3 (and QwQ): the model writes `<think>` ... `</think>` itself; newer templates (the
2507 thinking models) end the prompt with `<think>\\n`, so only `</think>` appears. Output
with no think tags at all is content."""

from __future__ import annotations

from tokenmill.server.reasoning.base import END, ReasoningDelta, ReasoningParser, split_reasoning


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_in_reasoning(self, prompt_text: str | None) -> bool:
        return prompt_text is not None and prompt_text.rstrip().endswith(self.start_marker)

    def extract(self, text: str, *, in_reasoning: bool | None = None) -> ReasoningDelta:
        if in_reasoning is None:
            # Prompt unknown: a `</think>` in the output says reasoning came before it.
            in_reasoning = END in text
        return split_reasoning(text, in_reasoning)
