"""Tool-call ids: the form clients see from OpenAI ("call_" + 24 characters), or Mistral's."""

from __future__ import annotations

import secrets
import string

_ALPHANUMERIC = string.ascii_letters + string.digits


def random_alphanumeric(length: int) -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length))


def openai_tool_call_id() -> str:
    return "call_" + random_alphanumeric(24)


def mistral_tool_call_id() -> str:
    """Mistral's chat templates reject any id that is not exactly 9 letters or digits, and the
    ids come back to the template in the next request's tool messages."""
    return random_alphanumeric(9)
