"""A chat request's prompt: messages, tools and documents through the chat template, then the
request's tokenization options (add_special_tokens, truncate_prompt_tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.chat_template import render_chat_text, template_text
from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol import ChatTemplateFields
from tokenmill.server.request_fields import truncate_prompt
from tokenmill.server.state import ServerState


@dataclass(slots=True)
class ChatPrompt:
    text: str  # the rendered template (the reasoning parser reads whether it already ended thinking)
    token_ids: list[int]


def request_chat_template(state: ServerState, request: ChatTemplateFields) -> str | None:
    if request.chat_template is None:
        return None
    if not state.trust_request_chat_template:
        raise InvalidRequestError(
            "this server does not accept chat templates in requests; the operator can allow them with "
            "--trust-request-chat-template",
            param="chat_template",
        )
    return request.chat_template


def _template_kwargs(request: ChatTemplateFields, template: str) -> dict[str, Any]:
    """chat_template_kwargs plus the fields a template reads by name; such a field is refused when
    the template in use never reads it, since it would change nothing."""
    kwargs = dict(request.chat_template_kwargs or {})
    for name in ("documents", "reasoning_effort"):
        value = getattr(request, name)
        if value is None:
            continue
        if name not in template:
            raise InvalidRequestError(
                f"{name} is not supported by this model's chat template (it never reads {name!r}); "
                "leave it out",
                param=name,
            )
        if name == "reasoning_effort":
            kwargs[name] = value
    return kwargs


def render_chat_prompt(state: ServerState, request: ChatTemplateFields, tokenize: bool = True) -> ChatPrompt:
    tokenizer = state.tokenizer("messages")
    chat_template = request_chat_template(state, request)
    kwargs = _template_kwargs(request, template_text(tokenizer, chat_template))
    text = render_chat_text(
        tokenizer,
        request.messages_for_template(),
        chat_template=chat_template,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=kwargs,
        tools=request.tools_for_template(),
        documents=request.documents,
    )
    token_ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    truncate = getattr(request, "truncate_prompt_tokens", None)
    if truncate is not None:
        token_ids = truncate_prompt(token_ids, truncate, state.max_model_len)
    return ChatPrompt(text=text, token_ids=token_ids)
