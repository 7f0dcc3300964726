"""OpenAI-compatible request and response bodies (pydantic v2), plus tokenmill's extras.

Requests ignore unknown fields (OpenAI clients send extras freely) and reject non-finite floats.
Shape and type errors surface as pydantic `ValidationError`s; `parse_request` turns them into an
`InvalidRequestError` whose `param` names the field. Range checks on sampling values live in
`SamplingParams.validate`, reached through `to_sampling_params`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, TypeVar

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams

# Input limits: requests beyond them are refused with 400 before they reach the engine.
MAX_N = 64
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 512
MAX_MESSAGES = 2048

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's schema marks most fields nullable and clients do send `"n": null`: null = unset.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


# --------------------------------------------------------------------------- shared request parts


class StreamOptions(RequestModel):
    include_usage: bool = False


class ResponseFormat(RequestModel):
    type: str = "text"


class SamplingFields(RequestModel):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_UINT64_MAX)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Extras (vLLM's names).
    top_k: int | None = Field(default=None, le=_INT64_MAX)  # msgpack to the engine holds 64 bits
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    request_timeout: float | None = Field(default=None, gt=0)  # seconds

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        for s in stops:
            if not s:
                raise ValueError("stop sequences must be non-empty strings")
            if len(s) > MAX_STOP_SEQUENCE_CHARS:
                raise ValueError(f"stop sequences must be at most {MAX_STOP_SEQUENCE_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _reject_logit_bias(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        if logit_bias:
            raise ValueError("logit_bias is not supported; send null or {}")
        return logit_bias

    @field_validator("response_format")
    @classmethod
    def _only_text_format(cls, fmt: ResponseFormat | None) -> ResponseFormat | None:
        if fmt is not None and fmt.type != "text":
            raise ValueError(f"response_format type {fmt.type!r} is not supported; only 'text' is")
        return fmt

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


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
