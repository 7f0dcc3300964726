"""Tokenizers: transformers' fast tokenizer from an HF directory or from GGUF metadata.

Loaded in the API server process, which never imports torch: `transformers.AutoTokenizer` does
(its module pulls in the config classes, which import torch when it is installed), so a tokenizer
whose `tokenizer_config.json` names the generic fast class (`TokenizersBackend`, alias
`PreTrainedTokenizerFast`: the default model, Llama 3, every tokenizer transformers v5 saves) is
built by that class directly, which is what AutoTokenizer builds for it too. Any other class (a
model-specific one, remote code) still goes through AutoTokenizer, torch or not.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved once under the
cache directory (keyed by the file and the transformers version) and reloaded from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.model.loader.gguf_metadata import gguf_metadata
from tokenmill.model.resolve import ResolvedModel
from tokenmill.paths import cache_dir

logger = logging.getLogger(__name__)

_GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(resolved: ResolvedModel, chat_template_override: str | None = None):
    """A transformers fast tokenizer for the model, with its chat template.

    `chat_template_override` is a Jinja template or the path of a file holding one.
    """
    source = Path(resolved.tokenizer_path)
    if source.suffix == ".gguf":
        tokenizer = _load_gguf_tokenizer(source)
    else:
        tokenizer = _load_hf_tokenizer(source)
    if chat_template_override:
        from tokenmill.chat_template import load_chat_template

        tokenizer.chat_template = load_chat_template(chat_template_override)
    return tokenizer


def load_tokenizer_or_none(resolved: ResolvedModel, chat_template: str | None) -> Any:
    """The model's tokenizer; a dummy-weights model without tokenizer files runs on token ids alone."""
    try:
        return load_tokenizer(resolved, chat_template)
    except (OSError, ValueError) as exc:
        if resolved.format != "dummy":
            raise
        logger.warning(
            "no tokenizer for %s (%s); prompts must be token ids and outputs are not detokenized",
            resolved.path,
            exc,
        )
        return None


def eos_token_ids(tokenizer, resolved: ResolvedModel) -> tuple[int, ...]:
    """The tokenizer's EOS followed by the model's (config.json and generation_config.json) ones."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids.extend(e for e in resolved.arch.eos_token_ids if e not in ids)
    return tuple(ids)


def _declares_generic_fast_class(directory: Path) -> bool:
    """True when the directory's tokenizer is the generic fast class, with a tokenizer.json and no
    custom code: then AutoTokenizer would build exactly that class from exactly these files."""
    config_path = directory / "tokenizer_config.json"
    if not (directory / "tokenizer.json").is_file() or not config_path.is_file():
        return False
    try:
        with config_path.open() as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return config.get("tokenizer_class") in _GENERIC_FAST_CLASSES and "auto_map" not in config


def _load_hf_tokenizer(directory: Path):
    if _declares_generic_fast_class(directory):
        # Its own module, torch-free (v5 calls the class TokenizersBackend; this name works in v4 too).
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _load_gguf_tokenizer(path: Path):
    import transformers

    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (cached / "tokenizer.json").is_file():
        return _load_hf_tokenizer(cached)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not tokenizer.chat_template:
        template = gguf_metadata(path, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".partial-"))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cached)  # atomic; fails harmlessly if another process won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:  # a read-only cache only costs the conversion next time
        logger.warning("could not cache the converted tokenizer in %s: %s", cached, exc)
    return tokenizer
