"""The worker side of KV cache groups, on CPU: per-group block tables and slot mappings in the host
batch, the persistent buffers a CUDA graph reads (staged and padded per group), the captured
metadata's siblings viewing those buffers, scratch steps, the per-layer cache list, and each
attention layer picking its group's metadata."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.core.outputs import NewRequestData
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.batch_inputs import build_host_batch
from tokenmill.worker.cuda_graphs import CudaGraphRunner
from tokenmill.worker.input_buffers import InputBuffers
from tokenmill.worker.kv_cache import layer_kv_caches
from tokenmill.worker.request_state import RequestState
from tokenmill.worker.scratch_step import scratch_step

BLOCK = 4


def _state(request_id: str, num_tokens: int, block_ids: list[list[int]]) -> RequestState:
    return RequestState(
        NewRequestData(request_id, list(range(num_tokens)), SamplingParams(), (), block_ids, 0)
    )


def test_host_batch_has_a_block_table_and_slot_mapping_per_group() -> None:
    # Request a: 6 tokens computed, 2 new (positions 6, 7); the sliding group's block 0 slid out.
    a = _state("a", 8, [[10, 11], [0, 21]])
    b = _state("b", 3, [[12], [22]])  # a 3-token prefill
    batch = build_host_batch([a, b], [6, 0], [2, 3], BLOCK)
    assert batch.block_tables.tolist() == [[10, 11], [12, 0]]
    assert [t.tolist() for t in batch.extra_block_tables] == [[[0, 21], [22, 0]]]
    assert batch.slot_mapping.tolist() == [11 * 4 + 2, 11 * 4 + 3, 48, 49, 50]
    assert [s.tolist() for s in batch.extra_slot_mappings] == [[21 * 4 + 2, 21 * 4 + 3, 88, 89, 90]]
    one_group = build_host_batch([_state("c", 3, [[5]])], [0], [3], BLOCK)
    assert one_group.extra_block_tables == [] and one_group.extra_slot_mappings == []


def test_diffs_extend_every_group_table() -> None:
    from tokenmill.core.outputs import CachedRequestData, SchedulerOutput
    from tokenmill.worker.request_state import RequestStates

    states = RequestStates()
    new = NewRequestData("a", [1, 2, 3, 4], SamplingParams(), (), [[7], [8]], 0)
    states.update(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"a": 4}))
    cached = CachedRequestData(request_ids=["a"], num_computed_tokens=[4], new_block_ids={"a": [[9], [10]]})
    states.update(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 1}))
    assert states["a"].block_ids == [[7, 9], [8, 10]]


def test_buffers_stage_each_group_padded_like_group_zero() -> None:
    buffers = InputBuffers(8, 4, 3, torch.device("cpu"), num_kv_groups=3)
    assert len(buffers.group_block_tables) == len(buffers.group_slot_mapping) == 2
    tables, slots = buffers.stage_kv_group(
        2, np.array([9, 13], np.int64), np.array([[2, 3, 0], [3, 0, 0]], np.int32), 4, 4
    )
    assert slots.tolist() == [9, 13, -1, -1]  # padding rows write nowhere
    assert tables.tolist() == [[2, 3, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert slots.data_ptr() == buffers.group_slot_mapping[1].data_ptr()  # in the persistent buffer
    assert tables.data_ptr() == buffers.group_block_tables[1].data_ptr()


def test_captured_metadata_siblings_view_the_group_buffers() -> None:
    buffers = InputBuffers(8, 4, 3, torch.device("cpu"), num_kv_groups=2)
    graphs = object.__new__(CudaGraphRunner)  # the metadata only, without a model or a capture
    graphs.buffers = buffers
    graphs.attn_backend = type("Backend", (), {"block_size": BLOCK})()
    meta = graphs._meta(2, 1)
    sibling = meta.for_kv_group(1)
    assert meta.for_kv_group(0) is meta and sibling.kv_group_siblings == ()
    assert sibling.block_tables.shape == (2, 3)
    assert sibling.block_tables.data_ptr() == buffers.group_block_tables[0].data_ptr()
    assert sibling.slot_mapping.data_ptr() == buffers.group_slot_mapping[0].data_ptr()
    assert sibling.seq_lens is meta.seq_lens and sibling.query_start_loc is meta.query_start_loc
    # A replay refills the buffers; the captured sibling reads the new tables.
    buffers.stage_kv_group(1, np.array([5], np.int64), np.array([[1, 2, 0]], np.int32), 2, 2)
    assert sibling.block_tables.tolist() == [[1, 2, 0], [0, 0, 0]]


def test_scratch_steps_give_every_group_the_scratch_tables() -> None:
    _, meta = scratch_step([2, 1], [2, 3], 1, torch.device("cpu"), False, num_kv_groups=3)
    assert len(meta.kv_group_siblings) == 2
    for group in (1, 2):
        assert meta.for_kv_group(group).block_tables is meta.block_tables


def test_layers_of_different_groups_share_the_pool_tensors() -> None:
    plan = plan_kv_cache_groups(4, (8, None, 8, None))  # two groups of two layers
    tensors = [torch.zeros(1), torch.zeros(1)]
    caches = layer_kv_caches(tensors, plan)
    assert [c is tensors[0] for c in caches] == [True, True, False, False]
    assert plan.layer_group == (1, 0, 1, 0)


def test_an_attention_layer_attends_with_its_groups_metadata() -> None:
    from tokenmill.attention.backend import AttentionBackend
    from tokenmill.model.arch import ArchConfig
    from tokenmill.model.layers.attention import SelfAttention
    from tokenmill.model.layers.layer_ops import select_layer_ops

    class Recording(AttentionBackend):
        name = "recording"

        def forward(self, q, k, v, kv_cache, meta, *, kv_already_stored=False, layer=None):  # noqa: ANN001, ANN201
            self.seen = meta
            return torch.zeros_like(q)

    arch = ArchConfig("llama", 32, 16, 32, 1, 2, 2, 8, 1e-6, 10000.0)
    backend = Recording(2, 2, 8, 8**-0.5, BLOCK)
    ops = select_layer_ops("cpu")
    attn = SelfAttention(arch, backend, ops, dtype=torch.float32)
    for p in attn.parameters():
        torch.nn.init.normal_(p)
    positions = torch.arange(2)
    from tokenmill.model.layers.rotary import RotaryEmbedding

    rope = ops.rope_inputs(RotaryEmbedding(8, 16, 10000.0, None, dtype=torch.float32), positions)
    meta = AttentionMetadata(
        2, 1, 2, 2, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1]), torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32), False,
    )  # fmt: skip
    meta.with_kv_groups([(torch.ones(1, 1, dtype=torch.int32), torch.tensor([4, 5]))])
    cache = torch.zeros(2, 2, BLOCK, 2, 8)
    attn(torch.randn(2, 16), rope, cache, meta, False)
    assert backend.seen is meta
    attn.kv_group = 1
    attn(torch.randn(2, 16), rope, cache, meta, False)
    assert backend.seen is meta.kv_group_siblings[0]
