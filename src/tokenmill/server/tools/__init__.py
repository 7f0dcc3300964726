"""Tool calling for the chat API: checking tools / tool_choice, the schema of forced calls, and
parsers that find calls in model output (`--tool-call-parser`), whole or streamed.

How a chat request uses it:
- `choice = resolve_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls)` (400s on
  bad input);
- `choice.forced`: constrain the output with `forced_tool_schema(choice)` and read it with
  `parse_forced_output(kind, text, function_name=...)` or, streaming, `ForcedToolCallStream`
  (kind = "named" or "required", as `choice.mode`);
- `choice.mode == "auto"` and a `--tool-call-parser`: `parser.extract(text)` or
  `parser.stream()`, `feed()` per delta, `finish()` at the end; keep special tokens in the
  detokenized text when `parser.needs_special_tokens`.
"""

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
