"""Compiling grammars with xgrammar, off the step loop: a thread pool and a cache by spec.

The tokenizer and xgrammar's `TokenizerInfo` / `GrammarCompiler` are built on a pool thread (loading
a vocabulary and decoding it for xgrammar take 1-3 s): by the first compile job, or ahead of it
when the engine asks (`prepare`, which `serve` does at start-up, so that the first constrained
requests wait for their compile only). The cache key is the constraint's kind, its
canonical text and the whitespace flag; a failed compile is cached too (the same bad spec fails at
once). Error messages start with `INVALID_PREFIX`, which the API server maps to HTTP 400.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tokenmill.core.structured_output import INVALID_PREFIX
from tokenmill.engine.structured_output.json_safe import json_safe_words
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.stats_histogram import StatsHistogram

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str, bool]
CACHE_SIZE = 256
# Seconds: a cached JSON schema is ~ms; big schemas and grammars take up to seconds.
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# xgrammar's C++ errors carry "[hh:mm:ss] /path/file.cc:123: " and "Check failed: (...) is false: ".
_LOG_PREFIX = re.compile(r"\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")


class GrammarCompileError(Exception):
    """The constraint does not compile; the message says why (with INVALID_PREFIX)."""


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """(kind, canonical text, any_whitespace): equal constraints compile once."""
    kind = params.kind
    spec = params.spec
    if kind == "json":
        text = spec if isinstance(spec, str) else None
        try:
            obj = json.loads(spec) if isinstance(spec, str) else spec
            # Not sort_keys: the order of "properties" is the order the output's fields come in.
            text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError):
            text = spec if isinstance(spec, str) else repr(spec)
    elif kind == "choice":
        text = json.dumps(list(spec), ensure_ascii=False)
    elif kind == "json_object":
        text = ""
    else:
        text = str(spec)
    return kind, text, not params.disable_any_whitespace


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_error(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    text = _LOG_PREFIX.sub("", text)
    text = _CHECK_FAILED.sub("", text)
    return " ".join(text.split())


class XgrammarBackend:
    """Compiles `StructuredOutputsParams` into xgrammar `CompiledGrammar`s on worker threads."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, max_workers: int = 2) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._init_lock = threading.Lock()
        self._compiler: Any = None
        self._init_error: str | None = None
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        # Set with the compiler: the vocabulary grammars see, and the tokens JSON constraints may
        # produce (json_safe.py).
        self.grammar_vocab_size = vocab_size
        self.json_safe_words: np.ndarray | None = None
        # Compile times of cache misses (observed from pool threads; the histogram locks).
        self.compile_seconds = StatsHistogram("structured_output_compile_seconds", COMPILE_BUCKETS)

    # -- compiling ------------------------------------------------------------------------------

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of (CompiledGrammar, compile seconds); it raises GrammarCompileError."""
        key = grammar_key(params)
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, params: StructuredOutputsParams) -> tuple[Any, float]:
        compiler = self._get_compiler()
        started = time.perf_counter()
        try:
            compiled = self._compile_with(compiler, params)
        except GrammarCompileError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarCompileError(f"{INVALID_PREFIX}{params.kind}: {clean_error(exc)}") from None
        finally:
            elapsed = time.perf_counter() - started
            self.compile_seconds.observe(elapsed)
        return compiled, elapsed

    @staticmethod
    def _compile_with(compiler: Any, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        any_whitespace = not params.disable_any_whitespace
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise GrammarCompileError(
                        f"{INVALID_PREFIX}json: the schema is not valid JSON: {exc}"
                    ) from None
            if not isinstance(schema, dict | bool):
                raise GrammarCompileError(f"{INVALID_PREFIX}json: a JSON schema must be an object")
            _check_schema(schema)
            # No free whitespace: compact separators too (xgrammar's default puts a space after each).
            separators = None if any_whitespace else (",", ":")
            return compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=any_whitespace, separators=separators
            )
        if kind == "json_object":
            return compiler.compile_json_schema(
                '{"type": "object", "additionalProperties": true}',
                any_whitespace=any_whitespace,
                separators=None if any_whitespace else (",", ":"),
            )
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice or []))
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(params.structural_tag)
        raise GrammarCompileError(f"{INVALID_PREFIX}unknown constraint kind {kind!r}")

    def prepare(self) -> Future:
        """Build the compiler now, on a pool thread (a compile submitted meanwhile waits for it);
        the future holds the compiler or raises GrammarCompileError, which every compile then
        reports too."""
        return self._pool.submit(self._get_compiler)

    def _get_compiler(self) -> Any:
        with self._init_lock:
            if self._compiler is None and self._init_error is None:
                try:
                    self._compiler = self._build_compiler()
                except GrammarCompileError as exc:  # no tokenizer: not a bug, no traceback
                    logger.info("structured output is not available: %s", exc)
                    self._init_error = str(exc)
                except Exception as exc:
                    logger.exception("structured output: cannot build the grammar compiler")
                    self._init_error = (
                        f"{INVALID_PREFIX}cannot build the grammar compiler: {clean_error(exc)}"
                    )
            if self._init_error is not None:
                raise GrammarCompileError(self._init_error)
            return self._compiler

    def _build_compiler(self) -> Any:
        import xgrammar as xgr

        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise GrammarCompileError(
                f"{INVALID_PREFIX}the model has no tokenizer (dummy weights without tokenizer files), "
                "and a grammar needs one to know what each token spells"
            )
        started = time.perf_counter()
        # Grammars work on the tokenizer's vocabulary: logits rows past it (a model padded beyond
        # its tokenizer) spell nothing and are masked whole, and xgrammar's per-step fill, which
        # scales with the vocabulary it is given, skips them (2.4x cheaper for 49K of 128K).
        self.grammar_vocab_size = min(self.vocab_size, len(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.grammar_vocab_size)
        self.json_safe_words = json_safe_words(info.decoded_vocab, self.grammar_vocab_size)
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        logger.info("structured output: xgrammar ready in %.2f s", time.perf_counter() - started)
        return compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_schema(schema: dict | bool) -> None:
    """Reject a schema that is not a valid JSON Schema (jsonschema's meta-schema check), before
    xgrammar, whose converter accepts some nonsense silently."""
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a dependency
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise GrammarCompileError(
            f"{INVALID_PREFIX}json: the schema is invalid{f' at {where}' if where else ''}: {exc.message}"
        ) from None
