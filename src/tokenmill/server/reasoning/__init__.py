"""Reasoning parsers: split `<think>` reasoning from the answer (`--reasoning-parser`)."""

from tokenmill.server.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream, split_reasoning
from tokenmill.server.reasoning.registry import REASONING_PARSERS, get_reasoning_parser

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
    "split_reasoning",
]
