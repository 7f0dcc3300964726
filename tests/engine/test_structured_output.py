"""Structured output (constrained decoding) through the whole engine, with xgrammar.

The default model (SmolLM2-135M Q4_1) samples at temperature 1.0 under a dozen JSON schemas and
every output must parse and validate; regex, choice, EBNF, json_object and structural tags hold
too. The tiny random Llama (fast to load, so the squeezed engines stay cheap) covers preemption,
chunked prefill, n > 1, bad specs, the compile-time bound and start_after_token_ids; after each,
no KV block or request is left behind.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.structured_output import INVALID_PREFIX
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams as SO

NAME = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict] = [
    {  # required fields, additionalProperties false, integer range
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # enums and booleans
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "in_stock": {"type": "boolean"},
        },
        "required": ["color", "size", "in_stock"],
        "additionalProperties": False,
    },
    {  # arrays with minItems / maxItems
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -50, "maximum": 50},
                "minItems": 2,
                "maxItems": 4,
            },
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME},
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {  # $ref / $defs
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    {  # a top-level array of enums
        "type": "array",
        "items": {"enum": ["north", "south", "east", "west"]},
        "minItems": 1,
        "maxItems": 4,
    },
    {  # numbers with ranges
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "rating": {"type": "number", "minimum": 1, "maximum": 5},
        },
        "required": ["price", "rating"],
        "additionalProperties": False,
    },
    {  # const, null and a string pattern
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "note": {"type": "null"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
        },
        "required": ["version", "note", "code"],
        "additionalProperties": False,
    },
    {  # anyOf
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
            "label": NAME,
        },
        "required": ["value", "label"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # string formats xgrammar knows, bounded
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "city": {"type": "string", "minLength": 2, "maxLength": 10},
        },
        "required": ["day", "city"],
        "additionalProperties": False,
    },
    {  # optional properties
        "type": "object",
        "properties": {
            "title": NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genre": {"enum": ["drama", "comedy", "sci-fi"]},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Answer in JSON:",
    "Here is the record as JSON:",
    "Output the data.",
    "JSON response:",
]


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(None, device="cpu", max_model_len=512, seed=0)


def _text(out) -> str:
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", (completion.finish_reason, out.error, completion.text)
    return completion.text


def test_json_schemas_sampled_outputs_all_validate(llm):
    requests = []
    for s, schema in enumerate(SCHEMAS):
        for k in range(17):
            params = SamplingParams(
                temperature=1.0,
                max_tokens=200,
                seed=1000 * s + k,
                structured_outputs=SO(json=schema, disable_any_whitespace=True),
            )
            requests.append((schema, PROMPTS[k % len(PROMPTS)], params))
    outputs = llm.generate([r[1] for r in requests], [r[2] for r in requests])
    assert len(outputs) >= 200
    for (schema, _, _), out in zip(requests, outputs, strict=True):
        value = json.loads(_text(out))
        jsonschema.validate(value, schema)
    stats = llm.engine.get_stats()
    assert stats["structured_output_compile_seconds_count"] >= len(SCHEMAS)
    assert stats["structured_output_mask_seconds_count"] > 0 and stats["structured_output_mask_seconds_sum"] > 0
    llm.engine.check_invariants()
    assert llm.engine.get_stats()["kv_cache_usage"] == 0.0


# Bounded (no unbounded repetition), so a sampled expression always ends within max_tokens.
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term)? (("+" | "-") term)?
term ::= factor (("*" | "/") factor)?
factor ::= number | "(" number ("+" | "-" | "*") number ")"
number ::= [1-9] [0-9]? | "0"
"""
STRUCTURAL_TAG = json.dumps(
    {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "content": {"type": "json_schema", "json_schema": {"enum": ["yes", "no"]}},
            "end": "</answer>",
        },
    }
)


def _arithmetic_ok(text: str) -> bool:
    if not re.fullmatch(r"[0-9+\-*/()]+", text):
        return False
    try:
        compile(text, "<expr>", "eval")
    except SyntaxError:
        return False
    return True


