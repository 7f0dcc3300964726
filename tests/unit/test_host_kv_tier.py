"""The host-memory KV tier's scheduler side (torch-free) and its seam in the scheduler.

The scheduler tests reuse test_scheduler.py's fake runner, which writes a fingerprint of every
computed position into the slots the block tables name and checks that each request reads back
its own context: here it also executes the tier's saves and loads between its device slots and a
host dict, so a block loaded back with the wrong content (wrong slot, wrong order, a slot
overwritten before it was read) fails the read check.
"""

from __future__ import annotations

import random

import pytest

from tests.unit.test_scheduler import FakeRunner, Harness, make_request, reference_output
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.block_hash import extend_block_hashes
from tokenmill.core.host_kv_tier import HostKVTier, num_host_blocks
from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.core.kv_connector_metadata import HostTierMetadata
from tokenmill.core.outputs import SchedulerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, tokens: list[int], lora: LoRARequest | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), lora_request=lora)


def _evict(tier: HostKVTier, request: Request, device_blocks: list[int]) -> None:
    """Report the request's full blocks as evicted from these device blocks."""
    hashes = extend_block_hashes(request, BLOCK)
    tokens = request.all_token_ids
    tier.on_blocks_evicted(
        [(b, hashes[i], tuple(tokens[i * BLOCK : (i + 1) * BLOCK])) for i, b in enumerate(device_blocks)]
    )


def test_evicted_blocks_are_saved_and_offered_back_as_a_prefix() -> None:
    tier = HostKVTier(num_host_blocks=8, block_size=BLOCK, bytes_per_block=100)
    first = _request("a", list(range(1, 14)))  # 3 full blocks + 1 token
    _evict(tier, first, [5, 6, 7])
    meta = tier.build_connector_meta()
    assert isinstance(meta, HostTierMetadata)
    assert meta.save_device_blocks == [5, 6, 7] and len(set(meta.save_host_slots)) == 3
    assert not meta.load_host_slots
    again = _request("b", list(range(1, 14)))
    assert tier.get_num_new_matched_tokens(again, 0) == 12
    assert tier.get_num_new_matched_tokens(again, 4) == 8  # after a one-block device hit
    # Never the last token: a 12-token prompt can take at most 2 blocks.
    assert tier.get_num_new_matched_tokens(_request("c", list(range(1, 13))), 0) == 8
    tier.update_state_after_alloc(again, 1, [9, 10])
    meta = tier.build_connector_meta()
    assert meta is not None and meta.load_device_blocks == [9, 10]
    assert meta.load_host_slots == meta_slots_of(tier, again, [1, 2])
    stats = tier.get_stats()
    assert stats["kv_offload_hits"] == 8 and stats["kv_offload_blocks_stored"] == 3
    assert stats["kv_offload_blocks_loaded"] == 2 and stats["kv_offload_bytes"] == 300
    tier.check_invariants()


def meta_slots_of(tier: HostKVTier, request: Request, indices: list[int]) -> list[int]:
    return [tier._entries[request.block_hashes[i]].slot for i in indices]


def test_a_hit_needs_equal_tokens_and_equal_adapter() -> None:
    tier = HostKVTier(8, BLOCK, 1)
    _evict(tier, _request("a", list(range(1, 10))), [1, 2])
    tier.build_connector_meta()
    assert tier.get_num_new_matched_tokens(_request("b", [*range(1, 5), 99, 6, 7, 8, 9]), 0) == 4
    lora = LoRARequest("ad", 1, "/nowhere")
    assert tier.get_num_new_matched_tokens(_request("c", list(range(1, 10)), lora), 0) == 0
    # A corrupted index entry (a hash collision) is a miss, not wrong KV.
    request = _request("d", list(range(1, 10)))
    extend_block_hashes(request, BLOCK)
    tier._entries[request.block_hashes[0]].token_ids = (0, 0, 0, 0)
    assert tier.get_num_new_matched_tokens(request, 0) == 0


