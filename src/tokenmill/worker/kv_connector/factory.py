"""Which KV connector a model runner runs (worker side), mirroring core/kv_connector_factory.py."""

from __future__ import annotations

import torch

from tokenmill.config import CacheConfig
from tokenmill.core.host_kv_tier import num_host_blocks
from tokenmill.core.kv_cache_groups import KVCacheGroups
from tokenmill.core.kv_connector import check_kv_cache_groups
from tokenmill.worker.kv_connector.base import KVConnectorWorker


def make_kv_connector_worker(
    cache: CacheConfig,
    groups: KVCacheGroups,
    kv_cache_tensors: list[torch.Tensor],
    bytes_per_block: int,
    model_name: str = "",
) -> KVConnectorWorker | None:
    if cache.kv_role is not None:
        from tokenmill.worker.kv_connector.transfer import KVReceiverWorker, KVSenderWorker, kv_layout

        check_kv_cache_groups(groups)
        layout = kv_layout(model_name, cache.block_size, kv_cache_tensors)
        if cache.kv_role == "producer":
            return KVSenderWorker(kv_cache_tensors, layout, cache.kv_transfer_address)  # type: ignore[arg-type]
        return KVReceiverWorker(kv_cache_tensors, layout)
    if not cache.kv_offload_gb:
        return None
    check_kv_cache_groups(groups)  # before pinning gigabytes of host memory
    from tokenmill.worker.kv_connector.host_tier import HostKVTierWorker

    return HostKVTierWorker(kv_cache_tensors, num_host_blocks(cache.kv_offload_gb, bytes_per_block))