def test_json_object_regex_choice_grammar_and_structural_tag(llm):
    regex = r"(\+1 )?[0-9]{3}-[0-9]{4}"
    choices = ["positive", "negative", "neutral", 'it "depends"']
    kinds = [
        ("json_object", SO(json_object=True, disable_any_whitespace=True)),
        ("regex", SO(regex=regex)),
        ("choice", SO(choice=choices)),
        ("grammar", SO(grammar=ARITHMETIC)),
        ("structural_tag", SO(structural_tag=STRUCTURAL_TAG)),
    ]
    requests = [
        # Free-form JSON strings let a sampled tiny model ramble: json_object decodes greedily.
        (
            kind,
            SamplingParams(
                temperature=0.0 if kind == "json_object" else 1.0,
                seed=k,
                max_tokens=80,
                structured_outputs=so,
            ),
        )
        for kind, so in kinds
        for k in range(6)
    ]
    # Greedy prompts that close their object: a tiny model's free-form JSON strings can loop.
    json_prompts = ["A cat as a JSON object:", "A user profile in JSON:", "JSON config:", "Reply in JSON:"]
    prompts = [
        json_prompts[i % 4] if kind == "json_object" else "Reply:" for i, (kind, _) in enumerate(requests)
    ]
    outputs = llm.generate(prompts, [p for _, p in requests])
    for (kind, _), out in zip(requests, outputs, strict=True):
        text = _text(out)
        if kind == "json_object":
            assert isinstance(json.loads(text), dict), text
        elif kind == "regex":
            assert re.fullmatch(regex, text), text
        elif kind == "choice":
            assert text in choices, text
        elif kind == "grammar":
            assert _arithmetic_ok(text), text
        else:
            match = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)
            assert match and json.loads(match.group(1)) in ("yes", "no"), text
    llm.engine.check_invariants()


def test_unconstrained_greedy_output_unchanged_by_constrained_neighbours(llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts, greedy)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=SO(json=SCHEMAS[0], disable_any_whitespace=True)
    )
    mixed = llm.generate(
        ["Person:", prompts[0], "Person:", prompts[1], prompts[2]],
        [constrained, greedy, constrained, greedy, greedy],
    )
    assert [o.outputs[0].token_ids for o in (mixed[1], mixed[3], mixed[4])] == [
        o.outputs[0].token_ids for o in alone
    ]
    jsonschema.validate(json.loads(_text(mixed[0])), SCHEMAS[0])
    llm.engine.check_invariants()


@pytest.mark.parametrize(
    ("so", "words"),
    [
        (SO(json={"type": "objec"}), "json"),
        (SO(json='{"type": "object", '), "not valid JSON"),
        (SO(json={"type": "object", "properties": {"a": {"minLength": "x"}}}), "properties/a/minLength"),
        (SO(regex="(ab"), "parenthesis"),
        (SO(grammar="root ::= foo"), "foo"),
        (SO(structural_tag='{"x": 1}'), "format"),
    ],
)
def test_bad_specs_error_the_request_but_not_its_neighbour(llm, so, words):
    good = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(choice=["alpha", "beta"]))
    bad = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(["Pick one:", "Pick one:", "Hello"], [good, bad, plain])
    assert outputs[0].outputs[0].text in ("alpha", "beta")
    assert outputs[1].outputs[0].finish_reason == "error"
    assert outputs[1].error.startswith(INVALID_PREFIX), outputs[1].error
    assert words in outputs[1].error, outputs[1].error
    assert len(outputs[2].outputs[0].token_ids) == 4
    llm.engine.check_invariants()


def test_spec_size_limit_names_the_field():
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex") as info:
        SO(regex="a" * (64 * 1024 + 1))
    assert info.value.param == "structured_outputs.regex"
    with pytest.raises(InvalidRequestError, match="structured_outputs.json"):
        SO(json={"enum": ["x" * 70_000]})


# -- the tiny random Llama: squeezed engines, bounds, gating -------------------------------------

TINY_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "c": {"enum": ["a", "b"]},
    },
    "required": ["ok", "n", "c"],
    "additionalProperties": False,
}
TINY_REGEX = r"[a-z]{2,5}-[0-9]{1,3}"


