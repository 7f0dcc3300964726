"""`--reasoning-parser NAME` -> parser class."""

from __future__ import annotations

from tokenmill.server.reasoning.base import ReasoningParser
from tokenmill.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from tokenmill.server.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}"
        ) from None
