"""The host tier's worker side on the CPU (worker/kv_connector/host_tier.py): per-layer copies that
run when the forward reaches each layer, saves before loads, runs of consecutive host slots.

Each device block of each layer holds distinct numbers, so a copy to or from the wrong block, slot
or layer, or at the wrong time, shows."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.kv_connector_metadata import HostTierMetadata
from tokenmill.worker.kv_connector.host_tier import HostKVTierWorker, slot_runs

LAYERS, BLOCKS, HOST_SLOTS = 3, 6, 5
BLOCK_SHAPE = (2, 2, 3)  # block_size, kv heads, head_dim


def _pool() -> list[torch.Tensor]:
    """Per layer [2 (K, V), blocks, *BLOCK_SHAPE] float32, every element distinct across layers."""
    numel = 2 * BLOCKS * 12
    return [torch.arange(numel, dtype=torch.float32).view(2, BLOCKS, *BLOCK_SHAPE) + 1000 * i for i in range(LAYERS)]


def _worker(pool: list[torch.Tensor]) -> HostKVTierWorker:
    worker = HostKVTierWorker(pool, HOST_SLOTS)
    for host in worker.host_tensors:
        host.zero_()
    return worker


def _host_block(worker: HostKVTierWorker, layer: int, slot: int) -> torch.Tensor:
    """A host slot of one layer as the device block it holds ([2, *BLOCK_SHAPE] float32)."""
    return worker.host_tensors[layer][slot].view(torch.float32).view(2, *BLOCK_SHAPE)


def test_slot_runs_group_consecutive_slots_in_list_order() -> None:
    assert slot_runs([]) == []
    assert slot_runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
    assert slot_runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]  # descending slots are not one copy


def test_each_layer_copies_when_the_forward_reaches_it() -> None:
    pool = _pool()
    before = [t.clone() for t in pool]
    worker = _worker(pool)
    worker.start_load_kv(HostTierMetadata(save_device_blocks=[1, 2, 4], save_host_slots=[0, 1, 3]))
    assert all(not host.any() for host in worker.host_tensors), "a copy ran before its layer"
    worker.wait_for_layer_load(0)
    for block, slot in ((1, 0), (2, 1), (4, 3)):
        assert torch.equal(_host_block(worker, 0, slot), before[0][:, block])
    assert not worker.host_tensors[1].any() and not worker.host_tensors[2].any()
    worker.wait_for_layer_load(0)  # a second wait for the same layer copies nothing again
    worker.save_kv_layer(0)
    worker.wait_for_layer_load(1)
    worker.wait_for_load()  # layer 2, which the forward did not reach
    for layer in range(LAYERS):
        for block, slot in ((1, 0), (2, 1), (4, 3)):
            assert torch.equal(_host_block(worker, layer, slot), before[layer][:, block])
    assert (worker.layers_waited_in_forward, worker.layers_waited_at_once) == (2, 1)
    assert all(torch.equal(p, b) for p, b in zip(pool, before, strict=True)), "a save wrote the device pool"


def test_a_layer_saves_before_it_loads_and_scattered_slots_land_in_order() -> None:
    pool = _pool()
    before = [t.clone() for t in pool]
    worker = _worker(pool)
    worker.start_load_kv(HostTierMetadata(save_device_blocks=[0, 1, 2, 3], save_host_slots=[4, 0, 1, 2]))
    worker.wait_for_load()
    # Block 5 is evicted (saved to slot 3) and, in the same step, receives slot 2 (old block 3);
    # blocks 0 and 4 receive slots 0 and 4 (old blocks 1 and 0): three runs (0, 2, 4).
    worker.start_load_kv(
        HostTierMetadata(
            save_device_blocks=[5], save_host_slots=[3], load_host_slots=[2, 0, 4], load_device_blocks=[5, 0, 4]
        )
    )
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
        assert torch.equal(_host_block(worker, layer, 3), before[layer][:, 5]), "the load ran before the save"
        assert torch.equal(pool[layer][:, 5], before[layer][:, 3])
        assert torch.equal(pool[layer][:, 0], before[layer][:, 1])
        assert torch.equal(pool[layer][:, 4], before[layer][:, 0])
        for untouched in (1, 2, 3):
            assert torch.equal(pool[layer][:, untouched], before[layer][:, untouched])
        if layer + 1 < LAYERS:  # the next layer is still as it was
            assert torch.equal(pool[layer + 1][:, 5], before[layer + 1][:, 5])
    worker.wait_for_load()
    assert worker.layers_waited_at_once == LAYERS  # the first step's, none of the second's


def test_an_fp8_pool_round_trips_as_bytes() -> None:
    pool = [(torch.randn(2, BLOCKS, *BLOCK_SHAPE) * 10).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
    before = [t.view(torch.uint8).clone() for t in pool]
    worker = _worker(pool)
    worker.start_load_kv(HostTierMetadata(save_device_blocks=[2], save_host_slots=[0]))
    worker.wait_for_load()
    worker.start_load_kv(HostTierMetadata(load_host_slots=[0], load_device_blocks=[5]))
    worker.wait_for_load()
    for layer in range(LAYERS):
        assert torch.equal(pool[layer].view(torch.uint8)[:, 5], before[layer][:, 2])


def test_an_unnumbered_or_unknown_layer_is_refused_by_name() -> None:
    worker = _worker(_pool())
    worker.wait_for_layer_load(-1)  # no step in flight: nothing to wait for
    worker.start_load_kv(HostTierMetadata(save_device_blocks=[1], save_host_slots=[0]))
    for bad in (-1, LAYERS):
        with pytest.raises(IndexError, match=f"KV layer index {bad} out of range: the pool has {LAYERS}"):
            worker.wait_for_layer_load(bad)
    worker.wait_for_load()
    with pytest.raises(TypeError, match="the host KV tier got KVSendMetadata metadata"):
        from tokenmill.core.kv_connector_metadata import KVSendMetadata

        worker.start_load_kv(KVSendMetadata(device_blocks=[1]))


def test_blocks_listed_in_any_order_load_as_one_copy_per_run_and_layer() -> None:
    """A request evicted tail first has descending slots in block order: sorted by slot they are one
    run, so one host->device copy per layer (not one per block and layer), with each block's own KV."""
    pool = _pool()
    before = [t.clone() for t in pool]
    worker = _worker(pool)
    worker.start_load_kv(HostTierMetadata(save_device_blocks=[3, 2, 1, 0], save_host_slots=[1, 2, 3, 4]))
    worker.wait_for_load()
    assert (worker.save_calls, worker.block_layers_saved) == (LAYERS, 4 * LAYERS)  # one run: slots 1-4
    # Slots in block order 4, 3, 2, 1 (old blocks 0..3) into blocks 5, 4, 2, 1: one run per layer.
    worker.start_load_kv(HostTierMetadata(load_host_slots=[4, 3, 2, 1], load_device_blocks=[5, 4, 2, 1]))
    worker.wait_for_load()
    assert (worker.load_calls, worker.block_layers_loaded) == (LAYERS, 4 * LAYERS)
    for layer in range(LAYERS):
        for source, target in ((0, 5), (1, 4), (2, 2), (3, 1)):
            assert torch.equal(pool[layer][:, target], before[layer][:, source])
        for untouched in (0, 3):
            assert torch.equal(pool[layer][:, untouched], before[layer][:, untouched])
    # Scattered slots are the worst case: one copy per block and layer.
    worker.start_load_kv(HostTierMetadata(load_host_slots=[4, 2], load_device_blocks=[3, 0]))
    worker.wait_for_load()
    assert worker.load_calls == LAYERS + 2 * LAYERS
    for layer in range(LAYERS):
        assert torch.equal(pool[layer][:, 3], before[layer][:, 0])  # slot 4: old block 0
        assert torch.equal(pool[layer][:, 0], before[layer][:, 2])  # slot 2: old block 2
