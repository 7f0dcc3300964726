"""Prefill / decode disaggregation as a router mode (`tokenmill router --prefill URL --decode URL`):
what the router sends to a prefill server (a `--kv-role producer`) and adds to the request it then
sends to a decode server (a `--kv-role consumer`). docs/ROUTER.md and docs/KV_OFFLOAD.md.

Each generation request gets a fresh transfer id. The prefill server gets a one-token, one-choice,
non-streamed copy naming it in `kv_transfer_params` (its prompt blocks travel to the consumer under
that id); the decode server gets the client's request naming the same id, so it waits for those
blocks instead of racing them. Torch-free, no HTTP: app.py does the sending.
"""

from __future__ import annotations

import uuid
from typing import Any

# Fields that would make the one-token prefill request invalid or wasteful.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "best_of")


def new_transfer_id() -> str:
    return f"pd-{uuid.uuid4().hex}"


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The producer's request: the same prompt and options, one token, one choice, not streamed."""
    prefill = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["max_tokens"] = 1
    prefill["stream"] = False
    prefill["n"] = 1
    prefill["kv_transfer_params"] = {"transfer_id": transfer_id}
    return prefill


def decode_body(body: dict[str, Any], transfer_id: str | None) -> dict[str, Any]:
    """The consumer's request: the client's, naming the transfer to wait for (None: the prefill
    failed, the consumer computes the prompt itself)."""
    if transfer_id is None:
        return body
    return body | {"kv_transfer_params": {"transfer_id": transfer_id}}
