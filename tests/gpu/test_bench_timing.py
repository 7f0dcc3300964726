"""The microbenchmarks' shared timing helper (tokenmill.bench.timing) on a real GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_eager_and_graph_timings_of_one_copy_agree() -> None:
    from tokenmill.bench.timing import cuda_ms, graph_ms, graph_replay_ms

    src = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    eager = cuda_ms(lambda: dst.copy_(src), reps=10, rounds=3, warmup=2)
    graphed = graph_replay_ms(lambda: dst.copy_(src), reps=10, rounds=3)
    per_copy = graph_ms([lambda: dst.copy_(src)] * 4) / 4
    assert eager > 0 and graphed > 0 and per_copy > 0
    # A 64 MiB copy is bandwidth-bound: launch paths differ by microseconds, not by 2x.
    assert 0.5 < graphed / eager < 2 and 0.5 < per_copy / eager < 2
