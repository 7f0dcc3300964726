"""Speculative verification shapes on the GPU: CUDA graphs keyed (padded batch, q) for steps where
every request computes q = 1 + k tokens at decode positions, and the attention kernel's
multi-token decode launch at Llama-3.1-8B attention shapes."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM
from tokenmill.bench.decode_steps import uniform_decode_step
from tokenmill.worker.batch_inputs import build_host_batch
from tokenmill.worker.cuda_graphs import CudaGraphRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"),
]


def _runner_with_verify_graphs(path, dtype: str, spec_tokens_per_request: tuple[int, ...]):
    # enforce_eager: the engine captures no graphs of its own, so these are the attention backend's
    # first (a second capture must keep the first's scratch limits, and q > 1 raises them).
    llm = LLM(
        str(path), device="cuda", dtype=dtype, max_model_len=256, num_kv_blocks=256, max_num_seqs=8,
        enable_prefix_caching=False, enforce_eager=True,
    )  # fmt: skip
    runner = llm.engine.runner
    for cache in runner.kv_cache_tensors:  # random (finite) contexts
        cache.normal_()
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, runner.buffers, runner.kv_caches, 8,
        spec_tokens_per_request=spec_tokens_per_request,
    )  # fmt: skip
    graphs.capture()
    runner.graph_runner = graphs
    return llm, runner, graphs


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all()
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_verify_graph_logits_equal_the_eager_step_row_for_row(tiny_llama_dir, dtype, tolerance):
    llm, runner, graphs = _runner_with_verify_graphs(tiny_llama_dir, dtype, (1, 3))
    assert (4, 3) in graphs.graphs and graphs.capture_stats[3]["graphs"] == len(graphs.sizes_by_q[3])
    num_reqs, q, context = 3, 3, 37  # 3 requests pad to the graph of 4
    first, _ = uniform_decode_step(num_reqs, q, context, runner.block_size, runner.arch.vocab_size, seed=7)
    requests = runner.requests.update(first)
    starts = first.batch_num_computed_tokens()
    key = runner._graph_key(first, requests, starts)
    assert key == (4, 3)
    # The replay branch's inputs, then every row's logits from the graph.
    batch = build_host_batch(requests, starts, [q] * num_reqs, runner.block_size, runner.max_blocks_per_req)
    runner.build_metadata(batch, padded_reqs=4, padded_tokens=4 * q)
    replays = graphs.num_replays
    graph_logits = graphs.replay(key, num_reqs * q).clone()
    assert graphs.num_replays == replays + 1 and graph_logits.shape == (num_reqs * q, runner.arch.vocab_size)
    # The same rows eagerly (a mixed batch: the prefill flavour of the attention, no graph).
    eager_batch = build_host_batch(requests, starts, [q] * num_reqs, runner.block_size)
    ids, positions, meta = runner.build_metadata(eager_batch)
    assert not meta.multi_token_decode
    eager_logits = runner.model.compute_logits(runner.model(ids, positions, runner.kv_caches, meta))
    assert _relative_error(graph_logits, eager_logits) < tolerance
    for i in range(num_reqs * q):  # row for row, not only on the whole
        assert _relative_error(graph_logits[i], eager_logits[i]) < 10 * tolerance, i


def test_verify_step_through_execute_samples_each_request_last_row(tiny_llama_dir):
    llm, runner, graphs = _runner_with_verify_graphs(tiny_llama_dir, "float32", (1, 4))
    num_reqs, q, context = 5, 4, 50  # pads to 8
    first, _ = uniform_decode_step(num_reqs, q, context, runner.block_size, runner.arch.vocab_size, seed=3)
    # Reference: the eager step's logits of every request's last row.
    requests = runner.requests.update(first)
    starts = first.batch_num_computed_tokens()
    eager_batch = build_host_batch(requests, starts, [q] * num_reqs, runner.block_size)
    ids, positions, meta = runner.build_metadata(eager_batch)
    hidden = runner.model(ids, positions, runner.kv_caches, meta)
    expected = runner.model.compute_logits(hidden).view(num_reqs, q, -1)[:, -1].argmax(-1).tolist()
    replays = graphs.num_replays
    out = runner.execute(first)  # new states again: the same histories
    assert graphs.num_replays == replays + 1 and out.cuda_graph_size == 8
    assert out.req_ids == list(first.num_scheduled_tokens)
    assert out.sampled_token_ids == [[t] for t in expected]


def test_padded_verify_rows_write_no_kv_slot(tiny_llama_dir):
    llm, runner, graphs = _runner_with_verify_graphs(tiny_llama_dir, "float32", (1, 2))
    before = [cache.clone() for cache in runner.kv_caches]
    num_reqs, q, context = 3, 2, 20
    first, _ = uniform_decode_step(num_reqs, q, context, runner.block_size, runner.arch.vocab_size, seed=5)
    replays = graphs.num_replays
    runner.execute(first)
    assert graphs.num_replays == replays + 1
    changed = torch.zeros(runner.kv_caches[0].shape[1:3], dtype=torch.bool, device="cuda")
    for cache, old in zip(runner.kv_caches, before, strict=True):
        changed |= (cache != old).flatten(3).any(dim=-1).any(dim=0)
    written = {(int(b), int(s)) for b, s in changed.nonzero().tolist()}
    expected = set()
    for new in first.scheduled_new_reqs:
        for position in range(context, context + q):
            expected.add((new.block_ids[0][position // runner.block_size], position % runner.block_size))
    assert written == expected  # the real rows' own slots, nothing for the padding request


def test_multi_token_decode_launch_matches_the_prefill_flavour_at_llama_8b_shapes():
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.triton_paged import TritonPagedBackend

    heads, kv_heads, dim, block = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, 1024, block, kv_heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    for num_reqs, q, contexts in [(1, 2, [3000]), (5, 4, [700, 31, 1500, 2, 96]), (3, 8, [4000, 64, 257])]:
        seqs = [c + q for c in contexts]
        width = -(-max(seqs) // block)
        tables = torch.randperm(1024, device="cuda", generator=gen)[: num_reqs * width].view(num_reqs, width)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * q
        lens = torch.tensor(seqs, dtype=torch.int32)
        qt = torch.randn(num_reqs * q, heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
        outs = []
        for multi in (False, True):
            meta = AttentionMetadata(
                num_actual_tokens=num_reqs * q, num_reqs=num_reqs, max_query_len=q, max_seq_len=max(seqs),
                query_start_loc=qsl.cuda(), seq_lens=lens.cuda(), block_tables=tables.to(torch.int32),
                slot_mapping=torch.full((num_reqs * q,), -1, dtype=torch.long, device="cuda"),
                query_start_loc_cpu=qsl, seq_lens_cpu=lens, is_decode_only=False, multi_token_decode=multi,
            )  # fmt: skip
            backend = TritonPagedBackend(heads, kv_heads, dim, dim**-0.5, block)
            out = backend.forward(qt, qt[:, :kv_heads], qt[:, :kv_heads], cache, meta, kv_already_stored=True)
            outs.append(out.float())
        assert _relative_error(outs[1], outs[0]) < 1e-2, (num_reqs, q)
