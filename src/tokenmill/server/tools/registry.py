"""`--tool-call-parser NAME` -> parser class."""

from __future__ import annotations

from tokenmill.server.tools.hermes import HermesToolParser
from tokenmill.server.tools.llama3_json import Llama3JsonToolParser
from tokenmill.server.tools.mistral import MistralToolParser
from tokenmill.server.tools.parser_base import ToolParser
from tokenmill.server.tools.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """A parser instance for NAME (shared by all requests: its state lives in `stream()`)."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None
