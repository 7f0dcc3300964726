"""The host-memory KV tier, scheduler side: an LRU index of blocks copied out of the device pool.

When the device block pool hands out a cached block again (eviction), this connector copies its KV
to a host slot before the step overwrites it, indexed by the block's prefix-cache key (the chained
token hash, which carries the LoRA adapter and cache salt, so a host hit is exactly as safe as a
device one) and checked against the block's token ids on a hit. A later request whose prefix runs
past the device cache's hit into blocks held here gets them copied back into fresh device blocks
instead of recomputing them. The copies are the worker's (worker/kv_connector/host_tier.py); this
side decides them and says so in `HostTierMetadata`.

Host slots are assigned when the step's metadata is built, after every admission of the step: a
slot loaded this step is pinned, so a save in the same step never overwrites it, and when every
slot is pinned a save is dropped (counted) rather than waiting. The tier keeps copies: a block
loaded back stays in the host tier too.

The worker copies each run of consecutive host slots of a layer in one call, so a step's saves
take their slots together from the free runs (core/host_slot_runs.py: one run where one is long
enough), after the least recently used entries not pinned this step have been forgotten to make
room. A request's blocks, evicted together or in successive steps, so sit in one run (or a few),
and loading them back is a copy or a few per layer, whatever order the blocks come in.

One KV cache group only (models without sliding-window layers): a sliding group's hit needs the
blocks right before the hit point rather than a prefix, which this index does not model; such
models are refused when the tier is built.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.core.block_hash import extend_block_hashes
from tokenmill.core.host_slot_runs import FreeSlotRuns
from tokenmill.core.kv_connector import EvictedBlock, KVConnectorScheduler
from tokenmill.core.kv_connector_metadata import HostTierMetadata, KVConnectorMetadata
from tokenmill.core.request import Request


@dataclass(slots=True)
class _HostEntry:
    slot: int
    token_ids: tuple[int, ...]


class HostKVTier(KVConnectorScheduler):
    def __init__(self, num_host_blocks: int, block_size: int, bytes_per_block: int) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host KV tier needs at least 1 block, got {num_host_blocks}")
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        # key -> entry, least recently used first.
        self._entries: OrderedDict[bytes, _HostEntry] = OrderedDict()
        self._free = FreeSlotRuns(num_host_blocks)
        # This step's work, turned into metadata by build_connector_meta.
        self._pending_saves: list[EvictedBlock] = []
        self._loads: list[tuple[int, int]] = []  # (host slot, device block)
        self._pinned: set[int] = set()  # host slots this step reads or writes
        # Totals for /metrics.
        self.hit_tokens = 0
        self.blocks_stored = 0
        self.blocks_loaded = 0
        self.saves_dropped = 0

    # -- admission --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        if not self._entries:
            return 0
        block_size = self.block_size
        hashes = extend_block_hashes(request, block_size)
        tokens = request.all_token_ids
        max_blocks = (request.num_tokens - 1) // block_size
        first = num_local_hit_tokens // block_size
        index = first
        entries = self._entries
        while index < max_blocks:
            entry = entries.get(hashes[index])
            if entry is None or entry.token_ids != tuple(tokens[index * block_size : (index + 1) * block_size]):
                break
            index += 1
        return (index - first) * block_size

    def update_state_after_alloc(
        self, request: Request, first_block_index: int, device_block_ids: Sequence[int]
    ) -> None:
        hashes = request.block_hashes
        for offset, device_block in enumerate(device_block_ids):
            key = hashes[first_block_index + offset]
            entry = self._entries[key]  # offered by get_num_new_matched_tokens this step
            self._entries.move_to_end(key)
            self._loads.append((entry.slot, device_block))
            self._pinned.add(entry.slot)
        self.blocks_loaded += len(device_block_ids)
        self.hit_tokens += len(device_block_ids) * self.block_size

    # -- eviction and the step ----------------------------------------------------------------

    def on_blocks_evicted(self, evicted: Sequence[EvictedBlock]) -> None:
        self._pending_saves.extend(evicted)

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not self._pending_saves and not self._loads:
            return None
        meta = HostTierMetadata()
        entries = self._entries
        saves: list[EvictedBlock] = []
        keys: set[bytes] = set()
        for evicted in self._pending_saves:
            key = evicted[1]
            if key in entries:  # already held (loaded from here earlier): just fresher now
                entries.move_to_end(key)
            elif key not in keys:
                keys.add(key)
                saves.append(evicted)
        if len(saves) > self._free.num_free:
            self._forget_lru(len(saves) - self._free.num_free)
        slots = self._free.take(len(saves))
        self.saves_dropped += len(saves) - len(slots)  # every other slot is pinned this step
        for (device_block, key, token_ids), slot in zip(saves, slots, strict=False):
            entries[key] = _HostEntry(slot, token_ids)
            meta.save_device_blocks.append(device_block)
            meta.save_host_slots.append(slot)
        self.blocks_stored += len(meta.save_device_blocks)
        for slot, device_block in self._loads:
            meta.load_host_slots.append(slot)
            meta.load_device_blocks.append(device_block)
        self._pending_saves = []
        self._loads = []
        self._pinned = set()
        return None if meta.is_empty else meta

    def _forget_lru(self, count: int) -> None:
        """Forget up to `count` least recently used entries whose slots this step does not load,
        freeing their slots."""
        victims = []
        for key, entry in self._entries.items():
            if len(victims) == count:
                break
            if entry.slot not in self._pinned:
                victims.append(key)
        self._free.give(self._entries.pop(key).slot for key in victims)

    def step_failed(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, HostTierMetadata):
            return
        failed = set(metadata.save_host_slots)
        if not failed:
            return
        # Only slots still held are freed: a reset since (every slot free again) frees nothing twice.
        keys = [k for k, e in self._entries.items() if e.slot in failed]
        self._free.give(self._entries.pop(key).slot for key in keys)

    def reset(self) -> None:
        self._entries.clear()
        self._free = FreeSlotRuns(self.num_host_blocks)

    # -- stats and checks -------------------------------------------------------------------

    @property
    def num_stored_blocks(self) -> int:
        return len(self._entries)

    def get_stats(self) -> dict[str, float]:
        return {
            "kv_offload_hits": self.hit_tokens,
            "kv_offload_blocks_stored": self.blocks_stored,
            "kv_offload_blocks_loaded": self.blocks_loaded,
            "kv_offload_saves_dropped": self.saves_dropped,
            "kv_offload_bytes": len(self._entries) * self.bytes_per_block,
            "kv_offload_capacity_bytes": self.num_host_blocks * self.bytes_per_block,
        }

    def check_invariants(self) -> None:
        slots = [entry.slot for entry in self._entries.values()]
        self._free.check_invariants()
        free = self._free.slots()
        assert len(slots) == len(set(slots)), "two host-tier entries share a slot"
        assert not set(slots) & set(free), "a host slot is both held and free"
        assert len(slots) + len(free) == self.num_host_blocks, (
            f"{len(slots)} held + {len(free)} free host slots, but the tier has {self.num_host_blocks}"
        )
        assert all(0 <= s < self.num_host_blocks for s in slots), "a host slot is out of range"
        for entry in self._entries.values():
            assert len(entry.token_ids) == self.block_size, "a host-tier entry is not a full block"
        assert not self._pending_saves and not self._loads and not self._pinned, (
            "host-tier step state outlived its step (build_connector_meta not called)"
        )


def num_host_blocks(kv_offload_gb: float, bytes_per_block: int) -> int:
    """Host slots `kv_offload_gb` GiB holds (the scheduler and every worker compute the same)."""
    num = int(kv_offload_gb * 2**30) // bytes_per_block
    if num < 1:
        raise ValueError(
            f"kv_offload_gb={kv_offload_gb} holds no KV block of {bytes_per_block} bytes; give at least "
            f"{bytes_per_block / 2**30:.6f} (GiB), or 0 to turn the host tier off"
        )
    return num

