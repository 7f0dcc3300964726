"""`--enable-log-requests`: one log line when a request arrives and one as each sequence finishes.

The arrival line has what an operator needs to replay or explain a request (its id, sampling
params, prompt length, the prompt and its token ids cut to `--max-log-len`), the finish line its
outcome (finish reason, tokens, seconds since arrival). Prompts may be private: off by default,
as in vLLM.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len  # characters of prompt and ids of prompt tokens; None: all

    def _cut(self, items: Any) -> Any:
        if items is None or self.max_log_len is None:
            return items
        return items[: self.max_log_len]

    def arrived(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None,
    ) -> None:
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, prompt_tokens: %d, lora_request: %s",
            request_id, self._cut(prompt), params, self._cut(prompt_token_ids), len(prompt_token_ids),
            lora_request.lora_name if lora_request is not None else None,
        )  # fmt: skip

    def finished(self, out: RequestOutput, num_generated: int) -> None:
        completion = out.outputs[0]
        arrival = out.metrics.get("arrival_time")
        seconds = f"{time.monotonic() - arrival:.3f} s" if arrival is not None else "unknown time"
        logger.info(
            "Finished request %s (sequence %d): finish_reason: %s, prompt_tokens: %d, generated_tokens: %d, "
            "cached_tokens: %d, e2e: %s%s",
            out.request_id, completion.index, completion.finish_reason, len(out.prompt_token_ids), num_generated,
            out.num_cached_tokens, seconds, f", error: {out.error}" if out.error else "",
        )  # fmt: skip

    def abandoned(self, request_id: str, num_finished: int, num_sequences: int) -> None:
        logger.info(
            "Aborted request %s: its caller left (client gone, deadline or error) with %d of %d sequences finished",
            request_id, num_finished, num_sequences,
        )  # fmt: skip