def _tiny_outputs_valid(outputs, kinds) -> None:
    for kind, out in zip(kinds, outputs, strict=True):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (completion.finish_reason, out.error, completion.text)
            if kind == "json":
                jsonschema.validate(json.loads(completion.text), TINY_SCHEMA)
            elif kind == "regex":
                assert re.fullmatch(TINY_REGEX, completion.text), completion.text
            elif kind == "choice":
                assert completion.text in ("red", "green", "blue")


def _no_blocks_held(llm: LLM) -> None:
    llm.engine.check_invariants()
    scheduler = llm.engine.scheduler
    assert not scheduler.requests and not scheduler.kv.request_ids_with_blocks()
    assert not llm.engine.structured_output.grammars


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constraints_hold_under_preemption_chunked_prefill_and_n(tiny_llama_dir, async_scheduling):
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        max_model_len=256,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
        seed=0,
        async_scheduling=async_scheduling,
    )
    rng_words = [
        "the",
        "model",
        "token",
        "cache",
        "block",
        "page",
        "attention",
        "request",
        "batch",
        "stream",
        "server",
        "engine",
    ]
    prompts, params, kinds = [], [], []
    specs = {
        "json": SO(json=TINY_SCHEMA, disable_any_whitespace=True),
        "regex": SO(regex=TINY_REGEX),
        "choice": SO(choice=["red", "green", "blue"]),
    }
    for i in range(12):
        kind = list(specs)[i % 3]
        # Long prompts (up to ~60 tokens) over a 16-token budget: every prefill is chunked.
        prompts.append(" ".join(rng_words[(i + j) % len(rng_words)] for j in range(10 + 4 * i)))
        params.append(
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=100,
                n=2 if i % 4 == 0 else 1,
                structured_outputs=specs[kind],
            )
        )
        kinds.append(kind)
    # ignore_eos: the grammar's own end stops the request.
    params.append(
        SamplingParams(
            temperature=1.0, seed=99, max_tokens=100, ignore_eos=True, structured_outputs=specs["regex"]
        )
    )
    prompts.append("hello world")
    kinds.append("regex")
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    prompts.append("hello world")
    kinds.append("plain")
    outputs = llm.generate(prompts, params)
    stats = llm.engine.get_stats()
    assert stats["num_preemptions_total"] > 0
    assert stats["structured_output_compile_seconds_count"] == 3  # one per distinct spec: n > 1 and repeats hit the cache
    assert [len(o.outputs) for o in outputs[:-1]] == [p.n for p in params[:-1]]
    _tiny_outputs_valid(outputs[:-1], kinds[:-1])
    assert len(outputs[-1].outputs[0].token_ids) == 30
    _no_blocks_held(llm)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=256, block_size=8, seed=0)


def test_compile_over_the_time_bound_errors(tiny_llm, monkeypatch):
    monkeypatch.setenv("TOKENMILL_STRUCTURED_OUTPUT_COMPILE_TIMEOUT", "1e-9")
    schema = {"type": "object", "properties": {"fresh": {"type": "integer"}}, "required": ["fresh"]}
    slow = SamplingParams(max_tokens=20, structured_outputs=SO(json=schema))
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = tiny_llm.generate(["a b", "c d"], [slow, plain])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].error.startswith(
        INVALID_PREFIX + "compiling the json constraint took longer than 1e-09 s"
    )
    assert len(outputs[1].outputs[0].token_ids) == 5
    _no_blocks_held(tiny_llm)


