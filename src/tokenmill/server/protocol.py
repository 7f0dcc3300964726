"""OpenAI-compatible request and response bodies (pydantic v2), plus tokenmill's extras.

Requests ignore unknown fields (OpenAI clients send extras freely) and reject non-finite floats.
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
from tokenmill.server.protocol_base import MAX_MESSAGES, OpenAIModel, RequestModel, SamplingFields, random_id

# Re-exported: the input limits and shared request parts live in protocol_base.py.
from tokenmill.server.protocol_base import MAX_N as MAX_N
from tokenmill.server.protocol_base import MAX_STOP_SEQUENCE_CHARS as MAX_STOP_SEQUENCE_CHARS
from tokenmill.server.protocol_base import MAX_STOP_SEQUENCES as MAX_STOP_SEQUENCES
from tokenmill.server.protocol_base import ResponseFormat as ResponseFormat
from tokenmill.server.protocol_base import StreamOptions as StreamOptions

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

    @model_validator(mode="after")
    def _one_of_generation_prompt_or_continue(self) -> ChatTemplateFields:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be from the assistant")
        return self

    def messages_for_template(self) -> list[dict[str, str]]:
        """Messages as plain dicts with string content, the shape chat templates expect."""
        out = []
        for m in self.messages:
            entry = {"role": m.role, "content": m.text()}
            if m.name is not None:
                entry["name"] = m.name
            out.append(entry)
        return out


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs)


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
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be empty")
            for item in prompt:
                if isinstance(item, list) and not item:
                    raise ValueError("prompt token-id lists must not be empty")
                ids = item if isinstance(item, list) else [item] if isinstance(item, int) else []
                if any(t < 0 for t in ids):
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

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_tokens or default_max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs  # echoed prompt tokens carry logprobs too
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


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


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
    add_special_tokens: bool = False  # the chat template already adds them
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