def test_lru_eviction_keeps_the_tier_bounded_and_spares_slots_the_step_loads() -> None:
    tier = HostKVTier(2, BLOCK, 10)
    old = _request("old", list(range(1, 10)))
    _evict(tier, old, [1, 2])
    tier.build_connector_meta()
    # The same step loads block 0 of `old` and evicts two more blocks: only one slot is not pinned.
    assert tier.get_num_new_matched_tokens(old, 0) == 8
    tier.update_state_after_alloc(old, 0, [3])  # loads slot of block 0 only
    loaded_slot = tier._entries[old.block_hashes[0]].slot
    _evict(tier, _request("new", list(range(50, 59))), [4, 5])
    meta = tier.build_connector_meta()
    assert meta is not None
    assert loaded_slot not in meta.save_host_slots
    assert len(meta.save_host_slots) == 1 and tier.saves_dropped == 1
    assert tier.num_stored_blocks == 2 and tier.get_stats()["kv_offload_bytes"] == 20
    tier.check_invariants()


def test_a_failed_step_forgets_what_it_would_have_saved() -> None:
    tier = HostKVTier(4, BLOCK, 1)
    request = _request("a", list(range(1, 10)))
    _evict(tier, request, [1, 2])
    meta = tier.build_connector_meta()
    assert meta is not None
    tier.step_failed(meta)
    assert tier.get_num_new_matched_tokens(request, 0) == 0
    tier.check_invariants()
    # A step that fails after a reset (every slot free again) frees nothing twice.
    _evict(tier, request, [1, 2])
    meta = tier.build_connector_meta()
    assert meta is not None
    tier.reset()
    tier.step_failed(meta)
    tier.check_invariants()
    assert tier._free.num_free == 4


def _slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """The runs the worker copies: its slots sorted, consecutive ones together."""
    from tokenmill.worker.kv_connector.host_tier import slot_runs

    return slot_runs(sorted(slots))


def test_a_request_evicted_tail_first_over_two_steps_reloads_as_one_run() -> None:
    """The device pool frees a request's blocks tail first: its slots descend in block order, and a
    request evicted over two steps sits in two adjacent ranges; loads sorted by slot are one copy."""
    tier = HostKVTier(num_host_blocks=16, block_size=BLOCK, bytes_per_block=1)
    request = _request("a", list(range(1, 26)))  # 6 full blocks
    extend_block_hashes(request, BLOCK)
    hashes, tokens = request.block_hashes, request.all_token_ids
    evicted = [(10 + i, hashes[i], tuple(tokens[i * BLOCK : (i + 1) * BLOCK])) for i in range(6)]
    tier.on_blocks_evicted(evicted[5:1:-1])  # blocks 5, 4, 3, 2
    first = tier.build_connector_meta()
    tier.on_blocks_evicted(evicted[1::-1])  # then 1, 0
    second = tier.build_connector_meta()
    assert first is not None and second is not None
    assert len(_slot_runs(first.save_host_slots)) == 1 and len(_slot_runs(second.save_host_slots)) == 1
    assert tier.get_num_new_matched_tokens(request, 0) == 24
    tier.update_state_after_alloc(request, 0, [20, 21, 22, 23, 24, 25])
    meta = tier.build_connector_meta()
    assert meta is not None
    assert meta.load_host_slots == meta_slots_of(tier, request, list(range(6)))
    assert meta.load_host_slots != sorted(meta.load_host_slots)  # listed in block order: not one run as is
    assert _slot_runs(meta.load_host_slots) == [(0, 0, 6)]  # one copy per layer
    tier.check_invariants()


