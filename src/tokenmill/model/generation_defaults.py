"""Default sampling parameters from the model: its generation_config.json (vLLM's
`--generation-config`).

Torch-free: the API server calls `generation_defaults` once at start-up and fills the fields a
request leaves unset; the offline `LLM` and the `generate` / `chat` CLI do the same with it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.model.loader.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_SAMPLING
from tokenmill.model.resolve import ResolvedModel
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field, with the type the field takes. vLLM reads
# the same keys; do_sample is ignored as there (a model that ships a temperature means it).
_FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}


def generation_defaults(model_config: ModelConfig, resolved: ResolvedModel) -> dict[str, Any]:
    """The default sampling fields for requests on this model, as `SamplingParams` keyword
    arguments: a subset of temperature, top_p, top_k, min_p, repetition_penalty and max_tokens
    (from generation_config.json's max_new_tokens). Empty: tokenmill's own defaults apply.

    `model_config.generation_config` picks the source: "vllm" -> {}; a directory -> its
    generation_config.json; "auto" -> the model directory's generation_config.json (for a .gguf
    file, one next to it or in the tokenizer directory), else, for the default model, its model
    card's recommendation (temperature 0.2, top_p 0.9). Logs the result once when non-empty, so call
    it once per engine. Raises ValueError when a given directory has no generation_config.json.
    """
    mode = model_config.generation_config
    if mode == "vllm":
        return {}
    if mode == "auto":
        config_file = _find_generation_config(resolved)
        if config_file is None:
            defaults = dict(DEFAULT_MODEL_SAMPLING) if _is_default_model(resolved) else {}
            source = "the default model's recommended sampling"
        else:
            defaults = read_generation_defaults(config_file)
            source = str(config_file)
    else:
        config_file = Path(mode).expanduser() / GENERATION_CONFIG_FILE
        if not config_file.is_file():
            raise ValueError(f"generation_config {mode!r}: no {GENERATION_CONFIG_FILE} there")
        defaults = read_generation_defaults(config_file)
        source = str(config_file)
    if defaults:
        logger.info(
            "requests that leave them unset sample with the model's defaults %s (from %s); "
            "pass --generation-config vllm to use tokenmill's own",
            defaults,
            source,
        )
    return defaults


def read_generation_defaults(config_file: Path) -> dict[str, Any]:
    """The sampling fields of one generation_config.json (keys renamed as SamplingParams names
    them); values that are missing, null, not numbers or out of SamplingParams' range are left out
    (the last with a warning), so the defaults never make a request invalid."""
    with config_file.open() as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} does not hold a JSON object")
    defaults: dict[str, Any] = {}
    for key, (name, kind) in _FIELDS.items():
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if kind is int and value != int(value):
            continue
        try:
            SamplingParams(**{name: kind(value)})
        except InvalidRequestError as exc:
            logger.warning("ignoring %s in %s: %s", key, config_file, exc)
            continue
        defaults[name] = kind(value)
    return defaults


def _find_generation_config(resolved: ResolvedModel) -> Path | None:
    path = Path(resolved.path)
    candidates = [path] if path.is_dir() else [path.parent]
    tokenizer_path = Path(resolved.tokenizer_path)
    if tokenizer_path.is_dir():
        candidates.append(tokenizer_path)
    for directory in candidates:
        config_file = directory / GENERATION_CONFIG_FILE
        if config_file.is_file():
            return config_file
    return None


def _is_default_model(resolved: ResolvedModel) -> bool:
    # By file name: the default model passed as an explicit path is the same model.
    return resolved.format in ("gguf", "dummy") and Path(resolved.path).name == DEFAULT_MODEL_FILE
