"""DeepSeek-R1 (and its distills): the chat template ends the prompt with `<think>\\n`, so the
output starts inside reasoning; older templates let the model write `<think>` itself."""

from __future__ import annotations

from tokenmill.server.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt_text: str | None) -> bool:
        return prompt_text is None or not self.reasoning_ended_in_prompt(prompt_text)
