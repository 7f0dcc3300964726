"""Request fields both generation endpoints honour on the server side, before the engine:
priority, SLO targets, KV transfer ids and prompt truncation."""

from __future__ import annotations

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol_base import SamplingFields
from tokenmill.server.state import ServerState


def check_priority(state: ServerState, priority: int) -> None:
    """A priority only means something to a priority scheduler (or to the slo one, whose classes
    go by priority); under FCFS it would be ignored."""
    if priority != 0 and state.scheduling_policy not in ("priority", "slo"):
        raise InvalidRequestError(
            f"priority {priority} needs the server started with --scheduling-policy priority or slo "
            f"(it schedules {state.scheduling_policy}); leave priority out or send 0",
            param="priority",
        )


def check_slo_targets(state: ServerState, params: SamplingParams) -> None:
    """SLO targets only mean something to the slo scheduler; under another they would be ignored."""
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if getattr(params, name) is not None and state.scheduling_policy != "slo":
            raise InvalidRequestError(
                f"{name} needs the server started with --scheduling-policy slo (it schedules "
                f"{state.scheduling_policy}); leave {name} out",
                param=name,
            )


def check_kv_transfer(state: ServerState, request: SamplingFields) -> None:
    """kv_transfer_params means something only to a disaggregated engine (--kv-role)."""
    if request.kv_transfer_params is not None and state.kv_role is None:
        raise InvalidRequestError(
            "kv_transfer_params needs a server started with --kv-role producer or consumer (disaggregated "
            "prefill / decode); leave it out",
            param="kv_transfer_params",
        )


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: keep the last `keep` tokens (-1: as many as the context allows,
    leaving one position to generate)."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max(1, max_model_len - 1)
    if keep == 0:
        raise InvalidRequestError("truncate_prompt_tokens must be -1 or >= 1", param="truncate_prompt_tokens")
    return token_ids[-keep:]
