"""The LoRA adapters a server serves, by name, in the API server process (no torch).

Each load gets a fresh id (monotonic, never reused): the id is in every KV block hash of the
adapter's requests, so an adapter reloaded under the same name never meets the old one's cached
blocks. An adapter is checked with `read_adapter` (safetensors headers against the base model's
shapes) before it is registered or sent to the engine, so a bad one is a 400 that leaves the
engine, the other adapters and the requests in flight alone.

Requests hold the adapter they run with (`hold`) until they end; unloading one that is held is
refused with 409 ("finish or cancel them first") rather than pulling the weights from under it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import InvalidRequestError, ModelNotFoundError, TokenmillError
from tokenmill.lora.adapter_files import AdapterError, read_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.model.arch import ArchConfig

RUNTIME_FLAG = "--allow-runtime-lora-updating"


class ForbiddenLoRAPathError(TokenmillError):
    status_code = 403
    error_type = "permission_error"


class LoRAInUseError(TokenmillError):
    status_code = 409
    error_type = "conflict_error"


class LoRAUpdatingDisabledError(TokenmillError):
    """The load/unload endpoints on a server that does not allow them: answered like a missing route."""

    status_code = 404
    error_type = "not_found_error"


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    request: LoRARequest
    parent: str  # the base model's name, for /v1/models


class LoRAHold:
    """A request's claim on its adapter; `release` is idempotent."""

    __slots__ = ("_registry", "lora_int_id")

    def __init__(self, registry: LoRARegistry | None, lora_int_id: int) -> None:
        self._registry = registry
        self.lora_int_id = lora_int_id

    def release(self) -> None:
        registry, self._registry = self._registry, None
        if registry is not None:
            registry._release(self.lora_int_id)