def test_grammar_applies_only_after_start_after_token_ids(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    prompt = "the quick brown fox"
    free = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    marker = free.outputs[0].token_ids[:2]  # greedy makes these first: the gate opens right after
    regex = r"[0-9]{2}"
    params = SamplingParams(
        temperature=0.0, max_tokens=30, structured_outputs=SO(regex=regex, start_after_token_ids=marker)
    )
    out = tiny_llm.generate([prompt], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[:2] == marker
    assert re.fullmatch(regex, tok.decode(out.token_ids[2:], skip_special_tokens=True))
    # Without the gate the first token is already constrained.
    gated = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(regex=regex))
    ungated = tiny_llm.generate([prompt], gated)[0].outputs[0]
    assert re.fullmatch(regex, ungated.text)
    _no_blocks_held(tiny_llm)


def test_engine_stats_count_compiles_and_mask_steps(tiny_llm):
    before = tiny_llm.engine.get_stats()
    tiny_llm.generate(["x"], SamplingParams(max_tokens=20, structured_outputs=SO(regex=r"[xyz]{3}")))
    after = tiny_llm.engine.get_stats()
    assert after["structured_output_compile_seconds_count"] == before["structured_output_compile_seconds_count"] + 1
    assert (
        after["structured_output_compile_seconds_sum"] > before["structured_output_compile_seconds_sum"]
    )
    assert after["structured_output_mask_seconds_count"] >= before["structured_output_mask_seconds_count"] + 3


def test_model_without_tokenizer_errors_clearly(tiny_llama_dir, tmp_path):
    import shutil

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", max_model_len=64, block_size=8)
    params = SamplingParams(max_tokens=5, structured_outputs=SO(regex="[0-9]"))
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0]
    assert out.outputs[0].finish_reason == "error"
    assert out.error.startswith(INVALID_PREFIX) and "tokenizer" in out.error, out.error
    _no_blocks_held(llm)


def test_async_scheduling_keeps_constraints_and_unconstrained_greedy_output(tiny_llama_dir):
    prompts = ["the model token", "cache block page", "hello world", "a b c d"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    constrained = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=60, structured_outputs=SO(regex=TINY_REGEX)),
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            structured_outputs=SO(json=TINY_SCHEMA, disable_any_whitespace=True),
        ),
    ]
    results = {}
    for mode in (False, True):
        llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=256, block_size=4, async_scheduling=mode)
        plain_only = llm.generate(prompts[:2], greedy)
        outputs = llm.generate(prompts, [greedy, greedy, *constrained])
        assert [o.outputs[0].token_ids for o in outputs[:2]] == [o.outputs[0].token_ids for o in plain_only]
        _tiny_outputs_valid(outputs[2:], ["regex", "json"])
        _no_blocks_held(llm)
        results[mode] = [o.outputs[0].token_ids for o in outputs]
    assert results[False] == results[True]


def test_served_engine_core_process_carries_constraints_errors_and_stats(tiny_llama_dir):
    """Through the engine-core process (msgspec over ZMQ), as `tokenmill serve` runs it."""
    import asyncio

    from tokenmill.args import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine

    config = EngineArgs(
        model=str(tiny_llama_dir), device="cpu", max_model_len=128, block_size=8
    ).create_engine_config(resolve_device=False)

    async def run() -> tuple[list, list, dict]:
        engine = AsyncEngine(config)
        await engine.start()
        try:

            async def final(rid: str, params: SamplingParams):
                last = None
                async for out in engine.generate(rid, None, [5, 6, 7], params, stream=False):
                    last = out
                return last

            good = SamplingParams(
                temperature=1.0, seed=3, max_tokens=40, structured_outputs=SO(regex=TINY_REGEX)
            )
            bad = SamplingParams(max_tokens=5, structured_outputs=SO(regex="[a-"))
            outs = await asyncio.gather(final("good", good), final("bad", bad))
            for _ in range(50):  # stats arrive with the engine's step outputs
                if engine.stats.get("structured_output_compile_seconds_count"):
                    break
                await asyncio.sleep(0.05)
            return outs[0].outputs, [outs[1].error, outs[1].outputs[0].finish_reason], dict(engine.stats)
        finally:
            await engine.shutdown()

    good_outputs, (error, reason), stats = asyncio.run(run())
    assert good_outputs[0].finish_reason == "stop" and re.fullmatch(TINY_REGEX, good_outputs[0].text)
    assert reason == "error" and error.startswith(INVALID_PREFIX + "regex: "), error
    assert stats.get("structured_output_compile_seconds_count", 0) >= 1, stats


