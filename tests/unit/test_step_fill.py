"""A constrained step's mask filled in chunks as its requests' tokens are accepted (StepFill) equals
the mask filled all at once after every accept (BitmaskFiller.fill), with real xgrammar matchers:
rows sent before later accepts, a request accepted twice, one whose grammar ends, one with no token
this update, and one the step does not sample."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from tokenmill.core.request import Request
from tokenmill.engine.structured_output.bitmask import BitmaskFiller
from tokenmill.engine.structured_output.request_grammar import RequestGrammar
from tokenmill.engine.structured_output.step_fill import StepFill
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def setup():
    import xgrammar as xgr

    vocab = [chr(c) for c in range(32, 127)] + ["ab", "12", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgr.GrammarCompiler(info).compile_regex(r"(ab|[0-9]{2,4})x")
    request = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="x")))
    return vocab, compiled, request


def _grammars(setup, prefixes: list[str]) -> dict[str, RequestGrammar]:
    vocab, compiled, request = setup
    grammars = {}
    for i, prefix in enumerate(prefixes):
        grammar = RequestGrammar(compiled, request)
        assert grammar.matcher.accept_string(prefix) or not prefix
        grammars[f"r{i}"] = grammar
    return grammars


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_chunked_fill_equals_fill_after_all_accepts(setup, chunk):
    vocab = setup[0]
    prefixes = ["", "a", "1", "12", "123", "9", "", "5", "abx"]
    tokens = {"r0": "1", "r1": "b", "r2": "2", "r3": "3", "r4": "4", "r5": "9", "r7": "5", "r8": "</s>"}
    step_ids = [f"r{i}" for i in range(len(prefixes))]  # r6 gets no token this update
    chunked, reference = _grammars(setup, prefixes), _grammars(setup, prefixes)
    filler = BitmaskFiller(len(vocab))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = StepFill(step_ids, filler.buffer_for(len(step_ids)), pool, filler.fill_rows, chunk)
        for request_id, text in tokens.items():
            grammar = chunked[request_id]
            assert grammar.accept([], vocab.index(text)) is None
            step.accepted(request_id, grammar)
            if request_id == "r2":  # a second token for an already queued (chunk 1, 3: filled) row
                pool.submit(lambda: None).result()  # the rows sent so far are filled
                assert grammar.accept([], vocab.index("x")) is None
                step.accepted(request_id, grammar)
        step.accepted("not-in-this-step", chunked["r0"])  # ignored
        output = step.finish(chunked).result()
    for request_id, text in tokens.items():
        assert reference[request_id].accept([], vocab.index(text)) is None
    assert reference["r2"].accept([], vocab.index("x")) is None
    assert chunked["r8"].is_terminated and not chunked["r8"].needs_mask  # "abx" then the stop token
    expected = BitmaskFiller(len(vocab)).fill([(r, g) for r, g in reference.items() if g.needs_mask])
    assert output.request_ids == expected.request_ids == [r for r in step_ids if r != "r8"]
    assert output.rows_per_request == expected.rows_per_request
    assert output.num_words == expected.num_words
    assert np.array_equal(
        np.frombuffer(output.bitmask, "<i4"), np.frombuffer(expected.bitmask, "<i4")
    ), "chunked rows differ from the rows filled after all accepts"


def test_a_step_with_no_constrained_row_left_is_empty(setup):
    vocab = setup[0]
    grammars = _grammars(setup, ["abx"])
    filler = BitmaskFiller(len(vocab))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = StepFill(["r0"], filler.buffer_for(1), pool, filler.fill_rows, 1)
        assert grammars["r0"].accept([], vocab.index("</s>")) is None
        step.accepted("r0", grammars["r0"])
        assert step.finish(grammars).result().is_empty


def test_flushed_rows_fill_before_finish_and_equal_the_rows_after_all_accepts(setup):
    """A batch of accepts sends its rows at once (`flush`), whatever the chunk; a later second token
    for one of them refills that row; the step's rows equal those filled after every accept."""
    vocab = setup[0]
    prefixes = ["", "a", "1", "12", "5"]
    step_ids = [f"r{i}" for i in range(len(prefixes))]
    flushed, reference = _grammars(setup, prefixes), _grammars(setup, prefixes)
    tokens = {"r0": "1", "r1": "b", "r2": "2", "r3": "3"}  # r4 gets no token
    filler = BitmaskFiller(len(vocab))
    calls = []

    def fill_rows(grammars, buffer, rows):
        calls.append(list(rows))
        filler.fill_rows(grammars, buffer, rows)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = StepFill(step_ids, filler.buffer_for(len(step_ids)), pool, fill_rows, 100)
        for request_id, text in tokens.items():
            assert flushed[request_id].accept([], vocab.index(text)) is None
            step.accepted(request_id, flushed[request_id])
        step.flush()
        pool.submit(lambda: None).result()
        assert calls == [[0, 1, 2, 3]]  # sent before finish, in one call
        assert flushed["r2"].accept([], vocab.index("3")) is None
        step.accepted("r2", flushed["r2"])
        output = step.finish(flushed).result()
    assert calls[1:] == [[2, 4]]  # r2 again (its row was stale), r4 (no token this update)
    for request_id, text in tokens.items():
        assert reference[request_id].accept([], vocab.index(text)) is None
    assert reference["r2"].accept([], vocab.index("3")) is None
    expected = BitmaskFiller(len(vocab)).fill(list(reference.items()))
    assert output.request_ids == expected.request_ids == step_ids
    assert output.bitmask == expected.bitmask
