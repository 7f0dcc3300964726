"""What a KV connector tells the workers about one step, riding in the step contract.

The scheduler side of a connector (core/kv_connector.py) decides which KV moves where; the worker
side (worker/kv_connector/) only executes it. The decision travels in
`SchedulerOutput.kv_connector_metadata` as one of the msgspec structs below (tagged, so a decoder
knows which it got), so the same step reaches an in-process runner and tensor-parallel workers
alike, never pickled. A new connector adds its struct here and to `KVConnectorMetadata`.
"""

from __future__ import annotations

import msgspec


class HostTierMetadata(msgspec.Struct, tag="host_tier", array_like=True, omit_defaults=True):
    """The host-memory tier's copies for one step, executed before the step's forward, saves first.

    Saves copy device blocks that this step's allocations evicted from the device prefix cache
    (they are about to be overwritten) into host slots; loads copy host slots into device blocks
    that this step's requests start from (a prefix hit in the host tier). A block can be both the
    source of a save and the target of a load in the same step: the save runs first.
    """

    save_device_blocks: list[int] = []
    save_host_slots: list[int] = []
    load_host_slots: list[int] = []
    load_device_blocks: list[int] = []

    @property
    def is_empty(self) -> bool:
        return not self.save_device_blocks and not self.load_host_slots


class KVSendMetadata(msgspec.Struct, tag="kv_send", array_like=True, omit_defaults=True):
    """A disaggregated producer's sends for one step: the full prompt blocks of requests that
    finished since the previous step (their blocks are free but not reused before this step's
    forward, which runs after the sends), with their prefix-cache keys and token ids."""

    device_blocks: list[int] = []
    keys: list[bytes] = []
    token_ids: list[list[int]] = []
    # Transfer ids (kv_transfer_params) of the requests whose blocks are all in this batch (maybe
    # none: a prompt shorter than a block, or a request that failed): the consumer stops waiting.
    transfer_ids: list[str] = []

    @property
    def is_empty(self) -> bool:
        return not self.device_blocks and not self.transfer_ids


class KVReceiveMetadata(msgspec.Struct, tag="kv_receive", array_like=True, omit_defaults=True):
    """A disaggregated consumer's loads for one step: received blocks' bytes (every layer tensor's
    block, in the pool's tensor order) into the device blocks its requests start from. In process
    the payloads are views into the received frames (no copy); encoded, they travel as bytes."""

    device_blocks: list[int] = []
    payloads: list[memoryview] = []

    @property
    def is_empty(self) -> bool:
        return not self.device_blocks


# Every connector's metadata: a union of tagged structs (msgspec decodes the right one).
KVConnectorMetadata = HostTierMetadata | KVSendMetadata | KVReceiveMetadata
