"""OpenAI-compatible request and response bodies (pydantic v2), plus tokenmill's extras.

Requests accept unknown fields (OpenAI clients send extras freely) and log each name once; fields
tokenmill knows but cannot honour are refused by name (400); non-finite floats are rejected.
Shape and type errors surface as pydantic `ValidationError`s; `parse_request` turns them into an
`InvalidRequestError` whose `param` names the field. Range checks on sampling values live in
`SamplingParams.validate`, reached through `to_sampling_params`.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

import pydantic_core
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenmill.server.protocol_base import (
    MAX_MESSAGES,
    OpenAIModel,
    RequestModel,
    SamplingFields,
    random_id,
    refuse,
)

# Re-exported: the input limits and shared request parts live in protocol_base.py.
from tokenmill.server.protocol_base import MAX_N as MAX_N
from tokenmill.server.protocol_base import MAX_STOP_SEQUENCE_CHARS as MAX_STOP_SEQUENCE_CHARS
from tokenmill.server.protocol_base import MAX_STOP_SEQUENCES as MAX_STOP_SEQUENCES
from tokenmill.server.protocol_base import StreamOptions as StreamOptions
from tokenmill.server.protocol_structured import ResponseFormat as ResponseFormat
from tokenmill.server.protocol_tools import ChatTool, DeltaToolCall, MessageToolCall, ToolCall, ToolChoice

# --------------------------------------------------------------------------- chat requests


class ChatContentPart(RequestModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self) -> ChatContentPart:
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported; only 'text' is")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field")
        return self


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (some templates show it)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatTemplateFields(RequestModel):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # A template of the request's own: only with --trust-request-chat-template (it runs in the
    # server, sandboxed, but costs what it costs to render).
    chat_template: str | None = Field(default=None, min_length=1, max_length=65536)
    tools: list[ChatTool] | None = Field(default=None, max_length=256)  # [] = no tools
    # Retrieval documents for templates that take them (a list of objects, usually title + text).
    documents: list[dict[str, Any]] | None = None
    # Chat templates read it (gpt-oss style); refused when the model's template does not.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    add_special_tokens: bool = False  # the chat template already adds them

    @model_validator(mode="after")
    def _one_of_generation_prompt_or_continue(self) -> ChatTemplateFields:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be from the assistant")
        return self

    def messages_for_template(self) -> list[dict[str, Any]]:
        """Messages as plain dicts with string content, the shape chat templates expect."""
        out = []
        for m in self.messages:
            entry: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                entry["name"] = m.name
            if m.tool_calls:
                entry["tool_calls"] = [call.for_template() for call in m.tool_calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                entry["reasoning_content"] = m.reasoning_content
            out.append(entry)
        return out

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # false: the reasoning is dropped from the reply
    # The reply starts with the last message's content when that message is the assistant's
    # (vLLM's echo for chat: the continued message comes back whole).
    echo: bool = False
    return_token_ids: bool = False
    mm_processor_kwargs: Any = None
    # Refused by name: OpenAI's deprecated function calling and its multimodal / hosted options.
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported_chat_fields(self) -> ChatCompletionRequest:
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise refuse(name, "the deprecated function-calling fields are not served; use tools and tool_choice")
        if self.modalities is not None and self.modalities != ["text"]:
            raise refuse("modalities", "this server produces text only; send [\"text\"] or leave it out")
        for name in ("audio", "prediction", "web_search_options", "mm_processor_kwargs"):
            if getattr(self, name) is not None:
                raise refuse(name, "this server serves text generation from one model, nothing else")
        if self.return_token_ids:
            raise refuse("return_token_ids", "use logprobs with return_tokens_as_token_ids, or /tokenize")
        return self

    def echoed_text(self) -> str:
        """What echo puts before the reply: the last message's text if the assistant wrote it."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def to_sampling_params(
        self, default_max_tokens: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)


# --------------------------------------------------------------------------- completions requests

PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: PromptInput) -> PromptInput:
        # min() over whole lists: a per-token Python loop cost ~0.5 ms for a 512-token prompt, which a
        # burst of requests pays one after another on the event loop.
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt[0], int):  # list[int]: the union validated every item as one
                if min(prompt) < 0:
                    raise ValueError("prompt token ids must be non-negative")
                return prompt
            for item in prompt:
                if isinstance(item, list):
                    if not item:
                        raise ValueError("prompt token-id lists must not be empty")
                    if min(item) < 0:
                        raise ValueError("prompt token ids must be non-negative")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _reject_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each one a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    add_special_tokens: bool = True
    prompt_embeds: Any = None

    @field_validator("prompt_embeds")
    @classmethod
    def _refuse_prompt_embeds(cls, embeds: Any) -> Any:
        if embeds is not None:
            raise ValueError("prompt_embeds is not supported; send text or token ids")
        return embeds

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        defaults = defaults or {}
        max_tokens = self.max_tokens or defaults.get("max_tokens") or default_max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs  # echoed prompt tokens carry logprobs too
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogprobsContent(ChatCompletionLogprob):
    top_logprobs: list[ChatCompletionLogprob] = Field(default_factory=list)


class ChatCompletionLogprobs(OpenAIModel):
    content: list[ChatCompletionLogprobsContent] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM's extra: the prompt's logprobs when the request asked (prompt_logprobs); position 0: null.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class PromptLogprob(OpenAIModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


SSE_DONE = "data: [DONE]\n\n"


def sse_event(body: BaseModel) -> str:
    """One server-sent event carrying `body` as JSON."""
    return f"data: {body.model_dump_json()}\n\n"


# --------------------------------------------------------------------------- models, tokenize


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int | None = None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, tokens: list[int]) -> list[int]:
        if any(t < 0 for t in tokens):
            raise ValueError("token ids must be non-negative")
        return tokens


class DetokenizeResponse(OpenAIModel):
    prompt: str


# --------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo

    @classmethod
    def build(cls, message: str, *, type: str, status_code: int, param: str | None = None) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=type, param=param, code=status_code))

    @classmethod
    def from_exception(cls, exc: TokenmillError) -> ErrorResponse:
        return cls.build(exc.message, type=exc.error_type, status_code=exc.status_code, param=exc.param)


# --------------------------------------------------------------------------- parsing

RequestT = TypeVar("RequestT", bound=BaseModel)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _error_param(loc: tuple[int | str, ...]) -> str | None:
    # Union members and validators show up in `loc` as type tags ("list[int]", "str",
    # "ChatContentPart", "function-after[...]"); they are not field names.
    def is_tag(part: str) -> bool:
        return part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper()

    parts = [str(p) for p in loc if isinstance(p, int) or not is_tag(p)]
    return ".".join(parts) or None


def _clean(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def validation_error_to_invalid_request(exc: ValidationError) -> InvalidRequestError:
    """The problems in `exc` as one 400 whose `param` names the first bad field (e.g. `messages.0.role`)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, InvalidRequestError) and raised.param:
        # A validator that knows which field it refuses (a nested one may name a sub-field).
        prefix = _error_param(tuple(first["loc"]))
        param = raised.param if prefix is None or raised.param.startswith(prefix) else f"{prefix}.{raised.param}"
        return InvalidRequestError(raised.message, param=param)
    if first["type"] == "json_invalid":
        return InvalidRequestError(f"request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return InvalidRequestError("request body must be a JSON object")
    param = _error_param(tuple(first["loc"]))
    lines: list[str] = []
    for e in errors:
        line = f"{_error_param(tuple(e['loc'])) or 'body'}: {_clean(str(e['msg']))}"
        if line not in lines:
            lines.append(line)
    return InvalidRequestError("; ".join(lines), param=param)


def parse_request(cls: type[RequestT], body: bytes | str | dict[str, Any]) -> RequestT:
    """Validate a request body (raw JSON or a decoded dict); raise InvalidRequestError on any problem."""
    try:
        if isinstance(body, dict):
            return cls.model_validate(body)
        return cls.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error_to_invalid_request(exc) from exc


def parse_tokenize_request(body: bytes | str | dict[str, Any]) -> TokenizeRequest:
    """/tokenize takes either a chat request (`messages`) or a completion one (`prompt`)."""
    if not isinstance(body, dict):
        try:
            # The parser model_validate_json uses: it refuses what the other routes refuse (lone
            # surrogate escapes, which json.loads lets through to the tokenizer).
            body = pydantic_core.from_json(body)
        except ValueError as exc:
            raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
    cls = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    return parse_request(cls, body)
