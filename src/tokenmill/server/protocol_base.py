"""The request and response model bases, input limits and the sampling fields that chat and
completions requests share; protocol.py builds the endpoint bodies on them and re-exports them."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
