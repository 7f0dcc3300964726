"""Tokenizers: transformers' fast tokenizer from an HF directory or from GGUF metadata.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved once under the
cache directory (keyed by the file and the transformers version) and reloaded from there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tokenmill.model.loader.default_model import cache_dir
from tokenmill.model.loader.gguf_loader import gguf_metadata
from tokenmill.model.registry import ResolvedModel

logger = logging.getLogger(__name__)


def load_tokenizer(resolved: ResolvedModel, chat_template_override: str | None = None):
    """A transformers PreTrainedTokenizerFast for the model, with its chat template.

    `chat_template_override` is a Jinja template or the path of a file holding one.
    """
    from transformers import AutoTokenizer

    source = Path(resolved.tokenizer_path)
    if source.suffix == ".gguf":
        tokenizer = _load_gguf_tokenizer(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    if chat_template_override:
        from tokenmill.chat_template import load_chat_template

        tokenizer.chat_template = load_chat_template(chat_template_override)
    return tokenizer


def eos_token_ids(tokenizer, resolved: ResolvedModel) -> tuple[int, ...]:
    """The tokenizer's EOS followed by the model's (config.json and generation_config.json) ones."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids.extend(e for e in resolved.arch.eos_token_ids if e not in ids)
    return tuple(ids)


def _load_gguf_tokenizer(path: Path):
    import transformers
    from transformers import AutoTokenizer

    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))

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
