"""Multi-token decodes (speculative verification: every request computes its last token and k
drafts) in the Triton decode launch, on the CPU under TRITON_INTERPRET=1, tiny shapes: against the
float64 reference, and against the prefill flavour that served them before (window, soft cap and
sinks included). See tests/unit/test_triton_attention.py for the interpreter set-up.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from tests.triton_interpreter import interpreted_run  # noqa: E402
from tests.unit.test_triton_attention import (  # noqa: E402
    TOLERANCE,
    _interpreter_takes_tensor_loop_bounds,
    make_batch,
    naive_attention,
    naive_store,
    relative_error,
)
from tokenmill.attention.backend import AttentionLayerSpec  # noqa: E402
from tokenmill.attention.triton_paged import TritonPagedBackend  # noqa: E402
from tokenmill.kernels.triton import paged_attention as pa  # noqa: E402
from tokenmill.kernels.triton.kv_store import store_kv  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__)  # run by the subprocess test below

interpreted = pytest.mark.skipif(
    not _interpreter_takes_tensor_loop_bounds(),
    reason="needs the Triton CPU interpreter with tensor loop bounds (the subprocess test runs these)",
)


def _backend(q, num_kv_heads, block_size, **kwargs) -> TritonPagedBackend:
    return TritonPagedBackend(q.shape[1], num_kv_heads, q.shape[2], q.shape[2] ** -0.5, block_size, **kwargs)


def _launched_decode_tiles(monkeypatch) -> list[pa.TileConfig]:
    """Record the (decode flag, tiles) of every attention launch, still running it."""
    launched = []
    original = pa._Launch.attention

    def record(self, config, num_q_programs, decode, num_kv_splits, *args, **kwargs):
        launched.append((decode, config))
        return original(self, config, num_q_programs, decode, num_kv_splits, *args, **kwargs)

    monkeypatch.setattr(pa._Launch, "attention", record)
    return launched


@interpreted
@pytest.mark.parametrize("num_kv_splits", [1, 2, 3])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype"),
    [(8, 2, torch.float32), (8, 2, torch.bfloat16), (3, 1, torch.float32)],  # GQA 4, and a group of 3
)
def test_multi_token_decode_matches_naive_in_one_decode_launch(
    num_kv_splits: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, monkeypatch
) -> None:
    # Query lengths 1..4 (block 4), contexts crossing block and tile edges, one empty context;
    # two padding rows (slot -1) as in a padded CUDA graph.
    block_size = 4
    q, k, v, kv_cache, meta = make_batch(
        [3, 1, 4, 2], [37, 70, 0, 5], num_heads, num_kv_heads, 64, block_size, dtype, num_padding_tokens=2
    )
    meta.multi_token_decode = True
    launched = _launched_decode_tiles(monkeypatch)
    backend = _backend(q, num_kv_heads, block_size, num_kv_splits=num_kv_splits)
    cache = kv_cache.clone()
    out = backend.forward(q, k, v, cache, meta)
    assert [(decode, config.block_q) for decode, config in launched] == [(True, 4)]  # no prefill launch
    assert torch.equal(cache, naive_store(k, v, kv_cache, meta.slot_mapping))
    n = meta.num_actual_tokens
    expected = naive_attention(q, cache, meta, 64**-0.5)
    assert relative_error(out[:n], expected[:n]) < TOLERANCE[dtype]


@interpreted
def test_split_multi_token_decode_equals_unsplit_and_the_prefill_flavour() -> None:
    block_size, num_kv_heads = 8, 2
    q, k, v, kv_cache, meta = make_batch([8, 5, 2], [90, 7, 33], 4, num_kv_heads, 32, block_size, torch.float32)
    results = {}
    for multi, splits in [(False, 1), (True, 1), (True, 4), (True, 8)]:
        meta.multi_token_decode = multi
        cache = kv_cache.clone()
        results[multi, splits] = _backend(q, num_kv_heads, block_size, num_kv_splits=splits).forward(
            q, k, v, cache, meta
        )
    prefill_flavour = results[False, 1]
    for key, out in results.items():
        assert relative_error(out, prefill_flavour) < 1e-6, key
    assert relative_error(prefill_flavour, naive_attention(q, cache, meta, 32**-0.5)) < TOLERANCE[torch.float32]


@interpreted
@pytest.mark.parametrize("window", [3, 6, None])
def test_window_soft_cap_and_sinks_as_the_prefill_flavour(window: int | None) -> None:
    # Windows shorter than the query run (3 < 5 tokens) and than the context; split over tiles.
    block_size, num_heads, num_kv_heads = 4, 4, 2
    q, k, v, kv_cache, meta = make_batch([5, 2, 1], [21, 9, 40], num_heads, num_kv_heads, 16, block_size, torch.float32)
    layer = AttentionLayerSpec(
        sliding_window=window, logits_soft_cap=5.0, sinks=torch.linspace(-1.0, 1.0, num_heads)
    )
    outs = []
    for multi in (False, True):
        meta.multi_token_decode = multi
        backend = _backend(q, num_kv_heads, block_size, num_kv_splits=3)
        outs.append(backend.forward(q, k, v, kv_cache.clone(), meta, layer=layer))
    assert relative_error(outs[1], outs[0]) < 1e-6


@interpreted
@pytest.mark.parametrize("fused_merge", [False, True])
def test_every_real_row_is_written_and_counters_reset(fused_merge: bool) -> None:
    block_size, num_kv_heads, head_dim, splits = 4, 1, 16, 3
    q, k, v, kv_cache, meta = make_batch([2, 2, 1], [6, 0, 30], 2, num_kv_heads, head_dim, block_size, torch.float32)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    rows = meta.num_reqs * 2  # decode_query_len 2: a partial row per query token
    partial_out = torch.full((rows, q.shape[1], splits, head_dim), float("nan"))
    partial_lse = torch.full((rows, q.shape[1], splits), float("nan"))
    counters = torch.zeros(meta.num_reqs * num_kv_heads, dtype=torch.int32) if fused_merge else None
    expected = naive_attention(q, kv_cache, meta, head_dim**-0.5)
    for _ in range(2):  # the second call reuses the counters the first one reset
        out = torch.full_like(q, float("nan"))
        pa.paged_attention(
            out, q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            num_reqs=meta.num_reqs, max_query_len=2, decode_only=False, scale=head_dim**-0.5,
            num_kv_splits=splits, partial_out=partial_out, partial_lse=partial_lse, split_counters=counters,
            decode_query_len=2,
        )  # fmt: skip
        assert relative_error(out, expected) < TOLERANCE[torch.float32]
        if counters is not None:
            assert counters.eq(0).all()


def test_refuses_what_the_decode_launch_cannot_serve() -> None:
    q = torch.zeros(4, 2, 16)
    cache = torch.zeros(2, 2, 4, 1, 16)
    tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    common = dict(num_reqs=2, max_query_len=2, decode_only=False, scale=1.0)
    with pytest.raises(ValueError, match="decode_query_len must be 1, 2, 4 or 8, got 3"):
        pa.paged_attention(torch.empty_like(q), q, cache, tables, lens, qsl, **common, decode_query_len=3)
    small = torch.zeros(2, 2, 2, 16), torch.zeros(2, 2, 2)  # rows for 2 requests, not 2 x 2 tokens
    with pytest.raises(ValueError, match="need 4 rows"):
        pa.paged_attention(
            torch.empty_like(q), q, cache, tables, lens, qsl, **common, num_kv_splits=2,
            partial_out=small[0], partial_lse=small[1], decode_query_len=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="one row per request"):
        pa.paged_attention(
            torch.empty_like(q), q, cache, tables, lens, qsl, **{**common, "decode_only": True}, decode_query_len=2
        )


def test_decode_query_block_and_tiles() -> None:
    assert [pa.decode_query_block(n) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 1]
    # GQA 4 (Llama-3.1-8B): up to 4 query tokens fit the 16 rows a single-token decode already uses.
    assert pa.decode_tile_config(4, 128, 8, query_len=4).block_m == 16
    assert pa.decode_tile_config(4, 128, 8, query_len=8).block_m == 32
    one, eight = pa.decode_tile_config(4, 128, 8), pa.decode_tile_config(4, 128, 8, query_len=8)
    assert (one.block_n, one.num_warps, one.num_stages) == (eight.block_n, eight.num_warps, eight.num_stages)


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the cases in the interpreter")
def test_cases_pass_in_an_interpreter_subprocess() -> None:
    INTERPRETED_RUN.assert_passes()
