"""The request and response model bases, input limits and the sampling fields that chat and
completions requests share; protocol.py builds the endpoint bodies on them and re-exports them."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.sampling_params import MAX_LOGPROBS, MAX_SLO_MS, SamplingParams
from tokenmill.server.protocol_structured import StructuredOutputFields
from tokenmill.server.request_model import OpenAIModel as OpenAIModel
from tokenmill.server.request_model import RequestModel as RequestModel
from tokenmill.server.request_model import refuse

# Input limits: requests beyond them are refused with 400 before they reach the engine.
MAX_N = 64
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 512
MAX_MESSAGES = 2048

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1


class KVTransferParams(BaseModel):
    """Disaggregated prefill / decode (vLLM's field name): the transfer a producer request's prompt
    blocks travel under, and the one a consumer request waits for (docs/KV_OFFLOAD.md). Every key
    is honoured or refused by name."""

    model_config = ConfigDict(extra="forbid")

    transfer_id: str = Field(min_length=1, max_length=256)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- shared request parts


class StreamOptions(RequestModel):
    include_usage: bool = False
    # Every chunk carries the usage so far (vLLM's extra), not only the last one.
    continuous_usage_stats: bool = False


# Sampling fields the server fills from the model's generation config when a request leaves them
# unset (request field -> SamplingParams field).
DEFAULTABLE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


class SamplingFields(StructuredOutputFields):
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
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that change nothing in a self-hosted engine: accepted (docs/API.md lists them).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # OpenAI / vLLM fields tokenmill knows and cannot honour: refused by name (see _refuse_unsupported).
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    logits_processors: Any = None
    kv_transfer_params: KVTransferParams | None = None  # honoured with --kv-role (request_fields.py)
    vllm_xargs: Any = None
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
    # Latency targets for --scheduling-policy slo (docs/SLO_SCHEDULING.md), milliseconds.
    slo_ttft_ms: float | None = Field(default=None, gt=0, le=MAX_SLO_MS)
    slo_tpot_ms: float | None = Field(default=None, gt=0, le=MAX_SLO_MS)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    bad_words: list[str] | None = None
    # Keep only the last N prompt tokens (vLLM's; -1: as many as the context allows).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # Logprob tokens as "token_id:N" (clients that cannot handle partial UTF-8 tokens).
    return_tokens_as_token_ids: bool = False
    request_id: str | None = Field(default=None, min_length=1, max_length=256)

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
    def _check_logit_bias(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return logit_bias

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, words: list[str] | None) -> list[str] | None:
        if words is not None and any(not w.strip() for w in words):
            raise ValueError("bad_words must be non-empty strings")
        return words

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if self.best_of is not None and self.best_of != self.n:
            raise refuse("best_of", f"tokenmill returns every sequence it samples; send n={self.best_of} instead")
        if self.use_beam_search:
            raise refuse("use_beam_search", "beam search is not implemented; sample with n instead")
        if self.length_penalty is not None and self.length_penalty != 1.0:
            raise refuse("length_penalty", "it only applies to beam search, which is not implemented")
        for name in ("logits_processors", "vllm_xargs"):
            if getattr(self, name) not in (None, [], {}):
                raise refuse(name, "this server has no such plug-in")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_stats(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """`max_tokens` is the request's (None: unset); `defaults` the model's generation config
        values for fields the request leaves unset (DEFAULTABLE_FIELDS)."""
        defaults = defaults or {}

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=pick(max_tokens, "max_tokens", None),
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words) if self.bad_words else None,  # tokenized by the input processor
            structured_outputs=self.structured_outputs_params(),
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            kv_transfer_id=self.kv_transfer_params.transfer_id if self.kv_transfer_params is not None else None,
        )
