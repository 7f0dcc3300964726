"""One request's grammar state with a fake matcher: the start-after gate, a rejected token, and a
step where the grammar allows no token at all (the request errors; nothing hangs)."""

from __future__ import annotations

import numpy as np

from tokenmill.core.request import Request
from tokenmill.engine.structured_output import bitmask as bitmask_module
from tokenmill.engine.structured_output.bitmask import BitmaskFiller
from tokenmill.engine.structured_output.request_grammar import RequestGrammar
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


class FakeMatcher:
    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask: np.ndarray, row: int) -> bool:
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))
        return True


def _grammar(allowed: set[int], start_after: list[int]) -> tuple[RequestGrammar, Request]:
    so = StructuredOutputsParams(regex="x", start_after_token_ids=start_after)
    request = Request("r", [1, 2], SamplingParams(structured_outputs=so))
    grammar = RequestGrammar.__new__(RequestGrammar)
    grammar.matcher = FakeMatcher(allowed)
    grammar.start_after = list(start_after)
    grammar.active = not start_after
    grammar.error = None
    grammar.num_accepted = 0
    grammar.extra_mask = None
    grammar._terminated = False
    grammar._stop_token_ids = frozenset()
    return grammar, request


def _accept(grammar: RequestGrammar, request: Request, token: int) -> str | None:
    request.append_output_token_ids([token])
    return grammar.accept(request.output_token_ids, token)


def test_start_after_gate_opens_after_the_marker():
    grammar, request = _grammar({7}, start_after=[40, 41])
    for token in (5, 40, 9, 40):  # free text; a partial marker does not count
        assert not grammar.needs_mask
        assert _accept(grammar, request, token) is None
    assert _accept(grammar, request, 41) is None  # the marker is complete: the next token is constrained
    assert grammar.needs_mask and grammar.matcher.accepted == []
    assert _accept(grammar, request, 7) is None and grammar.matcher.accepted == [7]
    assert "does not allow token 8" in _accept(grammar, request, 8)
    assert not grammar.needs_mask


def test_a_step_with_no_allowed_token_errors_the_request():
    grammar, request = _grammar(set(), start_after=[])
    filler = BitmaskFiller(vocab_size=100)
    output = filler.fill([("r", grammar)])
    assert output.request_ids == ["r"] and len(output.bitmask) == 4 * filler.num_words
    assert grammar.error is not None and "allows no token" in grammar.error
    assert _accept(grammar, request, 3) == grammar.error  # the sampled token comes back: it ends


def test_filler_rows_and_growth(monkeypatch):
    monkeypatch.setattr(bitmask_module, "BATCH_FILL_MIN_ROWS", 1000)  # the fake matchers fill one by one
    grammars = []
    for i in range(20):
        grammar, _ = _grammar({i, 99}, start_after=[])
        grammars.append((f"r{i}", grammar))
    output = BitmaskFiller(vocab_size=100, initial_rows=4).fill(grammars)
    rows = np.frombuffer(output.bitmask, dtype="<i4").reshape(20, -1)
    assert output.rows_per_request == [1] * 20 and output.num_words == 4
    for i in range(20):
        assert rows[i, i // 32] & (1 << (i % 32))


def test_batch_fill_equals_row_by_row_fill_with_real_matchers(monkeypatch):
    import xgrammar as xgr

    vocab = [chr(c) for c in range(32, 127)] + ["ab", "12", '{"', "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgr.GrammarCompiler(info).compile_regex(r"(ab|[0-9]{2,4})x")
    request = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="x")))
    grammars = []
    for i, prefix in enumerate(["", "a", "ab", "1", "12", "123", "1234", "abx", "99", "5"] * 2):
        grammar = RequestGrammar(compiled, request)
        assert grammar.matcher.accept_string(prefix) or not prefix
        grammars.append((f"r{i}", grammar))
    batch = BitmaskFiller(len(vocab)).fill(grammars)
    monkeypatch.setattr(bitmask_module, "BATCH_FILL_MIN_ROWS", 1000)  # now one matcher call per row
    row_by_row = BitmaskFiller(len(vocab)).fill(grammars)
    assert batch.bitmask == row_by_row.bitmask


def test_a_json_row_loses_the_extra_masked_tokens_and_may_end_up_empty(monkeypatch):
    monkeypatch.setattr(bitmask_module, "BATCH_FILL_MIN_ROWS", 1000)  # the fake matchers fill one by one
    json_grammar, _ = _grammar({5, 40}, start_after=[])
    json_grammar.extra_mask = np.full(4, -1, dtype=np.int32)
    json_grammar.extra_mask[1] = 0  # tokens 32..63 forbidden
    only_forbidden, _ = _grammar({33}, start_after=[])
    only_forbidden.extra_mask = json_grammar.extra_mask
    plain, _ = _grammar({40}, start_after=[])
    output = BitmaskFiller(vocab_size=100).fill([("a", json_grammar), ("b", only_forbidden), ("c", plain)])
    rows = np.frombuffer(output.bitmask, dtype="<i4").reshape(3, -1)
    assert rows[0, 0] == 1 << 5 and rows[0, 1] == 0  # 40 masked out, 5 kept
    assert json_grammar.error is None
    assert only_forbidden.error is not None and "allows no token" in only_forbidden.error
    assert rows[2, 1] == 1 << 8 and plain.error is None  # a grammar without the extra mask keeps 40


def test_rows_that_share_one_extra_mask_are_all_restricted(monkeypatch):
    """A step of JSON requests only: every row ANDed with the one shared mask."""
    monkeypatch.setattr(bitmask_module, "BATCH_FILL_MIN_ROWS", 1000)
    mask = np.full(4, -1, dtype=np.int32)
    mask[1] = 0  # tokens 32..63 forbidden
    grammars = []
    for i, allowed in enumerate(({5, 40}, {33, 70}, {6})):
        grammar, _ = _grammar(allowed, start_after=[])
        grammar.extra_mask = mask
        grammars.append((f"r{i}", grammar))
    output = BitmaskFiller(vocab_size=100).fill(grammars)
    rows = np.frombuffer(output.bitmask, dtype="<i4").reshape(3, -1)
    assert rows[:, 1].tolist() == [0, 0, 0]
    assert rows[:, 0].tolist() == [1 << 5, 0, 1 << 6] and rows[1, 2] == 1 << 6  # 70 = 2 * 32 + 6
    assert [g.error is None for _, g in grammars] == [True, True, True]


def test_the_kept_terminated_state_follows_the_matcher():
    """`is_terminated` / `needs_mask` answer from the last accept (a stop token ends the grammar)
    without asking xgrammar: after every accept, and after a rejected token, they agree with it."""
    import xgrammar as xgr

    vocab = [chr(c) for c in range(32, 127)] + ["ab", "</s>"]
    stop = len(vocab) - 1
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[stop])
    compiled = xgr.GrammarCompiler(info).compile_regex(r"(ab|[0-9]{2,4})x")
    request = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="x")))
    early = RequestGrammar(compiled, request)
    assert early.accept([], stop) is not None  # a stop token before the grammar is complete
    assert not early.is_terminated and not early.matcher.is_terminated() and not early.needs_mask
    grammar = RequestGrammar(compiled, request)
    for token in (vocab.index("ab"), vocab.index("x"), stop):
        assert grammar.needs_mask
        assert grammar.accept([], token) is None
        assert grammar.is_terminated == grammar.matcher.is_terminated()
    assert grammar.is_terminated and not grammar.needs_mask
