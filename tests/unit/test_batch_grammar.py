"""xgrammar's batch API in the step's grammar work gives what one call per matcher gives, with real
matchers: the mask rows bit for bit (one row per request, and draft rows: accepted, rejected and
stop-token drafts, rolled back after), the accept verdicts (rejections, a closed start-after gate,
an errored grammar, a completed one); and a failing call ends only its requests, with an error."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.core.request import Request
from tokenmill.engine.structured_output.batch_accept import accept_batch
from tokenmill.engine.structured_output.bitmask import BitmaskFiller, fill_threads
from tokenmill.engine.structured_output.request_grammar import RequestGrammar
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = [chr(c) for c in range(32, 127)] + ["ab", "12", '{"', '":', "</s>"]
STOP = len(VOCAB) - 1
SCHEMA = (
    '{"type": "object", "properties": {"n": {"type": "string", "maxLength": 4}, '
    '"k": {"type": "integer"}}, "required": ["n", "k"], "additionalProperties": false}'
)
# Texts (each a complete value) whose prefixes place matchers all over the grammar.
TEXTS = ['{"n":"ab","k":12}', '{"n":"","k":7}', '{"n":"x1y2","k":-3}']


@pytest.fixture(scope="module")
def compiled():
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[STOP])
    compiler = xgr.GrammarCompiler(info)
    return compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":"))


def _tok(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def _grammars(compiled, starts: list[tuple[str, int]]) -> list[tuple[str, RequestGrammar]]:
    request = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="x")))
    out = []
    for i, (text, at) in enumerate(starts):
        grammar = RequestGrammar(compiled, request, vocab_size=len(VOCAB))
        for token in _tok(text)[:at]:
            assert grammar.accept([], token) is None
        out.append((f"r{i}", grammar))
    return out


def _starts() -> list[tuple[str, int]]:
    return [(text, at) for text in TEXTS for at in range(0, len(text), 2)]


def _drafts(
    grammars: list[tuple[str, RequestGrammar]], starts: list[tuple[str, int]]
) -> dict[str, list[int]]:
    """Per request: none, the right next tokens (through the stop token and past it), or a wrong one
    midway."""
    drafts = {}
    for (request_id, _), (text, at), kind in zip(grammars, starts, range(len(starts)), strict=True):
        rest = _tok(text)[at:] + [STOP, STOP]
        if kind % 4 == 1:
            drafts[request_id] = rest[:3]
        elif kind % 4 == 2:
            drafts[request_id] = rest[:1] + [VOCAB.index("}")] + rest[2:4]  # wrong at the 2nd
        elif kind % 4 == 3:
            drafts[request_id] = rest[-4:]  # near the end: reaches the stop token, then one past it
    return drafts


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_drafts", [False, True])
def test_batch_fill_is_bit_identical_to_per_matcher_fill(compiled, threads, with_drafts):
    starts = _starts()
    batch_grammars, loop_grammars = _grammars(compiled, starts), _grammars(compiled, starts)
    drafts = _drafts(batch_grammars, starts) if with_drafts else None
    assert not with_drafts or any(STOP in d for d in drafts.values())
    batch = BitmaskFiller(len(VOCAB), initial_rows=2, threads=threads).fill(batch_grammars, drafts)
    loop = BitmaskFiller(len(VOCAB), initial_rows=2, batch=False).fill(loop_grammars, drafts)
    assert batch.rows_per_request == loop.rows_per_request
    assert batch.request_ids == loop.request_ids and batch.num_words == loop.num_words
    assert batch.bitmask == loop.bitmask
    assert [g.error for _, g in batch_grammars] == [g.error for _, g in loop_grammars] == [None] * len(starts)
    rows = np.frombuffer(batch.bitmask, dtype="<i4").reshape(-1, batch.num_words)
    assert rows.any(axis=1).all()
    # Rolled back: the matchers are where they were (the next plain fill equals a fresh one's).
    fresh = BitmaskFiller(len(VOCAB), batch=False).fill(_grammars(compiled, starts))
    assert BitmaskFiller(len(VOCAB), threads=threads).fill(batch_grammars).bitmask == fresh.bitmask


def test_draft_rows_follow_the_drafts_and_repeat_after_a_rejection(compiled):
    ((_, grammar),) = _grammars(compiled, [(TEXTS[0], 1)])  # after '{'
    drafts = {"r0": _tok('"n') + [VOCAB.index("}")] + _tok('"')}  # the 3rd draft is wrong
    output = BitmaskFiller(len(VOCAB), threads=2).fill([("r0", grammar)], drafts)
    rows = np.frombuffer(output.bitmask, dtype="<i4").reshape(-1, output.num_words)
    assert output.rows_per_request == [5]

    def allows(row: int, text: str) -> bool:
        t = VOCAB.index(text)
        return bool(rows[row, t // 32] >> (t % 32) & 1)

    assert allows(0, '"') and not allows(0, "n")  # '{' then a key's quote
    assert allows(1, "n") and allows(2, '"')  # inside the key, then its closing quote
    assert (rows[3] == rows[2]).all() and (rows[4] == rows[2]).all()  # after the rejected draft


def test_batch_accept_gives_the_per_matcher_verdicts(compiled):
    starts = _starts() + [(TEXTS[0], len(TEXTS[0]))] * 2  # complete: the stop token ends them
    batch_grammars, loop_grammars = _grammars(compiled, starts), _grammars(compiled, starts)
    for grammars in (batch_grammars, loop_grammars):
        grammars[0][1].error = "earlier error"
        grammars[1][1].active, grammars[1][1].start_after = False, [5, 6]  # a closed gate
        grammars[2][1].active, grammars[2][1].start_after = False, [5, 6]
    tokens = []
    for i, (text, at) in enumerate(starts):
        right = (_tok(text) + [STOP])[at]
        tokens.append(VOCAB.index("}") if i % 3 == 0 else right)  # some rejected
    tokens[1], tokens[2] = 9, 6
    outputs = [[3], [3], [3, 5]] + [[] for _ in starts[3:]]  # before the token: r2's gate opens with 6
    verdicts = accept_batch(
        [(g, out, t) for (_, g), out, t in zip(batch_grammars, outputs, tokens, strict=True)]
    )
    one_by_one = [
        g.accept(out + [t], t) for (_, g), out, t in zip(loop_grammars, outputs, tokens, strict=True)
    ]
    assert verdicts == one_by_one
    assert verdicts[0] == "earlier error" and verdicts[1] is None
    assert any(v is None for v in verdicts[3:]) and any(v and "does not allow" in v for v in verdicts[3:])
    for (_, a), (_, b) in zip(batch_grammars, loop_grammars, strict=True):
        assert (a.active, a.error, a.num_accepted, a.is_terminated) == (
            b.active,
            b.error,
            b.num_accepted,
            b.is_terminated,
        )
    assert not batch_grammars[1][1].active and batch_grammars[2][1].active
    assert any(g.is_terminated for _, g in batch_grammars)  # a stop token completed some
    assert (
        BitmaskFiller(len(VOCAB), threads=2).fill([(r, g) for r, g in batch_grammars if g.needs_mask]).bitmask
        == BitmaskFiller(len(VOCAB), batch=False)
        .fill([(r, g) for r, g in loop_grammars if g.needs_mask])
        .bitmask
    )


class _Broken:
    """A matcher whose fill fails (and that xgrammar's batch call cannot take either)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill_next_token_bitmask(self, bitmask, row) -> bool:
        raise RuntimeError("boom")

    def __getattr__(self, name: str):
        if name == "_handle":
            raise AttributeError(name)
        return getattr(self._matcher, name)


@pytest.mark.parametrize("with_drafts", [False, True])
def test_a_failing_fill_ends_only_its_request(compiled, with_drafts):
    starts = _starts()[:6]
    grammars, reference = _grammars(compiled, starts), _grammars(compiled, starts)
    grammars[2][1].matcher = _Broken(grammars[2][1].matcher)
    drafts = _drafts(grammars, starts) if with_drafts else None
    output = BitmaskFiller(len(VOCAB), threads=2).fill(grammars, drafts)
    expected = BitmaskFiller(len(VOCAB), batch=False).fill(reference, drafts)
    rows = np.frombuffer(output.bitmask, dtype="<i4").reshape(-1, output.num_words)
    want = np.frombuffer(expected.bitmask, dtype="<i4").reshape(-1, output.num_words)
    broken_first = sum(expected.rows_per_request[:2])
    assert (rows[broken_first] == -1).all()  # any token: it comes back to an erroring grammar
    others = [
        r for r in range(len(rows)) if not broken_first <= r < broken_first + expected.rows_per_request[2]
    ]
    assert (rows[others] == want[others]).all()
    assert [g.error is None for _, g in grammars] == [True, True, False, True, True, True]
    broken = grammars[2][1]
    assert "filling the token mask failed: RuntimeError: boom" in broken.error and not broken.needs_mask
    assert broken.accept([], 3) == broken.error  # its sampled token ends the request


def test_a_failing_accept_ends_only_its_request(compiled):
    class Raising(_Broken):
        def accept_token(self, token_id: int) -> bool:
            raise RuntimeError("internal")

    grammars = _grammars(compiled, [(TEXTS[0], 1), (TEXTS[0], 1), (TEXTS[1], 2)])
    grammars[0][1].matcher = Raising(grammars[0][1].matcher)
    closed = grammars[2][1]
    closed.active, closed.start_after = False, [5]
    verdicts = accept_batch([(g, [], VOCAB.index('"')) for _, g in grammars])
    assert "accepting token" in verdicts[0] and "RuntimeError: internal" in verdicts[0]
    assert grammars[0][1].error == verdicts[0] and not grammars[0][1].needs_mask
    assert verdicts[1] is None and grammars[1][1].num_accepted == 2  # its neighbour moved on
    assert verdicts[2] is None and closed.error is None and not closed.active


def test_fill_threads_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS", "3")
    assert fill_threads() == 3 and BitmaskFiller(64).threads == 3
    monkeypatch.setenv("TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS", "0")
    with pytest.raises(ValueError, match="TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS"):
        fill_threads()
    monkeypatch.delenv("TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS")
    assert fill_threads() >= 1
