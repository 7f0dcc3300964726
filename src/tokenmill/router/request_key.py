"""What the router reads from an OpenAI request body to route it: the prompt's prefix key and the
session. Only reads: the body goes to the replica byte for byte."""

from __future__ import annotations

from typing import Any

from tokenmill.router.prefix_index import chained_hashes, text_chunk_hashes

# Prompts given as token ids are cut into chunks of this many ids (a typical KV block).
TOKEN_CHUNK = 16


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts (images and audio
    do not enter the key: it is approximate anyway)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text_of_chat(payload: dict[str, Any]) -> str:
    """The messages flattened in order (role and text), the same shape for every replica and
    chat template: what two conversations share, their keys share."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return ""
    return "".join(
        f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e" for m in messages if isinstance(m, dict)
    )


def prefix_hashes(path: str, payload: dict[str, Any], chunk_chars: int) -> list[int]:
    """The chained chunk hashes of the request's prompt (empty when it has none to key on). A batch
    of prompts (a list) is keyed on its first."""
    if path.endswith("/chat/completions"):
        return text_chunk_hashes(prompt_text_of_chat(payload), chunk_chars)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_chunk_hashes(prompt, chunk_chars)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return chained_hashes(tuple(prompt[i : i + TOKEN_CHUNK]) for i in range(0, len(prompt), TOKEN_CHUNK))
    return []


def session_of(header_value: str | None, payload: dict[str, Any]) -> str | None:
    """The session a request belongs to: the session header, else the body's `user`."""
    if header_value:
        return header_value
    user = payload.get("user")
    return user if isinstance(user, str) and user else None
