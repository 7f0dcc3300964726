"""Client-side validation and tokenization: bad input is refused here, before the engine sees it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.engine.messages import EngineCoreRequest, EngineInfo
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | dict[str, Any]

logger = logging.getLogger(__name__)

# Checkpoints pad their embedding rows a little past the tokenizer (Qwen2.5: 151,665 ids of
# 151,936; Phi-3: 32,011 of 32,064); a tokenizer covering much less belongs to another model.
TOKENIZER_COVERAGE_WARN_BELOW = 0.9


def tokenizer_coverage_warning(tokenizer: Any, vocab_size: int) -> str | None:
    """Why `tokenizer` does not fit a model sampling from `vocab_size` ids, or None if it does."""
    if tokenizer is None or len(tokenizer) >= TOKENIZER_COVERAGE_WARN_BELOW * vocab_size:
        return None
    missing = vocab_size - len(tokenizer)
    return (
        f"the tokenizer has {len(tokenizer):,} ids but the model samples from {vocab_size:,}: the "
        f"{missing:,} ids past the tokenizer decode to no text, so streams skip them and time to first "
        "text waits for an id the tokenizer knows; pass --tokenizer of this model (for dummy weights, "
        "benchmarks/make_dummy_tokenizer.py writes one of any size)"
    )


class InputProcessor:
    def __init__(self, tokenizer: Any, info: EngineInfo, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.info = info
        if (warning := tokenizer_coverage_warning(tokenizer, info.vocab_size)) is not None:
            logger.warning("%s", warning)
        self.eos_token_ids = list(eos_token_ids)
        self.kv_capacity_tokens = (
            info.kv_capacity_tokens
            if info.kv_capacity_tokens is not None
            else info.num_kv_blocks * info.block_size
        )

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Returns (prompt text if given as text, prompt token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    "a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer; send prompts as token ids", param="prompt"
                )
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, self._check_token_ids(prompt)

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, str | bytes):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        ids = list(token_ids)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        vocab = self.info.vocab_size
        # Whole-list checks in C (type set, min, max); the per-token loop finds the culprit only when
        # one is wrong.
        if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab:
            return ids
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab}), got {t!r}", param="prompt"
                )
        return ids

    def _with_bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        """`bad_words` (text) moved into `bad_words_token_ids`: the engine core has no tokenizer."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer; send bad_words_token_ids instead of bad_words", param="bad_words"
            )
        token_ids = list(params.bad_words_token_ids or [])
        token_ids += bad_words_to_token_ids(self.tokenizer, params.bad_words)
        return dataclasses.replace(params, bad_words=None, bad_words_token_ids=token_ids)

    def _check_vocab_range(self, params: SamplingParams) -> None:
        vocab = self.info.vocab_size
        fields: dict[str, Sequence[int]] = {
            "stop_token_ids": params.stop_token_ids,
            "logit_bias": list(params.logit_bias or ()),
            "allowed_token_ids": params.allowed_token_ids or (),
            "bad_words_token_ids": [t for word in params.bad_words_token_ids or () for t in word],
        }
        for name, token_ids in fields.items():
            for t in token_ids:
                if t >= vocab:
                    raise InvalidRequestError(
                        f"{name} must be < vocab size {vocab}, got {t}", param=name
                    )

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        max_len = self.info.max_model_len
        num_prompt = len(prompt_token_ids)
        if num_prompt >= max_len:
            raise InvalidRequestError(
                f"the prompt is {num_prompt} tokens, but this model's maximum context length is {max_len} tokens "
                "and at least one must be left to generate; shorten the prompt",
                param="prompt",
            )
        room = max_len - num_prompt
        if params.max_tokens is None:
            # Up to the context length, or what the KV pool can hold if that is smaller.
            max_tokens = min(room, self.kv_capacity_tokens - num_prompt)
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"the prompt is {num_prompt} tokens but the KV cache holds {self.kv_capacity_tokens}; shorten it",
                    param="prompt",
                )
        elif params.max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens, but {num_prompt + params.max_tokens} "
                f"were requested ({num_prompt} in the prompt, {params.max_tokens} to generate); lower max_tokens to "
                f"at most {room}",
                param="max_tokens",
            )
        else:
            max_tokens = params.max_tokens
        if num_prompt + max_tokens > self.kv_capacity_tokens:
            raise InvalidRequestError(
                f"the request needs up to {num_prompt + max_tokens} tokens of KV cache but the whole pool holds "
                f"{self.kv_capacity_tokens}; lower max_tokens or shorten the prompt",
                param="max_tokens",
            )
        params = self._with_bad_words_tokenized(params)
        self._check_vocab_range(params)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )


def bad_words_to_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Token sequences of `words`, as vLLM forms them: each word (leading spaces stripped) once as
    it would start the text, and once with a leading space as it would appear mid-text, when that
    is a different sequence of the same length (BPE tokenizers fold the space into the first
    token). Words are encoded without special tokens; ones that encode to nothing are skipped.
    """
    result: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        result.append(list(bare))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            result.append(list(spaced))
    return result