class LoRARegistry:
    def __init__(
        self,
        *,
        max_lora_rank: int,
        base_names: list[str],
        allowed_dirs: Iterable[str] = (),
        allow_runtime_updating: bool = False,
    ) -> None:
        self.max_lora_rank = max_lora_rank
        self.base_names = list(base_names)  # the first is the canonical one: adapters' parent
        self.allowed_dirs = tuple(Path(d).resolve() for d in allowed_dirs)
        self.allow_runtime_updating = allow_runtime_updating
        self.arch: ArchConfig | None = None  # the base model's, known once the engine has resolved it
        self._adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)
        self._holds: Counter[int] = Counter()
        # Called after a request takes or gives back an adapter: with several API server processes
        # each publishes its counts for /metrics to sum (ServerMetrics.on_lora_holds_changed).
        self.on_holds_changed: Callable[[], None] | None = None
        # Loads and unloads one at a time: a name is checked and taken (or freed) in one piece.
        self._lock = asyncio.Lock()

    # -- what requests see --------------------------------------------------------------------

    @property
    def adapters(self) -> list[ServedAdapter]:
        return list(self._adapters.values())

    def get(self, name: str) -> LoRARequest | None:
        served = self._adapters.get(name)
        return served.request if served is not None else None

    def hold(self, lora: LoRARequest) -> LoRAHold:
        """Claims `lora` for one request; 404 if it was unloaded (or reloaded) since it was looked up."""
        served = self._adapters.get(lora.lora_name)
        if served is None or served.request.lora_int_id != lora.lora_int_id:
            raise ModelNotFoundError(
                f"the LoRA adapter {lora.lora_name!r} was unloaded while this request was being prepared",
                param="model",
            )
        self._holds[lora.lora_int_id] += 1
        if self.on_holds_changed is not None:
            self.on_holds_changed()
        return LoRAHold(self, lora.lora_int_id)

    def num_holding(self, name: str) -> int:
        served = self._adapters.get(name)
        return self._holds[served.request.lora_int_id] if served is not None else 0

    def _release(self, lora_int_id: int) -> None:
        self._holds[lora_int_id] -= 1
        if self._holds[lora_int_id] <= 0:
            del self._holds[lora_int_id]
        if self.on_holds_changed is not None:
            self.on_holds_changed()

    # -- load / unload ------------------------------------------------------------------------

    def check_runtime_updating(self) -> None:
        if not self.allow_runtime_updating:
            raise LoRAUpdatingDisabledError(
                f"loading and unloading LoRA adapters at runtime is off on this server; start it with "
                f"{RUNTIME_FLAG} (or TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=true)"
            )

    async def load(
        self, engine: Any, name: str, path: str, *, base_model_name: str | None = None, check_dirs: bool = True
    ) -> LoRARequest:
        """Checks the adapter at `path`, registers it as `name` with a new id and has the engine
        start loading it. `check_dirs`: the path must lie in --lora-allowed-dirs (runtime loads)."""
        if not name:
            raise InvalidRequestError("lora_name must not be empty", param="lora_name")
        if not path:
            raise InvalidRequestError("lora_path must not be empty", param="lora_path")
        async with self._lock:
            if name in self.base_names:
                raise InvalidRequestError(
                    f"{name!r} is the base model's name; give the adapter another lora_name", param="lora_name"
                )
            if name in self._adapters:
                raise InvalidRequestError(
                    f"a LoRA adapter named {name!r} is already loaded (from {self._adapters[name].request.lora_path}); "
                    "unload it first (POST /v1/unload_lora_adapter) or choose another lora_name",
                    param="lora_name",
                )
            if check_dirs:
                self._check_allowed(path)
            if self.arch is None:
                raise TokenmillError("the base model is not resolved yet; retry once /health answers 200")
            try:
                await asyncio.to_thread(read_adapter, path, self.arch, self.max_lora_rank)
            except AdapterError as exc:
                raise InvalidRequestError(str(exc), param="lora_path") from None
            lora = LoRARequest(name, next(self._ids), path)
            try:
                await engine.call_utility(
                    "add_lora", args={"lora_name": name, "lora_int_id": lora.lora_int_id, "lora_path": path}
                )
            except RuntimeError as exc:  # the engine answered with an error: nothing was registered
                raise TokenmillError(f"the engine could not load the LoRA adapter {name!r}: {exc}") from exc
            self._adapters[name] = ServedAdapter(lora, base_model_name or self.base_names[0])
            return lora

    async def unload(self, engine: Any, name: str) -> LoRARequest:
        async with self._lock:
            served = self._adapters.get(name)
            if served is None:
                loaded = ", ".join(self._adapters) or "none"
                raise ModelNotFoundError(
                    f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})", param="lora_name"
                )
            holding = self._holds[served.request.lora_int_id]
            if holding:
                raise LoRAInUseError(
                    f"the LoRA adapter {name!r} is in use by {holding} request(s) in flight; finish or cancel "
                    "them first, then unload it",
                    param="lora_name",
                )
            # Forgotten here first, so no new request can pick it while the engine drops it.
            del self._adapters[name]
            await engine.call_utility("remove_lora", args={"lora_int_id": served.request.lora_int_id})
            return served.request

    def adopt(self, lora: LoRARequest, parent: str) -> None:
        """Serves an adapter another API server process already had the engine load (--lora-modules
        with --api-server-count), under the same id."""
        self._adapters[lora.lora_name] = ServedAdapter(lora, parent)
        self._ids = itertools.count(max(lora.lora_int_id + 1, next(self._ids)))

    def _check_allowed(self, path: str) -> None:
        if not self.allowed_dirs:
            return
        resolved = Path(path).resolve()  # symlinks and `..` resolved: no way out of the allowed dirs
        if not any(resolved.is_relative_to(d) for d in self.allowed_dirs):
            dirs = ", ".join(str(d) for d in self.allowed_dirs)
            raise ForbiddenLoRAPathError(
                f"the LoRA path {path!r} is outside the directories this server loads adapters from "
                f"(--lora-allowed-dirs: {dirs})",
                param="lora_path",
            )


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError
    naming what is wrong."""
    import json

    text = text.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("name"), str) or not isinstance(fields.get("path"), str):
            raise ValueError(f'--lora-modules {text!r}: the JSON form is {{"name": ..., "path": ..., "base_model_name": ...}}')
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown keys {unknown}; known: name, path, base_model_name")
        base = fields.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
        module = LoRAModule(fields["name"], fields["path"], base)
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r} must be name=path or a JSON object")
        module = LoRAModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"--lora-modules {text!r}: both the name and the path must be non-empty")
    return module
