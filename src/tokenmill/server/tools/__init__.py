"""Tool calling for the chat API: checking tools / tool_choice, the schema of forced calls, and
parsers that find calls in model output (`--tool-call-parser`), whole or streamed."""

from tokenmill.server.tools.forced_output import ForcedToolCallStream, parse_forced_output
from tokenmill.server.tools.forced_schema import forced_tool_schema, required_calls_schema
from tokenmill.server.tools.parser_base import ToolCallStream, ToolParser
from tokenmill.server.tools.registry import TOOL_PARSERS, get_tool_parser
from tokenmill.server.tools.tool_choice import FunctionTool, ToolChoice, parse_tools, resolve_tool_choice
from tokenmill.server.tools.types import ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "ForcedToolCallStream",
    "FunctionTool",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolChoice",
    "ToolParser",
    "forced_tool_schema",
    "get_tool_parser",
    "parse_forced_output",
    "parse_tools",
    "required_calls_schema",
    "resolve_tool_choice",
]
