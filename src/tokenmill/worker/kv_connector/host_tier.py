"""The host-memory KV tier, worker side: a second pool of blocks in host memory, and the copies.

The host pool mirrors the device pool's layer tensors (`[2, num_host_blocks, block_size,
kv_heads, head_dim]` each, the cache's own dtype; copied as raw bytes, so an fp8 cache with its
per-layer scales works unchanged). Each step's `HostTierMetadata` lists saves (device block ->
host slot: blocks this step's allocations evicted, about to be overwritten) and loads (host slot
-> device block: prefix hits in the host tier), saves first.

On the CPU both pools are host memory and the copies run synchronously before the forward.

On CUDA the host pool is pinned and the copies run on a side stream, ordered after the work
already queued on the compute stream (the evicted blocks' last writes) and before the forward
(the compute stream waits for the side stream), so the host thread never blocks on them: per
layer tensor one gather of the saved blocks into a device staging tensor and one device-to-host
copy into pinned staging, whose scatter into the host slots happens on the host at the next step
(after its event), and for loads one host gather into pinned staging, one host-to-device copy and
one scatter into the device blocks. A load of a slot saved the step before waits for that save.
"""

from __future__ import annotations

import torch

from tokenmill.core.kv_connector_metadata import HostTierMetadata, KVConnectorMetadata
from tokenmill.worker.kv_connector.base import KVConnectorWorker


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes: copies never depend on the element type (fp8 included)."""
    return tensor.view(torch.uint8)


class HostKVTierWorker(KVConnectorWorker):
    def __init__(self, kv_cache_tensors: list[torch.Tensor], num_host_blocks: int) -> None:
        if not kv_cache_tensors:
            raise ValueError("the host KV tier needs the KV pool's tensors; allocate the pool first")
        self.device_tensors = [_bytes(t) for t in kv_cache_tensors]
        self.device = kv_cache_tensors[0].device
        self.num_host_blocks = num_host_blocks
        self.is_cuda = self.device.type == "cuda"
        self.host_tensors = [
            torch.empty(
                (t.shape[0], num_host_blocks, *t.shape[2:]), dtype=torch.uint8, pin_memory=self.is_cuda
            )
            for t in self.device_tensors
        ]
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # CUDA: the last step's copies are done once `_copies_done` fires. Until then its saves
        # sit in pinned staging, not yet scattered into the host slots (slot index, per layer its
        # staging), and the pinned sources of its loads must stay alive.
        self._copies_done: torch.cuda.Event | None = None
        self._unscattered: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._in_flight_sources: list[torch.Tensor] = []

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.host_tensors)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, HostTierMetadata):
            raise TypeError(f"the host KV tier got {type(metadata).__name__} metadata")
        if self.is_cuda:
            self._copy_on_side_stream(metadata)
        else:
            self._copy_now(metadata)

    def wait_for_load(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    # -- CPU ----------------------------------------------------------------------------------

    def _copy_now(self, meta: HostTierMetadata) -> None:
        if meta.save_device_blocks:
            blocks = torch.tensor(meta.save_device_blocks, dtype=torch.long)
            slots = torch.tensor(meta.save_host_slots, dtype=torch.long)
            for device, host in zip(self.device_tensors, self.host_tensors, strict=True):
                host.index_copy_(1, slots, device.index_select(1, blocks))
        if meta.load_host_slots:
            slots = torch.tensor(meta.load_host_slots, dtype=torch.long)
            blocks = torch.tensor(meta.load_device_blocks, dtype=torch.long)
            for device, host in zip(self.device_tensors, self.host_tensors, strict=True):
                device.index_copy_(1, blocks, host.index_select(1, slots))

    # -- CUDA ---------------------------------------------------------------------------------

    def _finish_previous_copies(self) -> None:
        """Wait for the previous step's copies (queued before its forward, so normally long done)
        and scatter its saved blocks into their host slots."""
        if self._copies_done is None:
            return
        self._copies_done.synchronize()
        self._copies_done = None
        self._in_flight_sources = []
        if self._unscattered is not None:
            slots, staged = self._unscattered
            self._unscattered = None
            for host, stage in zip(self.host_tensors, staged, strict=True):
                host.index_copy_(1, slots, stage)

    def _copy_on_side_stream(self, meta: HostTierMetadata) -> None:
        assert self._stream is not None
        self._finish_previous_copies()  # a load below may read a slot the previous step saved
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if meta.save_device_blocks:
                blocks = torch.tensor(meta.save_device_blocks, dtype=torch.long).to(self.device, non_blocking=True)
                staged = []
                for device in self.device_tensors:
                    gathered = device.index_select(1, blocks)
                    stage = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
                    stage.copy_(gathered, non_blocking=True)
                    staged.append(stage)
                self._unscattered = (torch.tensor(meta.save_host_slots, dtype=torch.long), staged)
            if meta.load_host_slots:
                slots = torch.tensor(meta.load_host_slots, dtype=torch.long)
                blocks = torch.tensor(meta.load_device_blocks, dtype=torch.long).to(self.device, non_blocking=True)
                for device, host in zip(self.device_tensors, self.host_tensors, strict=True):
                    source = torch.empty(
                        (host.shape[0], len(meta.load_host_slots), *host.shape[2:]), dtype=torch.uint8, pin_memory=True
                    )
                    torch.index_select(host, 1, slots, out=source)
                    self._in_flight_sources.append(source)
                    device.index_copy_(1, blocks, source.to(self.device, non_blocking=True))
            self._copies_done = torch.cuda.Event()
            self._copies_done.record(stream)

    def release(self) -> None:
        if self._copies_done is not None:
            self._copies_done.synchronize()
        self._copies_done = None
        self._unscattered = None
        self._in_flight_sources = []
        self.host_tensors = []
        self.device_tensors = []
