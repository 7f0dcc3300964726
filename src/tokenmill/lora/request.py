"""LoRARequest: which adapter a request runs with (vLLM's offline interface and our wire format)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter by name, a unique positive id and its directory (adapter_config.json +
    adapter_model.safetensors). The id names one load of the adapter: reloading under the same name
    takes a new id, so the prefix cache never hands its blocks to the old one's requests."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_key(self) -> str:
        """Goes into the first KV block's hash: identical tokens under different adapters (or
        different loads of one) never share KV blocks."""
        return f"lora:{self.lora_int_id}"
