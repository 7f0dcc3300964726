"""Piecewise CUDA graphs call a KV connector's per-layer hooks in the right places (the replay runs
only on GPUs; its loop is plain Python, checked here with stand-in graphs and backend): layer i's
copies are waited for before the piece that holds layer i's KV store, and its save hook follows its
attention."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.attention.backend import PLAIN_ATTENTION
from tokenmill.worker.piecewise_graphs import PiecewiseGraphs, _AttentionCall, _Captured

NUM_LAYERS, SIZE, TOKENS = 3, 16, 5


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def wait_for_layer_load(self, layer_index: int) -> None:
        self.events.append(f"wait {layer_index}")

    def save_kv_layer(self, layer_index: int) -> None:
        self.events.append(f"save {layer_index}")


class _Piece:
    def __init__(self, index: int, recorder: _Recorder) -> None:
        self.index, self.recorder = index, recorder

    def replay(self) -> None:
        self.recorder.events.append(f"piece {self.index}")


def _pieces(recorder: _Recorder) -> PiecewiseGraphs:
    graphs = object.__new__(PiecewiseGraphs)  # no GPU: only what run() reads
    caches = [torch.zeros(1) for _ in range(NUM_LAYERS)]

    def forward(q, k, v, kv_cache, meta, *, kv_already_stored, layer):  # noqa: ANN001, ANN202
        recorder.events.append(f"attention {next(i for i, c in enumerate(caches) if c is kv_cache)}")
        return torch.zeros_like(q)

    graphs.attn_backend = SimpleNamespace(forward=forward)
    graphs.q, graphs.k, graphs.v, graphs.out = (torch.zeros(SIZE, 2, 4) for _ in range(4))
    graphs.num_replays = 0
    graphs.captured = {
        SIZE: _Captured(
            graphs=[_Piece(i, recorder) for i in range(NUM_LAYERS + 1)],  # type: ignore[misc]
            calls=[_AttentionCall(cache, 0, True, PLAIN_ATTENTION) for cache in caches],
            hidden=torch.zeros(SIZE, 8),
        )
    }
    return graphs


def test_each_layer_waits_before_the_piece_with_its_kv_store_and_saves_after_its_attention() -> None:
    recorder = _Recorder()
    _pieces(recorder).run(SIZE, TOKENS, SimpleNamespace(kv_layer_hooks=recorder, kv_group_siblings=()))
    expected = []
    for i in range(NUM_LAYERS):
        expected += [f"wait {i}", f"piece {i}", f"attention {i}", f"save {i}"]
    assert recorder.events == [*expected, f"piece {NUM_LAYERS}"]


def test_a_step_without_a_connector_calls_no_hook() -> None:
    recorder = _Recorder()
    _pieces(recorder).run(SIZE, TOKENS, SimpleNamespace(kv_layer_hooks=None, kv_group_siblings=()))
    assert not [e for e in recorder.events if e.startswith(("wait", "save"))]