def test_lru_eviction_of_part_of_a_run_splits_the_new_saves_over_two_runs() -> None:
    """A full tier forgets its least recently used entries to make room, here part of an earlier
    run: the new request's blocks land in the free tail and the slots taken back, two runs."""
    tier = HostKVTier(num_host_blocks=8, block_size=BLOCK, bytes_per_block=1)
    old = _request("old", list(range(1, 26)))  # 6 full blocks
    _evict(tier, old, list(range(10, 16)))  # head first: slots 0..5 hold blocks 0..5, block 0 the LRU
    tier.build_connector_meta()
    assert tier.get_num_new_matched_tokens(old, 0) == 24
    new = _request("new", list(range(50, 67)))  # 4 full blocks
    _evict(tier, new, [30, 31, 32, 33])
    meta = tier.build_connector_meta()
    assert meta is not None and len(meta.save_host_slots) == 4
    assert sorted(meta.save_host_slots) == [0, 1, 6, 7]
    assert len(_slot_runs(meta.save_host_slots)) == 2
    assert tier.get_num_new_matched_tokens(old, 0) == 0  # its first blocks were forgotten
    assert tier.num_stored_blocks == 8 and tier.saves_dropped == 0
    tier.check_invariants()


def test_tail_first_eviction_keeps_the_head_of_a_prefix_in_a_full_tier() -> None:
    """As the device pool evicts (tail first), the tail is the least recently used: a full tier
    forgets it first, and the head stays a hit."""
    tier = HostKVTier(num_host_blocks=6, block_size=BLOCK, bytes_per_block=1)
    old = _request("old", list(range(1, 26)))
    extend_block_hashes(old, BLOCK)
    hashes, tokens = old.block_hashes, old.all_token_ids
    tier.on_blocks_evicted([(10 + i, hashes[i], tuple(tokens[i * BLOCK : (i + 1) * BLOCK])) for i in range(5, -1, -1)])
    tier.build_connector_meta()
    _evict(tier, _request("new", list(range(50, 59))), [30, 31])  # needs two slots: old's tail goes
    meta = tier.build_connector_meta()
    assert meta is not None and len(_slot_runs(meta.save_host_slots)) == 1  # the tail's two slots, adjacent
    assert tier.get_num_new_matched_tokens(old, 0) == 16  # blocks 0..3 still there
    tier.check_invariants()


def test_random_steps_never_leak_a_slot_and_hand_out_runs() -> None:
    """Evictions, hits and failed steps at random against a small tier: every slot is held or free,
    each stored block reads back its own slot, and saves of a step with room in one free run are
    one run."""
    rng = random.Random(9)
    tier = HostKVTier(num_host_blocks=24, block_size=BLOCK, bytes_per_block=1)
    requests = [_request(f"r{i}", [rng.randrange(1, 97) for _ in range(4 * rng.randint(2, 9) + 1)]) for i in range(12)]
    for request in requests:
        extend_block_hashes(request, BLOCK)
    device_block = 0
    for _ in range(300):
        request = rng.choice(requests)
        hit = tier.get_num_new_matched_tokens(request, 0) // BLOCK
        if hit and rng.random() < 0.5:
            tier.update_state_after_alloc(request, 0, list(range(100, 100 + hit)))
        count = (request.num_tokens - 1) // BLOCK
        first = rng.randrange(count)
        tokens = request.all_token_ids
        evicted = [
            (device_block + i, request.block_hashes[i], tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
            for i in range(count - 1, first - 1, -1)
            if request.block_hashes[i] not in tier._entries
        ]
        device_block += count
        fits = any(end - start >= len(evicted) for start, end in tier._free.runs)
        tier.on_blocks_evicted(evicted)
        meta = tier.build_connector_meta()
        if meta is not None and fits:
            assert len(_slot_runs(meta.save_host_slots)) <= 1
        if meta is not None and rng.random() < 0.1:
            tier.step_failed(meta)
        tier.check_invariants()
    assert tier.num_stored_blocks > 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "2"])
def test_bad_kv_offload_gb_is_refused(bad: object) -> None:
    from tokenmill.args import EngineArgs

    with pytest.raises(ValueError, match="kv_offload_gb must be a finite number"):
        EngineArgs(model="x", kv_offload_gb=bad).create_engine_config(resolve_device=False)  # type: ignore[arg-type]


def test_kv_offload_gb_needs_prefix_caching_and_room_for_a_block() -> None:
    from tokenmill.args import EngineArgs

    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineArgs(model="x", kv_offload_gb=1, enable_prefix_caching=False).create_engine_config(
            resolve_device=False
        )
    with pytest.raises(ValueError, match="holds no KV block of 8192 bytes"):
        num_host_blocks(1e-9, 8192)
    assert num_host_blocks(1.0, 2**20) == 1024


