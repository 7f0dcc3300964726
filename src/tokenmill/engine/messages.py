"""Typed messages between the API side and the engine core (msgspec msgpack; never pickle)."""

from __future__ import annotations

import msgspec

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: what the context leaves when the user gave none
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


class EngineInfo(msgspec.Struct):
    """What the client side needs to know about the engine once it is up."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    device: str
    dtype: str
    # The longest sequence (prompt + output tokens) the KV pool can hold for one request alone;
    # None: num_kv_blocks * block_size. With sliding-window layers it is more: their blocks follow
    # the window, not the sequence.
    kv_capacity_tokens: int | None = None


# -- client -> engine ---------------------------------------------------------------------------


class AddRequests(msgspec.Struct, tag="add"):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Out-of-band calls the server and tests make: get_stats, check_invariants, add_lora, remove_lora."""

    call_id: int
    method: str
    args: dict[str, str | int | None] = {}


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Hello(msgspec.Struct, tag="hello"):
    """An API server process other than the engine's parent is up and reading (`serve
    --api-server-count`); the engine answers EngineReady (engine/client_links.py)."""

    pid: int = 0  # the process's id: an ApiServerGone names which process of a slot died


class ApiServerGone(msgspec.Struct, tag="api_server_gone"):
    """From the engine's parent: the API server process `pid` in `slot` exited. Its requests have
    no reader any more; the engine aborts them at once instead of when a restarted process says
    Hello, and sends that slot nothing until then."""

    slot: int
    pid: int


ClientMessage = AddRequests | AbortRequests | UtilityCall | Hello | ApiServerGone | Shutdown


# -- engine -> client ---------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready"):
    info: EngineInfo | None = None
    error: str | None = None  # start-up failed: why


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput] = []
    stats: dict[str, float] = {}


class UtilityResult(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: dict[str, float] | None = None
    error: str | None = None


class ApiServerStalled(msgspec.Struct, tag="api_server_stalled"):
    """To the engine's parent: the API server process `pid` in `slot` left the engine's messages
    unread for too long (TOKENMILL_API_SERVER_STALL_TIMEOUT); the engine aborted its requests and
    sends it nothing more, and the parent, its supervisor, kills it (then restarts it)."""

    slot: int
    pid: int


EngineMessage = EngineReady | StepOutputs | UtilityResult | ApiServerStalled
