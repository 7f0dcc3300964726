"""Which KV connector an engine runs (scheduler side), from its cache options; None: none."""

from __future__ import annotations

from tokenmill.config import CacheConfig
from tokenmill.core.host_kv_tier import HostKVTier, num_host_blocks
from tokenmill.core.kv_connector import KVConnectorScheduler


def make_kv_connector(cache: CacheConfig, bytes_per_block: int) -> KVConnectorScheduler | None:
    """`bytes_per_block`: one device KV block over all layer tensors of one worker."""
    if not cache.kv_offload_gb:
        return None
    return HostKVTier(num_host_blocks(cache.kv_offload_gb, bytes_per_block), cache.block_size, bytes_per_block)