def test_sliding_window_models_are_refused() -> None:
    groups = plan_kv_cache_groups(4, [None, 64, None, 64], 1024)
    with pytest.raises(ValueError, match="without sliding-window layers"):
        Scheduler(
            SchedulerConfig(8, 64, "fcfs", 256),
            CacheConfig(block_size=BLOCK),
            64,
            kv_cache_groups=groups,
            kv_connector=HostKVTier(8, BLOCK, 1),
        )


# -- the seam, end to end with the fake runner ----------------------------------------------------


class HostTierRunner(FakeRunner):
    """Executes the tier's copies on the fake device slots before the step, saves first."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.host: dict[int, list[tuple[int, int] | None]] = {}

    def execute(self, so: SchedulerOutput):  # noqa: ANN201 - ModelRunnerOutput
        meta = so.kv_connector_metadata
        if meta is not None:
            size = self.block_size
            for block, slot in zip(meta.save_device_blocks, meta.save_host_slots, strict=True):
                self.host[slot] = [self.slots.get(block * size + i) for i in range(size)]
            for slot, block in zip(meta.load_host_slots, meta.load_device_blocks, strict=True):
                for i, written in enumerate(self.host[slot]):
                    if written is None:
                        self.slots.pop(block * size + i, None)
                    else:
                        self.slots[block * size + i] = written
        return super().execute(so)


class HostTierHarness(Harness):
    def __init__(self, num_host_blocks: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.tier = HostKVTier(num_host_blocks, self.scheduler.kv.block_size, 1)
        self.scheduler = Scheduler(
            self.scheduler.config,
            CacheConfig(block_size=self.scheduler.kv.block_size),
            self.scheduler.kv.num_blocks,
            kv_connector=self.tier,
        )
        self.runner = HostTierRunner(self.scheduler)


@pytest.mark.parametrize("async_mode", [False, True])
def test_multi_turn_rehits_come_from_the_host_tier_with_the_right_kv(async_mode: bool) -> None:
    harness = HostTierHarness(64, num_blocks=16, block_size=4, max_num_batched_tokens=32, async_mode=async_mode)
    rng = random.Random(3)
    prompts = {f"c{i}": [rng.randrange(1, 97) for _ in range(20)] for i in range(6)}
    for turn in range(3):
        for conv, prompt in prompts.items():
            harness.add(make_request(f"{conv}-{turn}", prompt, max_tokens=3))
            harness.run()
            output = harness.tokens[f"{conv}-{turn}"]
            assert output == reference_output(prompt, 3, 256)
            prompts[conv] = prompt + output + [rng.randrange(1, 97) for _ in range(5)]
    stats = harness.scheduler.get_stats()
    assert stats["kv_offload_hits"] > 0 and stats["kv_offload_blocks_loaded"] > 0
    # Re-hits are reported as cached tokens, host ones included.
    later = [harness.finals[f"c{i}-2"].num_cached_tokens for i in range(6)]
    assert sum(later) >= stats["kv_offload_hits"] / 3
    harness.scheduler.check_invariants()  # every block free or evictable, the tier within bounds


def test_concurrent_requests_with_a_tiny_tier_stay_correct() -> None:
    """Many requests at once, a tier smaller than one step's evictions (saves dropped)."""
    harness = HostTierHarness(3, num_blocks=24, block_size=4, max_num_batched_tokens=24)
    rng = random.Random(5)
    shared = [rng.randrange(1, 97) for _ in range(12)]
    for round_ in range(3):
        for i in range(6):
            prompt = shared + [rng.randrange(1, 97) for _ in range(rng.randint(1, 14))]
            harness.add(make_request(f"r{round_}-{i}", prompt, max_tokens=4))
        harness.run()
    for request_id, request in harness.added.items():
        assert harness.tokens[request_id] == reference_output(request.prompt_token_ids, 4, 256)
    harness.scheduler.check_invariants()
    assert harness.tier.num_stored_blocks <= 3
