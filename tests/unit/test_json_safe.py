"""JSON constraints never let a raw control character through (xgrammar's length-limited string
rule would: a tab or \\x01 inside a string, which json.loads rejects)."""

from __future__ import annotations

import json

import numpy as np
import xgrammar as xgr

from tests.server.fake_engine import tiny_tokenizer
from tokenmill.core.request import Request
from tokenmill.engine.structured_output.bitmask import BitmaskFiller
from tokenmill.engine.structured_output.json_safe import json_safe_words
from tokenmill.engine.structured_output.request_grammar import RequestGrammar
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


def allowed_ids(row: np.ndarray, vocab_size: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def test_safe_words_ban_exactly_the_control_characters_json_never_needs():
    vocab = [b"a", b"\t", b"x\x01", b"\n", b"\r\n", b" ", b"\x1f", b"ok"]
    row = json_safe_words(vocab, vocab_size=40)  # more logits than tokens: the rest stay allowed
    assert allowed_ids(row, 40) == {0, 3, 4, 5, 7} | set(range(8, 40))


def test_a_length_limited_string_takes_no_tab_under_the_json_mask():
    tokenizer = tiny_tokenizer()  # one token per byte: every control character is a token
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    request = Request("r", [1], params, eos_token_ids=(tokenizer.eos_token_id,))
    tab = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\t"))[0]
    letter = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a"))[0]
    safe = json_safe_words(info.decoded_vocab, len(tokenizer))
    for extra, tab_allowed in ((None, True), (safe, False)):  # the grammar alone lets the tab in
        grammar = RequestGrammar(compiled, request, extra)
        for token in tokenizer.encode('{"s":"', add_special_tokens=False):
            assert grammar.accept([], token) is None
        output = BitmaskFiller(len(tokenizer)).fill([("r", grammar)])
        ids = allowed_ids(np.frombuffer(output.bitmask, dtype="<i4"), len(tokenizer))
        assert letter in ids and (tab in ids) == tab_allowed
