"""The device-side grammar mask: host rows land on their requests' logits rows, other rows stay."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.outputs import GrammarOutput
from tokenmill.sample.grammar_mask import GrammarMasker


def _rows(allowed: list[list[int]], vocab: int) -> tuple[bytes, int]:
    words = -(-vocab // 32)
    bitmask = np.zeros((len(allowed), words), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[row, t // 32] |= np.uint32(1 << (t % 32))
    return bitmask.view(np.int32).astype("<i4").tobytes(), words


def test_mask_rows_go_to_their_requests_and_leave_the_others_alone():
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(4, vocab)
    before = logits.clone()
    data, words = _rows([[1, 69], [5], [40, 41]], vocab)
    grammar = GrammarOutput(request_ids=["b", "d"], rows_per_request=[1, 2], num_words=words, bitmask=data)
    # "d" has two rows (a draft token's and the bonus token's): rows 2 and 3.
    GrammarMasker(torch.device("cpu")).apply(logits, grammar, {"a": 0, "b": 1, "d": 2})
    assert torch.equal(logits[0], before[0])
    for row, allowed in ((1, {1, 69}), (2, {5}), (3, {40, 41})):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed
        assert torch.equal(logits[row, sorted(allowed)], before[row, sorted(allowed)])


def test_logits_past_the_grammar_vocabulary_are_masked_in_constrained_rows_only():
    # A model whose logits (200) outnumber its tokenizer's vocabulary (70): grammar rows cover 70.
    logits = torch.randn(2, 200)
    before = logits.clone()
    data, words = _rows([[3, 69]], 70)
    grammar = GrammarOutput(request_ids=["c"], rows_per_request=[1], num_words=words, bitmask=data)
    GrammarMasker(torch.device("cpu")).apply(logits, grammar, {"p": 0, "c": 1})
    assert torch.equal(logits[0], before[0])
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == {3, 69}


def test_cpu_numpy_path_equals_xgrammars_kernel_on_random_rows():
    import xgrammar as xgr

    rng = np.random.default_rng(0)
    vocab, words = 1000, -(-900 // 32)  # grammar rows cover 928 tokens of 1000
    packed = rng.integers(-(2**31), 2**31 - 1, size=(5, words), dtype=np.int64).astype("<i4")
    packed[1] = 0  # a row allowing nothing
    grammar = GrammarOutput(
        request_ids=["a", "b", "c"], rows_per_request=[1, 3, 1], num_words=words, bitmask=packed.tobytes()
    )
    row_of = {"a": 6, "b": 0, "c": 4}  # not in batch order; row 3 and 5 unconstrained
    logits = torch.randn(7, vocab)
    expected = logits.clone()
    bf16 = logits.to(torch.bfloat16)  # not float32: the host-buffer path the CUDA branch uses
    GrammarMasker(torch.device("cpu")).apply(logits, grammar, row_of)
    GrammarMasker(torch.device("cpu")).apply(bf16, grammar, row_of)
    assert torch.equal(torch.isfinite(bf16), torch.isfinite(logits))
    # The reference: xgrammar's kernel on the full-width rows the CUDA path builds.
    full = torch.full((7, -(-vocab // 32)), -1, dtype=torch.int32)
    for (request_id, count), src in zip((("a", 1), ("b", 3), ("c", 1)), (0, 1, 4), strict=True):
        full[row_of[request_id] : row_of[request_id] + count] = 0
        full[row_of[request_id] : row_of[request_id] + count, :words] = torch.from_numpy(packed[src : src + count])
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0]).all()  # "b"'s first row allows nothing
    assert torch.isfinite(logits[3]).all() and torch.isfinite(logits[5]).all()


def test_host_buffer_rows_in_order_out_of_order_and_all_rows():
    """The host-buffer path (bf16 here, as on CUDA) places rows by one index array: rows in batch
    order (the slice fast path), a permutation that starts at 0 and ends at the last row, and every
    logits row constrained (no all-allowed fill), each equal to the float32 numpy path."""
    rng = np.random.default_rng(1)
    vocab = 300
    words = -(-vocab // 32)
    for row_of, counts in (
        ({"a": 0, "b": 1, "c": 2}, [1, 1, 1]),  # in order, one unconstrained row after them
        ({"a": 0, "b": 2, "c": 1, "d": 3}, [1, 1, 1, 1]),  # starts at 0, ends at 3, not in order
        ({"a": 2, "b": 0}, [2, 2]),  # every row, two per request
    ):
        ids = list(row_of)
        packed = rng.integers(-(2**31), 2**31 - 1, size=(sum(counts), words), dtype=np.int64).astype("<i4")
        grammar = GrammarOutput(request_ids=ids, rows_per_request=counts, num_words=words, bitmask=packed.tobytes())
        logits = torch.randn(4, vocab)
        bf16 = logits.to(torch.bfloat16)
        GrammarMasker(torch.device("cpu")).apply(logits, grammar, row_of)
        GrammarMasker(torch.device("cpu")).apply(bf16, grammar, row_of)
        assert torch.equal(torch.isfinite(bf16), torch.isfinite(logits))
        assert not torch.isfinite(logits).all()
