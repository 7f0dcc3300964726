"""The KV connector's scheduler side: KV that lives outside the device pool, as the scheduler sees it.

Modelled on vLLM's `KVConnectorBase_V1` (our own, smaller): a connector has a scheduler side
(here, torch-free, in the engine core) and a worker side (worker/kv_connector/, next to the KV
pool's tensors). The scheduler reaches it through one seam, `Scheduler.kv_connector` (None: no
connector, and not one call is made):

- admission: after the local prefix-cache lookup, `get_num_new_matched_tokens(request,
  num_local_hit_tokens)` says how many more prompt tokens, right after the local hit, the external
  store can provide; the scheduler allocates device blocks for them (they cost no token budget:
  they are loaded, not computed) and reports the allocation with `update_state_after_alloc`;
- eviction: the block pool reports each cached block it evicts to hand out again
  (`on_blocks_evicted`): a connector may save its KV before the step overwrites it;
- ending: `request_finished` is told of every request that ends (a disaggregated producer would
  send its blocks here);
- each step: `build_connector_meta()` returns what the workers must do before the step's forward
  (core/kv_connector_metadata.py), carried in `SchedulerOutput.kv_connector_metadata`.

The worker side executes that metadata: start the loads and saves, wait for a layer's loads before
the layer runs, save per layer, wait for saves at the end of a step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tokenmill.core.kv_cache_groups import KVCacheGroups
from tokenmill.core.kv_connector_metadata import KVConnectorMetadata
from tokenmill.core.request import Request

# A cached device block the pool hands out again: (block id, prefix-cache key, its token ids).
EvictedBlock = tuple[int, bytes, tuple[int, ...]]


class KVConnectorScheduler(ABC):
    """The scheduler side of a KV connector (one per engine core)."""

    # Whether requests may name a transfer (SamplingParams.kv_transfer_id); an engine whose
    # connector does not refuses such requests rather than ignore the field.
    accepts_transfer_ids = False

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        """Tokens after the first `num_local_hit_tokens` (a whole number of blocks the device prefix
        cache serves) that the connector can load, a multiple of the block size; never reaching the
        request's last token (its logits are needed). Must not change what it would answer for
        another request: the allocation may still fail."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, first_block_index: int, device_block_ids: Sequence[int]
    ) -> None:
        """The scheduler allocated `device_block_ids` for the request's blocks `first_block_index`,
        `first_block_index + 1`, ... that `get_num_new_matched_tokens` offered; the connector
        fills them before this step's forward."""

    def on_blocks_evicted(self, evicted: Sequence[EvictedBlock]) -> None:  # noqa: B027 - optional hook
        """Cached device blocks handed out again this step: their KV is overwritten by this step's
        forward unless the connector copies it first."""

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """A request ended (its status says how); `block_ids` (its first KV cache group's table) are
        being released now, and stay unwritten until the next step's forward, which runs after the
        next step's metadata is executed."""

    def waits_for_transfer(self, request: Request) -> bool:
        """True while the waiting `request` must not start yet because KV it was promised is still
        on its way (a consumer waiting for its producer's transfer); the scheduler skips it this
        step, holding no block for it and admitting the requests behind it. Must turn False within
        a bounded time."""
        return False

    def wait_for_arrivals(self, timeout_s: float) -> None:  # noqa: B027 - optional hook
        """Nothing could be scheduled and requests wait: block up to `timeout_s` for KV to arrive
        rather than spin."""

    def has_pending_work(self) -> bool:
        """True while the connector has work queued that may run between steps, without a forward
        (a producer's sends): the engine then runs `build_connector_meta()`'s result at once."""
        return False

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """What the workers must do before this step's forward; None when nothing. Resets the
        step's state."""

    def step_failed(self, metadata: KVConnectorMetadata) -> None:  # noqa: B027 - optional hook
        """The step that carried `metadata` failed before or during its copies: forget what they
        would have stored."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget everything stored (with the device prefix cache's reset, e.g. between benchmark runs)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sockets and memory (the engine shuts down)."""

    def get_stats(self) -> dict[str, float]:
        """Absolute totals and gauges for the engine's stats (and /metrics)."""
        return {}

    def check_invariants(self) -> None:  # noqa: B027 - optional hook
        """Raise AssertionError naming the first broken invariant (tests)."""


def check_kv_cache_groups(groups: KVCacheGroups) -> None:
    """The connectors index a prefix of full blocks by their hashes: one full-attention KV cache
    group only (a sliding group's hit needs the blocks just before the hit point, not a prefix)."""
    if groups.num_groups != 1 or groups.has_sliding:
        raise ValueError(
            "a KV connector (kv_offload_gb, kv_role) needs a model without sliding-window layers (one "
            f"full-attention KV cache group); this model has {groups.describe()}. Turn the option off"
        )
