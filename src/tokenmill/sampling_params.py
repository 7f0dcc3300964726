"""User-facing sampling parameters, named as in vLLM so users can switch.

Pure Python (no torch): the scheduler and the API server both read these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequestError

MAX_LOGPROBS = 20
# OpenAI's bound on logit_bias values: +100 forces a token, -100 bans it in practice.
MAX_LOGIT_BIAS = 100.0
# The longest constraint text (a JSON schema's JSON, a regex, a grammar, all choices together)
# the engine compiles: larger specs are refused before any compile work.
MAX_STRUCTURED_OUTPUT_SPEC_BYTES = 64 * 1024
# The largest latency target accepted (a day): beyond it a target means nothing to a scheduler.
MAX_SLO_MS = 86_400_000.0


@dataclass(slots=True)
class StructuredOutputsParams:
    """One output constraint (exactly one of the first six fields), vLLM's `structured_outputs`.

    Plain data (msgspec carries it to the engine core, where a grammar backend compiles it). The
    API server fills it from `response_format`, `structured_outputs`, `guided_*` and forced tool
    choices; offline users pass it in `SamplingParams(structured_outputs=...)`.
    """

    json: str | dict[str, Any] | None = None  # a JSON Schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF / GBNF
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # JSON text of a structural tag (triggers + schemas)
    # Compact JSON (no free whitespace between tokens): keeps a sampled model from rambling in
    # whitespace; vLLM's `disable_any_whitespace`.
    disable_any_whitespace: bool = False
    # The constraint starts once the output contains this token sequence (a reasoning model's
    # end-of-thinking marker, set by the server's reasoning parser); empty: from the first token.
    start_after_token_ids: list[int] = field(default_factory=list)

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is ("json", "regex", ...)."""
        for name in self.KINDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise AssertionError("validate() guarantees one constraint")

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    def validate(self) -> None:
        given = [n for n in self.KINDS if getattr(self, n) is not None and getattr(self, n) is not False]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {', '.join(given) if given else 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                param="structured_outputs.choice",
            )
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a non-empty string", param=f"structured_outputs.{name}"
                )
        kind = given[0]
        size = _spec_size(getattr(self, kind))
        if size > MAX_STRUCTURED_OUTPUT_SPEC_BYTES:
            raise InvalidRequestError(
                f"structured_outputs.{kind} is {size} bytes long; the limit is "
                f"{MAX_STRUCTURED_OUTPUT_SPEC_BYTES} bytes",
                param=f"structured_outputs.{kind}",
            )


def _spec_size(spec: Any) -> int:
    """Bytes of a constraint's text (a schema object counts as its JSON text)."""
    if isinstance(spec, str):
        return len(spec.encode("utf-8", "surrogatepass"))
    if isinstance(spec, list):
        return sum(_spec_size(item) for item in spec)
    if isinstance(spec, dict):
        import json

        try:
            return len(json.dumps(spec, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError):
            return 0
    return 0


MAX_KV_TRANSFER_ID_CHARS = 256


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Logits processors (vLLM's names): added to the logits of these token ids; only these ids may
    # be sampled; token sequences that must not be generated (their last token is banned while the
    # output ends with the others).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's `bad_words`: words as text. The input processor tokenizes them (each with and without
    # a leading space) into bad_words_token_ids before the request reaches the engine core.
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Latency targets for the `slo` scheduling policy (tokenmill/slo.py), in milliseconds: time to first
    # token and mean time per output token. Not sampling, but they travel with the request the
    # same way to the scheduler; None: the server's class / default targets.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Disaggregated prefill / decode (kv_transfer_params.transfer_id): on a producer, the id its
    # prompt blocks travel under; on a consumer, the transfer the request waits for before it starts
    # (docs/KV_OFFLOAD.md). An engine without --kv-role refuses it.
    kv_transfer_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):
            # JSON objects have only string keys: accept "123" for token 123 (the API's form).
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    # The flags below are the one place where "what does sampling this request need" is derived;
    # the engine, the model runner and the sampling metadata all read them.

    @property
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalty: the logits depend on earlier tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_output_history(self) -> bool:
        """Sampling reads the request's earlier output tokens (penalties, the min_tokens ban)."""
        return (
            self.has_penalties or self.min_tokens > 0 or bool(self.bad_words_token_ids) or bool(self.bad_words)
        )

    @property
    def needs_host_history(self) -> bool:
        """A step needs the previous step's tokens on the host first (no step overlap then):
        the output history above, or prompt logprobs (computed with host syncs). A grammar does
        not: the engine launches a constrained step's forward first and fills its mask once the
        previous step's tokens have advanced the grammar."""
        return self.needs_output_history or self.prompt_logprobs is not None

    @property
    def has_logits_processors(self) -> bool:
        """logit_bias, allowed_token_ids or bad words change this request's logits."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
            or bool(self.bad_words)
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that changes the argmax or asks for more than the token: no
        penalties, no min_tokens ban, no logits processors, no logprobs. Such a batch samples with one
        argmax. (A grammar does not count: its mask is applied to the logits before any sampling.)"""
        return (
            self.is_greedy
            and self.logprobs is None
            and not self.needs_output_history
            and not self.has_logits_processors
        )

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_SLO_MS
            ):
                raise bad(name, f"must be a number of milliseconds in (0, {MAX_SLO_MS:g}]")
        if self.kv_transfer_id is not None and (
            not isinstance(self.kv_transfer_id, str) or not 1 <= len(self.kv_transfer_id) <= MAX_KV_TRANSFER_ID_CHARS
        ):
            raise bad("kv_transfer_id", f"must be a string of 1 to {MAX_KV_TRANSFER_ID_CHARS} characters")
        self._validate_logits_processors(bad)

    def _validate_logits_processors(self, bad: Any) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(_is_token_id(k) for k in self.logit_bias):
                raise bad("logit_bias", "must map non-negative integer token ids to biases")
            for value in self.logit_bias.values():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise bad("logit_bias", "values must be numbers")
                if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(_is_token_id(t) for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative integers")
        if self.bad_words_token_ids is not None and (
            not isinstance(self.bad_words_token_ids, list)
            or not all(
                isinstance(word, list) and word and all(_is_token_id(t) for t in word)
                for word in self.bad_words_token_ids
            )
        ):
            raise bad("bad_words_token_ids", "must be a list of non-empty lists of non-negative integers")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", "must be a list of non-empty strings")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_key(key: Any) -> Any:
    """A logit_bias key as a token id: "123" -> 123; anything else is left for validate() to refuse."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return key
