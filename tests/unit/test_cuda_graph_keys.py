"""CUDA graphs are looked up by (batch size, tokens per request); no GPU needed for the lookup."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.core.outputs import SchedulerOutput
from tokenmill.worker.cuda_graphs import (
    CudaGraphRunner,
    capture_sizes_by_tokens_per_request,
)
from tokenmill.worker.model_runner import ModelRunner


def _runner(max_num_seqs: int, spec_tokens_per_request: tuple[int, ...] = (1,), max_num_tokens: int = 8192):
    graphs = object.__new__(CudaGraphRunner)  # the lookup only, without buffers or a capture
    graphs.sizes_by_q = capture_sizes_by_tokens_per_request(max_num_seqs, max_num_tokens, spec_tokens_per_request)
    graphs.sizes = graphs.sizes_by_q[1]
    return graphs


def test_one_token_per_request_pads_to_the_next_captured_batch_size() -> None:
    graphs = _runner(64)
    assert graphs.sizes == [1, 2, 4, 8, 16, 32, 48, 64]  # the capture sizes are as before
    assert graphs.graph_key(1, 1) == (1, 1)
    assert graphs.graph_key(3, 1) == (4, 1)
    assert graphs.graph_key(33, 1) == (48, 1)
    assert graphs.graph_key(64, 1) == (64, 1)
    assert graphs.graph_key(65, 1) is None  # more requests than any graph: eager


def test_multi_token_decode_has_no_graph_until_one_is_captured_for_it() -> None:
    graphs = _runner(64)
    assert graphs.graph_key(4, 2) is None
    assert graphs.graph_key(4, 4) is None


def test_verification_steps_take_graphs_keyed_by_padded_batch_and_query_length() -> None:
    graphs = _runner(64, (1, 4))
    assert graphs.graph_key(3, 4) == (4, 4)
    assert graphs.graph_key(33, 4) == (48, 4)
    assert graphs.graph_key(3, 1) == (4, 1)  # single-token decodes keep theirs
    assert graphs.graph_key(3, 2) is None and graphs.graph_key(3, 3) is None  # only q = 1 + k captured
    assert graphs.graph_key(65, 4) is None


def test_verification_graphs_fit_the_input_buffers() -> None:
    # 8 tokens per request: 48 * 8 = 384 rows fit a 400-row buffer, 64 * 8 do not.
    sizes = capture_sizes_by_tokens_per_request(64, 400, (1, 8))
    assert sizes[1] == [1, 2, 4, 8, 16, 32, 48, 64] and sizes[8] == [1, 2, 4, 8, 16, 32, 48]
    assert 8 not in capture_sizes_by_tokens_per_request(64, 4, (1, 8))  # not even one request fits


@pytest.mark.parametrize("q", [0, 9])
def test_query_lengths_outside_one_to_eight_are_refused(q: int) -> None:
    with pytest.raises(ValueError, match=f"spec_tokens_per_request holds {q}; each must be 1 \\+ k"):
        capture_sizes_by_tokens_per_request(64, 8192, (1, q))


def _step(tokens: list[int]) -> SchedulerOutput:
    scheduled = {f"r{i}": n for i, n in enumerate(tokens)}
    return SchedulerOutput(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(tokens))


def _graph_key(graphs, tokens: list[int], starts: list[int], prompt_len: int = 10):
    runner = SimpleNamespace(graph_runner=graphs)
    requests = [SimpleNamespace(num_prompt_tokens=prompt_len) for _ in tokens]
    return ModelRunner._graph_key(runner, _step(tokens), requests, starts)


def test_the_runner_picks_a_verification_graph_only_for_uniform_steps_past_the_prompts() -> None:
    graphs = _runner(64, (1, 3))
    assert _graph_key(graphs, [3, 3, 3], [20, 10, 40]) == (4, 3)
    assert _graph_key(graphs, [1, 1, 1], [20, 10, 40]) == (4, 1)
    assert _graph_key(graphs, [3, 3, 3], [20, 9, 40]) is None  # a request still in its prompt
    assert _graph_key(graphs, [2, 3, 4], [20, 10, 40]) is None  # 9 tokens, not 3 each
    assert _graph_key(graphs, [4, 4], [20, 10]) is None  # no graph for 4 per request
    assert _graph_key(_runner(64), [3, 3, 3], [20, 10, 40]) is None  # speculation off: q = 1 only
    assert _graph_key(None, [1], [20]) is None  # no graphs at all
