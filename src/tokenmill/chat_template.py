"""Chat messages -> prompt token ids through the tokenizer's chat template.

transformers renders templates in jinja2's ImmutableSandboxedEnvironment, so a template (ours or a
user's --chat-template) cannot reach Python internals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from tokenmill.errors import InvalidRequestError

_ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(value: str | None) -> str | None:
    """A --chat-template value is either a template or the path of a file holding one."""
    if value is None:
        return None
    if len(value) < 4096 and "{" not in value:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r} is neither a Jinja template nor an existing file")
        return path.read_text()
    return value


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequestError(f"messages[{i}] must be an object with a 'role'", param="messages")
        role = message["role"]
        if role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}", param="messages"
            )
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise InvalidRequestError(
                        f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}}; images and audio are not supported",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or a list of text parts", param="messages"
            )
        normalized.append({**message, "content": content})
    return normalized


def template_text(tokenizer: Any, chat_template: str | None) -> str:
    """The template a render would use: the request's, else the tokenizer's (or "" if none)."""
    if chat_template is not None:
        return chat_template
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates: all of them count
        return "\n".join(template.values())
    return template


def render_chat_text(
    tokenizer: Any,
    messages: Any,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    normalized = _normalize_messages(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; pass --chat-template or use /v1/completions",
            param="messages",
        )
    if continue_final_message and add_generation_prompt:
        add_generation_prompt = False  # continuing the last message and opening a new one contradict
    try:
        return tokenizer.apply_chat_template(
            normalized,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            **(chat_template_kwargs or {}),
        )
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"the chat template could not render these messages: {exc}", param="messages"
        ) from exc


def render_chat(
    tokenizer: Any,
    messages: Any,
    *,
    add_special_tokens: bool = False,
    **kwargs: Any,
) -> list[int]:
    """Messages -> prompt token ids (render_chat_text's keywords; special tokens only when asked,
    since templates write them)."""
    text = render_chat_text(tokenizer, messages, **kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
