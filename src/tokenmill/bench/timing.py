"""GPU timing for the microbenchmarks in benchmarks/: CUDA events around calls or CUDA-graph replays.

One helper so that every script measures the same way: `warmup` untimed calls, then `rounds`
rounds of `reps` back-to-back calls, each round between two CUDA events; the result is the median
over rounds of (round time / reps), in milliseconds per call. The scripts keep the parameters they
had before sharing this (row_gemv / skinny_gemm: 1 round of 10 graph replays; decode_layer: 5
rounds of `reps`; attention: `reps` rounds of 1 after 3 warm-ups), so their figures stay comparable
with the ones in BENCHMARKS.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def cuda_ms(fn: Callable[[], object], *, reps: int = 1, rounds: int = 1, warmup: int = 0) -> float:
    """Milliseconds per call of fn on the current CUDA stream (median over rounds, see above).

    Without a warm-up the caller has run fn (and synchronized) itself: that is how the graph
    helpers below use it.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], *, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """fn captured as one CUDA graph after `warmup` eager calls on a side stream (Triton compiles
    and autotunes, and allocations happen, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_ms(fn: Callable[[], object], *, reps: int, rounds: int = 1, warmup: int = 1) -> float:
    """Milliseconds per replay of fn captured as a CUDA graph: replayed once, then timed."""
    graph = capture_graph(fn, warmup=warmup)
    graph.replay()
    torch.cuda.synchronize()
    return cuda_ms(graph.replay, reps=reps, rounds=rounds)


def graph_ms(calls: Sequence[Callable[[], object]]) -> float:
    """Milliseconds per replay of one CUDA graph running `calls` in order (mean of 10 replays): the
    matmul microbenchmarks' unit, one graph of 32 matmuls over distinct weights."""

    def run_all() -> None:
        for call in calls:
            call()

    return graph_replay_ms(run_all, reps=10)
