"""Request bodies of the runtime LoRA endpoints (vLLM's): POST /v1/load_lora_adapter and
/v1/unload_lora_adapter."""

from __future__ import annotations

from pydantic import Field

from tokenmill.server.request_model import RequestModel


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1, description="the name requests pick it by (their `model`)")
    lora_path: str = Field(min_length=1, description="the PEFT adapter directory, on the server")


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
