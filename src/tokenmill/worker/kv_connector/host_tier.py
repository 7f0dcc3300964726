"""The host-memory KV tier, worker side: a second pool of blocks in host memory, and the copies.

Each step's `HostTierMetadata` lists saves (device block -> host slot: blocks this step's
allocations evicted, about to be overwritten) and loads (host slot -> device block: prefix hits in
the host tier). Both are done layer by layer, a layer's saves before its loads (a block evicted by
this step is usually the target of one of its loads), and a layer's copies are complete before that
layer stores or reads KV (`wait_for_layer_load`, called by the attention layer): the loads of
layer i+1 overlap the compute of layer i. The tier needs one KV cache group (the factory checks),
so layer i's cache is the pool's tensor i.

The host pool holds, per device layer tensor, `[num_host_blocks, 2, block_size, kv_heads,
head_dim]` bytes (the cache's own dtype copied as raw bytes, in 8-byte words, so an fp8 cache
works unchanged):
one host slot of one layer is contiguous, so a run of consecutive slots is one copy. A step's
saves and loads are each sorted by host slot, whatever order the scheduler listed them in (a
request's blocks are evicted tail first, so listed in block order their slots descend), and split
into runs of consecutive slots; the scheduler hands out slots in runs (core/host_slot_runs.py).
Per layer, saves are one gather of the device blocks into a device staging tensor (index_select)
and one device->host copy per run; loads are one host->device copy per run into a staging tensor
and one scatter into the device blocks (index_copy_). A re-hit of a request evicted whole is then
one copy per layer, not one per block and layer; the worst case (scattered slots) is one per block
and layer. `transfer_calls` counts the copies between the pools.

- CPU: both pools are host memory; a layer's copies run when the forward reaches it (there is
  nothing to overlap with: the forward uses the same cores and memory bandwidth). This is the
  path CI tests, with the same per-layer order and copy code as the device path.
- CUDA: the host pool is pinned; every layer's copies are queued at once, saves on one side
  stream and loads on another (device->host and host->device use separate copy engines, so the
  saves of layer i+1 run while layer i loads), both after the work already queued on the compute
  stream (earlier writes of the evicted blocks, earlier reads of the blocks loaded into). Layer
  i's loads wait for its saves (an event per layer) and end with layer i's event; the compute
  stream waits for that event just before layer i, so the host never blocks on a copy. A step
  starts after the compute stream, which the previous step's end made wait for both side streams,
  so a load of a slot saved by an earlier step reads the saved bytes, and a save never overwrites
  a slot an earlier step is still loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.kv_connector_metadata import HostTierMetadata, KVConnectorMetadata
from tokenmill.worker.kv_connector.base import KVConnectorWorker

# (first row in the step's slot-sorted list, first host slot, number of slots): one copy.
SlotRun = tuple[int, int, int]


def slot_runs(slots: list[int]) -> list[SlotRun]:
    """Split a list of host slots into runs of consecutive ascending slots (in list order)."""
    runs: list[SlotRun] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first_row, first_slot, length = runs[-1]
            runs[-1] = (first_row, first_slot, length + 1)
        else:
            runs.append((row, slot, 1))
    return runs


@dataclass(slots=True)
class _Copies:
    """One direction of a step's copies: device blocks (long, on the pool's device; None: none) in
    host slot order, and the runs of consecutive slots."""

    blocks: torch.Tensor | None
    runs: list[SlotRun]


@dataclass(slots=True)
class _StepCopies:
    """One step's copies, as every layer does them, and which layers the forward has waited for."""

    saves: _Copies
    loads: _Copies
    waited: list[bool]  # per layer


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as the widest integers its rows divide into (8 bytes for any real cache):
    copies never depend on the element type (fp8 included), and the gather and scatter kernels
    move words, not single bytes."""
    data = tensor.view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if data.shape[-1] % dtype.itemsize == 0 and data.storage_offset() % dtype.itemsize == 0:
            return data.view(dtype)
    return data


class HostKVTierWorker(KVConnectorWorker):
    def __init__(self, kv_cache_tensors: list[torch.Tensor], num_host_blocks: int, *, duplex: bool = True) -> None:
        """`duplex=False` puts the loads on the save stream (one direction at a time: benchmarks)."""
        if not kv_cache_tensors:
            raise ValueError("the host KV tier needs the KV pool's tensors; allocate the pool first")
        self.device_tensors = [_words(t) for t in kv_cache_tensors]
        self.device = kv_cache_tensors[0].device
        self.num_host_blocks = num_host_blocks
        self.is_cuda = self.device.type == "cuda"
        self.host_tensors = [
            torch.empty((num_host_blocks, t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=self.is_cuda)
            for t in self.device_tensors
        ]
        # CUDA: saves (device->host) and loads (host->device) on their own streams; layer i's saves
        # are done once its save event fires, its loads (and so all its copies) once its layer event
        # fires (both re-recorded every step).
        self._save_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if self.is_cuda and duplex else self._save_stream
        self._save_events = [torch.cuda.Event() for _ in self.device_tensors] if self.is_cuda else []
        self._layer_events = [torch.cuda.Event() for _ in self.device_tensors] if self.is_cuda else []
        self._step: _StepCopies | None = None
        # Layers whose copies the forward waited for right before the layer (overlapped), and those
        # waited for all at once (a whole-step CUDA graph, a step without a forward): for tests
        # and the benchmark.
        self.layers_waited_in_forward = 0
        self.layers_waited_at_once = 0
        # Copy calls between the pools (one per run of slots and layer), and block-layers moved, of
        # saves and of loads.
        self.save_calls = self.load_calls = 0
        self.block_layers_saved = self.block_layers_loaded = 0

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_tensors)

    @property
    def transfer_calls(self) -> int:
        return self.save_calls + self.load_calls

    @property
    def block_layers_moved(self) -> int:
        return self.block_layers_saved + self.block_layers_loaded

    @property
    def num_layers(self) -> int:
        return len(self.device_tensors)

    # -- the hooks ----------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, HostTierMetadata):
            raise TypeError(f"the host KV tier got {type(metadata).__name__} metadata")
        if self._step is not None:  # the last step was never closed: finish it before this one
            self.wait_for_load()
        if self._save_stream is None or self._load_stream is None:
            self._step = self._plan(metadata)  # copies run as the forward reaches each layer
            return
        saving, loading = self._save_stream, self._load_stream
        compute = torch.cuda.current_stream(self.device)
        saving.wait_stream(compute)
        loading.wait_stream(compute)
        # Set before queueing: should a copy fail to queue, wait_for_load still orders the compute
        # stream after the ones already queued.
        self._step = step = self._plan(metadata)
        # All saves, then all loads: the host queues them in a few milliseconds, while the save
        # stream is already busy with the first layers.
        if step.saves.blocks is not None:
            with torch.cuda.stream(saving):
                for layer, event in enumerate(self._save_events):
                    self._save_layer(layer, step.saves)
                    event.record(saving)
        with torch.cuda.stream(loading):
            for layer, event in enumerate(self._layer_events):
                if step.saves.blocks is not None:
                    loading.wait_event(self._save_events[layer])
                if step.loads.blocks is not None:
                    self._load_layer(layer, step.loads)
                event.record(loading)

    def wait_for_layer_load(self, layer_index: int) -> None:
        step = self._step
        if step is None:
            return
        if not 0 <= layer_index < len(step.waited):
            raise IndexError(
                f"KV layer index {layer_index} out of range: the pool has {len(step.waited)} layer tensors "
                "(the model runner numbers the attention layers 0..n-1)"
            )
        if step.waited[layer_index]:
            return
        step.waited[layer_index] = True
        self.layers_waited_in_forward += 1
        if not self.is_cuda:
            self._copy_layer(layer_index, step)
        else:
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer_index])

    def wait_for_load(self) -> None:
        step, self._step = self._step, None  # closed even if a copy below fails
        if step is None:
            return
        remaining = [layer for layer, waited in enumerate(step.waited) if not waited]
        self.layers_waited_at_once += len(remaining)
        if self._save_stream is not None and self._load_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self._save_stream)
            compute.wait_stream(self._load_stream)
            return
        for layer in remaining:
            self._copy_layer(layer, step)

    # -- the copies ---------------------------------------------------------------------------

    def _plan(self, meta: HostTierMetadata) -> _StepCopies:
        return _StepCopies(
            saves=self._copies(meta.save_host_slots, meta.save_device_blocks, self._save_stream),
            loads=self._copies(meta.load_host_slots, meta.load_device_blocks, self._load_stream),
            waited=[False] * self.num_layers,
        )

    def _copies(self, slots: list[int], blocks: list[int], stream: torch.cuda.Stream | None) -> _Copies:
        """Pairs (host slot, device block) in slot order: consecutive slots are one copy."""
        if not slots:
            return _Copies(None, [])
        pairs = sorted(zip(slots, blocks, strict=True))
        ids = torch.tensor([block for _, block in pairs], dtype=torch.long)
        if stream is not None:
            # Pinned (the caching host allocator keeps it until the copy is done), so the copy never
            # waits for the stream; allocated on, and used only by, that stream.
            with torch.cuda.stream(stream):
                ids = ids.pin_memory().to(self.device, non_blocking=True)
        return _Copies(ids, slot_runs([slot for slot, _ in pairs]))

    def _copy_layer(self, layer: int, step: _StepCopies) -> None:
        """Layer `layer`'s saves, then its loads (the CPU path)."""
        if step.saves.blocks is not None:
            self._save_layer(layer, step.saves)
        if step.loads.blocks is not None:
            self._load_layer(layer, step.loads)

    def _save_layer(self, layer: int, saves: _Copies) -> None:
        """Gather the saved blocks into a staging tensor, copy each run of slots out of it (on
        CUDA: queued on the current stream, the save stream)."""
        assert saves.blocks is not None
        device, host = self.device_tensors[layer], self.host_tensors[layer]
        staged = device.transpose(0, 1).index_select(0, saves.blocks)  # [n, 2, ...], contiguous
        for row, slot, length in saves.runs:
            host[slot : slot + length].copy_(staged[row : row + length], non_blocking=True)
        self.save_calls += len(saves.runs)
        self.block_layers_saved += len(saves.blocks)

    def _load_layer(self, layer: int, loads: _Copies) -> None:
        """Copy each run of slots into a staging tensor, scatter it into the device blocks."""
        assert loads.blocks is not None
        device, host = self.device_tensors[layer], self.host_tensors[layer]
        staged = torch.empty((len(loads.blocks), *host.shape[1:]), dtype=host.dtype, device=self.device)
        for row, slot, length in loads.runs:
            staged[row : row + length].copy_(host[slot : slot + length], non_blocking=True)
        device.index_copy_(1, loads.blocks, staged.transpose(0, 1))
        self.load_calls += len(loads.runs)
        self.block_layers_loaded += len(loads.blocks)

    def release(self) -> None:
        for stream in (self._save_stream, self._load_stream):
            if stream is not None:
                stream.synchronize()
        self._step = None
        self.host_tensors = []
        self.device_tensors = []
