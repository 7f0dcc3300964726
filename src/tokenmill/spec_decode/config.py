"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON keys into a SpeculativeConfig."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.config import SpeculativeConfig

METHODS = ("ngram", "draft_model", "eagle3")
MAX_SPECULATIVE_TOKENS = 15
# vLLM names a draft model's method after the model; these mean the same here.
_METHOD_ALIASES = {"draft": "draft_model", "eagle-3": "eagle3", "[ngram]": "ngram"}
_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "revision",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "min_acceptance_rate",
)


def parse_speculative_config(value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A dict (or its JSON text) with vLLM's keys -> SpeculativeConfig; None stays None.

    Every error names the key and what would be right: a typo must not quietly turn speculation off.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; valid keys: {', '.join(_KEYS)}")
    method = value.get("method")
    model = value.get("model")
    if method is None:
        if model is None:
            raise ValueError(f"speculative_config needs 'method' (one of {', '.join(METHODS)})")
        method = "draft_model"  # vLLM: a model without a method is a draft model
    method = _METHOD_ALIASES.get(method, method)
    if method not in METHODS:
        raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; got {method!r}")
    k = value.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}; "
            f"got {k!r}"
        )
    if method == "ngram":
        if model is not None:
            raise ValueError("speculative_config method 'ngram' uses no model; drop 'model'")
    elif not isinstance(model, str) or not model:
        raise ValueError(f"speculative_config method {method!r} needs 'model': the drafter's directory or Hub id")
    # Default 2: a one-token match is mostly chance (random text repeats single tokens, rarely pairs),
    # and every failed draft costs a verification row.
    max_given = value.get("prompt_lookup_max")
    default_min = min(2, max_given) if isinstance(max_given, int) and max_given >= 1 else 2
    lookup_min = _int(value, "prompt_lookup_min", default_min, minimum=1)
    lookup_max = _int(value, "prompt_lookup_max", max(4, lookup_min), minimum=1)
    if lookup_max < lookup_min:
        raise ValueError(
            f"speculative_config prompt_lookup_max ({lookup_max}) must be >= prompt_lookup_min ({lookup_min})"
        )
    if method != "ngram" and ("prompt_lookup_min" in value or "prompt_lookup_max" in value):
        raise ValueError(f"speculative_config prompt_lookup_min/max apply to method 'ngram', not {method!r}")
    disable = value.get("disable_by_batch_size")
    if disable is not None:
        disable = _int(value, "disable_by_batch_size", 0, minimum=1)
    rate = value.get("min_acceptance_rate", 0.3)
    if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0.0 <= rate < 1.0:
        raise ValueError(f"speculative_config min_acceptance_rate must be a number in [0, 1); got {rate!r}")
    revision = value.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise ValueError(f"speculative_config revision must be a string; got {revision!r}")
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        model=model,
        revision=revision,
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
        disable_by_batch_size=disable,
        min_acceptance_rate=float(rate),
    )


def _int(value: dict[str, Any], key: str, default: int, *, minimum: int) -> int:
    got = value.get(key, default)
    if not isinstance(got, int) or isinstance(got, bool) or got < minimum:
        raise ValueError(f"speculative_config {key} must be an integer >= {minimum}; got {got!r}")
    return got
