"""CUDA graphs are looked up by (batch size, tokens per request); no GPU needed for the lookup."""

from __future__ import annotations

from tokenmill.worker.cuda_graphs import CudaGraphRunner, default_capture_sizes


def _runner(max_num_seqs: int) -> CudaGraphRunner:
    graphs = object.__new__(CudaGraphRunner)  # the lookup only, without buffers or a capture
    graphs.sizes = default_capture_sizes(max_num_seqs)
    graphs.tokens_per_req = 1
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