def test_async_mask_filled_in_chunks_as_tokens_arrive_gives_the_same_tokens(tiny_llama_dir, monkeypatch):
    """TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK=1 sends each row to the fill thread as its token is
    accepted, 64 all rows of the step's batch of accepts at once before the rest of the update; 0
    fills every row after the update: the same greedy tokens, valid outputs."""
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=256, block_size=4, async_scheduling=True)
    prompts = ["the model token", "cache block page", "hello world", "a b c d", "x y", "stream server"]
    specs = [SO(json=TINY_SCHEMA, disable_any_whitespace=True), SO(regex=TINY_REGEX)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=specs[i % 2]) for i in range(6)]
    results = {}
    for chunk in ("0", "1", "64", "0"):
        monkeypatch.setenv("TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK", chunk)
        outputs = llm.generate(prompts, params)
        _tiny_outputs_valid(outputs, ["json", "regex"] * 3)
        results.setdefault(chunk, []).append([o.outputs[0].token_ids for o in outputs])
    assert results["0"][0] == results["0"][1] == results["1"][0] == results["64"][0]
    _no_blocks_held(llm)


def test_a_failing_mask_fill_ends_only_its_request(tiny_llama_dir, monkeypatch):
    """xgrammar failing for one request's matcher (the step's batch fill raises, then its own row,
    on the async path's fill thread): that request ends with the error; its neighbours keep their
    greedy tokens; nothing leaks."""
    from tokenmill.engine.structured_output.request_grammar import RequestGrammar

    llm = LLM(
        str(tiny_llama_dir), device="cpu", max_model_len=256, block_size=4, async_scheduling=True
    )
    prompts = ["the model token", "cache block page", "hello world"]
    json_so = SO(json=TINY_SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=json_so),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SO(regex="[0-9]{2,9}")),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SO(regex=TINY_REGEX)),
    ]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    class Broken:
        def __init__(self, matcher) -> None:
            self._matcher = matcher

        def fill_next_token_bitmask(self, bitmask, row) -> bool:
            raise RuntimeError("boom")

        def __getattr__(self, name: str):
            if name == "_handle":  # xgrammar's batch call cannot take it either
                raise AttributeError(name)
            return getattr(self._matcher, name)

    init = RequestGrammar.__init__

    def broken_init(self, compiled, request, *args, **kwargs) -> None:
        init(self, compiled, request, *args, **kwargs)
        if request.sampling_params.structured_outputs.regex == "[0-9]{2,9}":
            self.matcher = Broken(self.matcher)

    monkeypatch.setattr(RequestGrammar, "__init__", broken_init)
    outputs = llm.generate(prompts, params)
    assert outputs[1].outputs[0].finish_reason == "error"
    assert "filling the token mask failed: RuntimeError: boom" in outputs[1].error
    assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == [before[0], before[2]]
    _tiny_outputs_valid([outputs[0], outputs[2]], ["json", "regex"])
    _no_blocks_held(llm)


def test_backend_prepared_ahead_builds_once_and_reports_a_missing_tokenizer_quietly(tiny_tokenizer, caplog):
    """`serve` builds the grammar compiler at start-up (backend.prepare) instead of on the first
    constrained request; compiles then reuse it. A model without a tokenizer is not a bug: no
    traceback, and every constrained request gets the reason."""
    import logging

    from tokenmill.engine.structured_output.backend import GrammarCompileError, XgrammarBackend

    loads: list[int] = []
    backend = XgrammarBackend(lambda: loads.append(1) or tiny_tokenizer, len(tiny_tokenizer))
    try:
        assert backend.prepare().result(timeout=120) is not None and loads == [1]
        compiled, _ = backend.submit(SO(regex="[0-9]+")).result(timeout=120)
        assert compiled is not None and loads == [1]
    finally:
        backend.shutdown()
    backend = XgrammarBackend(lambda: None, len(tiny_tokenizer))
    try:
        with caplog.at_level(logging.INFO):
            for future in (backend.prepare(), backend.submit(SO(regex="a"))):
                with pytest.raises(GrammarCompileError, match="no tokenizer"):
                    future.result(timeout=120)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        backend.shutdown()
