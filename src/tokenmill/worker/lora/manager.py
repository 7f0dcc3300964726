"""LoRAManager: adapters in a host-memory cache and in the device's slots, for the model runner.

- Host cache: up to `max_cpu_loras` adapters read from disk and laid out (worker/lora/adapter_weights.py)
  on one loader thread, least recently used evicted (never one a live request runs with). The
  scheduler admits a request only once its adapter is here (`ready`, the scheduler's LoRA hook), so
  a load never holds up the step loop.
- Device slots: `max_loras` per adapted layer. Before a step, each adapter of the step's requests
  gets a slot (least recently used first among those no live request holds) and its weights are
  copied in, on the step's stream. The scheduler never puts more adapters in one step than slots.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import torch
from torch import nn

from tokenmill.config import LoRAConfig
from tokenmill.lora.request import LoRARequest
from tokenmill.model.arch import ArchConfig
from tokenmill.worker.lora.adapter_weights import HostAdapter, load_host_adapter
from tokenmill.worker.lora.linear import LoRALinearMethod
from tokenmill.worker.lora.step_mapping import LoRAStepMapping
from tokenmill.worker.lora.targets import find_targets

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, config: LoRAConfig, model: nn.Module, arch: ArchConfig, device: torch.device, dtype: torch.dtype, max_tokens: int
    ) -> None:
        self.config = config
        self.max_loras = config.max_loras  # the scheduler's hook reads it
        self.rank = config.max_lora_rank
        self.model, self.arch, self.device, self.dtype = model, arch, device, dtype
        self.geometries, self.targets = find_targets(model, arch)
        if not self.geometries:
            raise ValueError(f"this {arch.architecture} model has no layers LoRA can adapt")
        max_width = max(g.num_parts for g in self.geometries) * self.rank
        self.mapping = LoRAStepMapping(config.max_loras, max_tokens, max_width, device)
        slots = config.max_loras
        nbytes = 0
        for g in self.geometries:
            layer = g.layer
            layer.lora_a = torch.zeros(slots, g.num_parts * self.rank, layer.in_features, device=device, dtype=dtype)
            layer.lora_b = torch.zeros(slots, layer.out_features, self.rank, device=device, dtype=dtype)
            layer.method = LoRALinearMethod(layer.method, g, self.mapping, self.rank)
            nbytes += layer.lora_a.nbytes + layer.lora_b.nbytes
        logger.info(
            "LoRA: %d adapted layers, %d device slots of rank %d (%.2f GiB), up to %d adapters in host memory",
            len(self.geometries), slots, self.rank, nbytes / 2**30, config.host_cache_size,
        )  # fmt: skip
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._host: OrderedDict[int, Future[HostAdapter]] = OrderedDict()  # lora id -> load, LRU order
        self._requests: dict[int, LoRARequest] = {}
        self._slot_lora: list[int | None] = [None] * slots  # lora id held by each slot
        self._slot_used: list[int] = [0] * slots  # step counter of last use
        self._steps = itertools.count(1)
        self.num_loads = 0  # host loads started (tests, stats)
        self.num_slot_loads = 0

    # -- host cache (the scheduler's hook, the engine's add / remove) ------------------------------

    def add_lora(self, lora: LoRARequest) -> None:
        """Start loading `lora` into host memory (no-op if loaded or loading)."""
        self._load(lora)

    def ready(self, lora: LoRARequest) -> bool | str:
        try:
            future = self._load(lora)
        except ValueError as exc:  # the id is taken by another adapter
            return str(exc)
        if not future.done():
            return False
        error = future.exception()
        if error is not None:
            return f"LoRA adapter {lora.lora_name!r} could not be loaded: {error}"
        self._host.move_to_end(lora.lora_int_id)
        return True

    def wait_for_loads(self, timeout: float) -> None:
        """Block (without the GIL) until a load in progress finishes or `timeout` passes: the engine
        calls it when nothing can run until an adapter is loaded, instead of spinning in Python,
        which starves the loader thread of the GIL (a load then took ~10x longer)."""
        loading = [f for f in self._host.values() if not f.done()]
        if loading:
            wait(loading, timeout=timeout, return_when=FIRST_COMPLETED)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: host copy and device slot. False if it was not loaded."""
        known = self._host.pop(lora_int_id, None) is not None
        self._requests.pop(lora_int_id, None)
        for slot, held in enumerate(self._slot_lora):
            if held == lora_int_id:
                self._slot_lora[slot] = None
        return known

    def _load(self, lora: LoRARequest) -> Future[HostAdapter]:
        future = self._host.get(lora.lora_int_id)
        if future is not None:
            known = self._requests[lora.lora_int_id]
            if known.lora_path != lora.lora_path or known.lora_name != lora.lora_name:
                raise ValueError(
                    f"LoRA id {lora.lora_int_id} is {known.lora_name!r} at {known.lora_path}; "
                    f"{lora.lora_name!r} at {lora.lora_path} needs an id of its own"
                )
            return future
        self.num_loads += 1
        future = self._loader.submit(
            load_host_adapter, lora, self.model, self.arch, self.targets, self.rank, self.dtype,
            self.device.type == "cuda",
        )  # fmt: skip
        self._host[lora.lora_int_id] = future
        self._requests[lora.lora_int_id] = lora
        return future

    def evict_host(self, live: set[int]) -> None:
        """Drop least recently used host copies beyond max_cpu_loras (not one in `live` use or loading)."""
        excess = len(self._host) - self.config.host_cache_size
        for lora_id in list(self._host):
            if excess <= 0:
                break
            future = self._host[lora_id]
            if lora_id in live or not future.done():
                continue
            del self._host[lora_id]
            self._requests.pop(lora_id, None)
            excess -= 1

    # -- device slots --------------------------------------------------------------------------

    def slots_for(self, loras: list[LoRARequest | None], live: set[int]) -> np.ndarray:
        """Each request's slot (-1: no adapter), loading adapters into slots as needed. `live`: the
        adapter ids of every request the runner holds (their slots are kept when possible)."""
        step = next(self._steps)
        result = np.full(len(loras), -1, dtype=np.int64)
        needed: dict[int, LoRARequest] = {}
        for lora in loras:
            if lora is not None:
                needed.setdefault(lora.lora_int_id, lora)
        if not needed:
            return result
        if len(needed) > len(self._slot_lora):
            raise RuntimeError(
                f"a step with {len(needed)} adapters exceeds the {len(self._slot_lora)} LoRA slots (max_loras)"
            )
        slot_of: dict[int, int] = {}
        for slot, held in enumerate(self._slot_lora):
            if held in needed:
                slot_of[held] = slot
        for lora_id, lora in needed.items():
            if lora_id not in slot_of:
                slot = self._free_slot(set(needed), live)
                self._fill_slot(slot, lora)
                slot_of[lora_id] = slot
            self._slot_used[slot_of[lora_id]] = step
        for i, lora in enumerate(loras):
            if lora is not None:
                result[i] = slot_of[lora.lora_int_id]
        self.evict_host(live)
        return result

    def _free_slot(self, needed: set[int], live: set[int]) -> int:
        """An empty slot, else the least recently used one held by no live request, else by no
        request of this step."""
        candidates = [s for s, held in enumerate(self._slot_lora) if held is None]
        if not candidates:
            candidates = [s for s, held in enumerate(self._slot_lora) if held not in live]
        if not candidates:
            candidates = [s for s, held in enumerate(self._slot_lora) if held not in needed]
        return min(candidates, key=lambda s: self._slot_used[s])

    def _fill_slot(self, slot: int, lora: LoRARequest) -> None:
        future = self._load(lora)
        adapter = future.result()  # ready() made the scheduler wait for it, so this does not block
        self._host.move_to_end(lora.lora_int_id)
        for g in self.geometries:
            layer = g.layer
            weights = adapter.layers.get(g.index)
            if weights is None:
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
            else:
                layer.lora_a[slot].copy_(weights[0], non_blocking=True)
                layer.lora_b[slot].copy_(weights[1], non_blocking=True)
        self._slot_lora[slot] = lora.lora_int_id
        self.num_slot_loads += 1

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
