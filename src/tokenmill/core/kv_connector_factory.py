"""Which KV connector an engine runs (scheduler side), from its cache options; None: none."""

from __future__ import annotations

from tokenmill.config import CacheConfig
from tokenmill.core.host_kv_tier import HostKVTier, num_host_blocks
from tokenmill.core.kv_connector import KVConnectorScheduler
from tokenmill.core.kv_transfer import KVConsumer, KVLayout, KVProducer


def make_kv_connector(
    cache: CacheConfig, bytes_per_block: int, layout: KVLayout | None = None
) -> KVConnectorScheduler | None:
    """`bytes_per_block`: one device KV block over all layer tensors of one worker; `layout`: the
    worker's KV layout (a disaggregated consumer checks what it receives against it)."""
    if cache.kv_role == "producer":
        return KVProducer(cache.block_size)
    if cache.kv_role == "consumer":
        assert layout is not None and cache.kv_transfer_address is not None
        return KVConsumer(
            cache.kv_transfer_address, layout, cache.kv_claim_timeout_s, int(cache.kv_transfer_buffer_gb * 2**30),
            wait_timeout_s=cache.kv_transfer_wait_s,
        )
    if not cache.kv_offload_gb:
        return None
    return HostKVTier(num_host_blocks(cache.kv_offload_gb, bytes_per_block), cache.block_size, bytes_per_block)
