"""What flows out of the scheduler (to the model runner) and back, and out of the engine core.

The step contract is serializable: `SchedulerOutput` and everything in it are msgspec structs
holding plain ids and numbers (never a live `core.Request`), so the same object serves an
in-process runner and one in another process (tensor-parallel workers). A request's full data
travels once, the first step it is scheduled (and again when it resumes after preemption); after
that only what changed. The runner keeps its own per-request state from these.

Block tables travel per KV cache group (core/kv_cache_groups.py). A sliding-window group frees
the blocks that slid out of its window and nulls their entries in the scheduler's table; the
diffs do not repeat that: the runner's copy keeps the old ids. That is correct because nothing
reads them: K/V is written only at the step's own positions (in live blocks), and every backend
that serves a sliding-window layer (it must declare so, or the runner refuses the model at load)
attends only to keys inside the window, skipping the blocks wholly before it. A request
new to the runner (first scheduled, resumed, or a prefix hit in a sliding group) gets the table
with its null entries.

`EngineCoreOutput` is a msgspec struct too: the same object is used in-process and sent over ZMQ
(msgpack, never pickle) to the API server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tokenmill.core.kv_connector_metadata import KVConnectorMetadata
from tokenmill.core.request_timeline import RequestTimeline
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the runner holds no state for: first scheduled, or resumed after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    # The whole block table of each KV cache group (one list for a model without sliding-window
    # layers), a copy: the KV manager's lists keep growing.
    block_ids: list[list[int]]
    num_computed_tokens: int  # before this step (a prefix-cache hit; 0 after a preemption)
    # Tokens sampled before a preemption: the runner's token history is prompt + these.
    output_token_ids: list[int] = []
    lora_request: LoRARequest | None = None  # the adapter its tokens run with (None: the base model)


class CachedRequestData(msgspec.Struct, array_like=True):
    """Requests the runner already holds state for, scheduled again: only what changed.

    Parallel lists (one entry per request, in the step's order), which cost less to build, read
    and encode than one struct per request in the per-step hot path.
    """

    request_ids: list[str] = []
    num_computed_tokens: list[int] = []  # before this step
    # Blocks appended to a request's tables since its previous step (one list per KV cache
    # group), only for the few requests that got any (a decode step crosses a block boundary once
    # every block_size tokens).
    new_block_ids: dict[str, list[list[int]]] = {}


class SchedulerOutput(msgspec.Struct, omit_defaults=True):
    """One step: which requests compute how many tokens, and what the runner must know first.

    The batch order is the cached requests in order, then the new ones in order: exactly the
    order of `num_scheduled_tokens` (a dict keeps it, msgpack too).
    """

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # request id -> tokens it computes this step (including its scheduled draft tokens).
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # request id -> draft tokens scheduled for verification after its last known token (a
    # speculative-decoding proposer sets them; empty today). They are counted in
    # num_scheduled_tokens; the runner returns the accepted ones plus one more.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Structured output: the requests that sample under a grammar this step, in batch order. A
    # step that lists any is run in two phases: the runner launches the forward and the logits
    # and waits; the engine core fills the grammar bitmask meanwhile and hands it over
    # (`GrammarOutput`); the runner masks the logits and samples. Empty: today's one-phase step.
    structured_output_request_ids: list[str] = []
    # Requests that ended (finished, aborted, errored) since the previous step: the runner drops
    # their per-request state (sampling generators, token history).
    finished_req_ids: set[str] = set()
    # Requests preempted by this schedule: the runner drops their token state; they come back
    # as new requests (with their output so far) when they resume.
    preempted_req_ids: set[str] = set()
    # The KV connector's copies for this step (core/kv_connector_metadata.py), run by the worker
    # before the forward; None without a connector or with nothing to copy.
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def scheduled_req_ids(self) -> list[str]:
        """The step's requests in batch order."""
        return list(self.num_scheduled_tokens)

    def num_computed_tokens_by_request(self) -> dict[str, int]:
        """request id -> tokens computed before this step (off the hot path: tests, prompt logprobs)."""
        return dict(zip(self.scheduled_req_ids, self.batch_num_computed_tokens(), strict=True))

    def batch_num_computed_tokens(self) -> list[int]:
        """Tokens computed before this step, per request in batch order."""
        starts = self.scheduled_cached_reqs.num_computed_tokens
        if self.scheduled_new_reqs:
            starts = starts + [new.num_computed_tokens for new in self.scheduled_new_reqs]
        return starts


class GrammarOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The allowed-token bitmask of one step's constrained requests (the second phase's input).

    `bitmask` packs int32 words (little-endian), `num_words` per row, bit j of word w allowing
    token 32 * w + j; `rows_per_request[i]` rows belong to `request_ids[i]`, in order: one row
    today (the token it samples), k + 1 with k draft tokens. A request of the step with no rows
    here samples unconstrained (its grammar has not started yet, or it is complete).
    """

    request_ids: list[str] = []
    rows_per_request: list[int] = []
    num_words: int = 0
    bitmask: bytes = b""

    @property
    def is_empty(self) -> bool:
        return not self.request_ids


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top alternatives by rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token (1 = most likely)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Result of one step, in plain Python lists (one host sync brought them back)."""

    # Requests that sampled this step, in the order they were scheduled, and the tokens each
    # produced: one today; with k draft tokens scheduled, the accepted drafts plus one more (1..k+1).
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Parallel to req_ids: per request, the logprobs of each of its sampled tokens (or None).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Prompt logprobs of this step's chunk, per request that asked (first prompt position: None).
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Requests that failed this step (e.g. NaN logits): request id -> reason. They end with
    # finish_reason "error"; nothing else in the batch is disturbed.
    errored: dict[str, str] = field(default_factory=dict)
    # How the step ran, for the step trace: the padded batch size of the CUDA graph it replayed
    # (0: eager).
    cuda_graph_size: int = 0
    # Speculative decoding: request id -> draft tokens proposed to follow its tokens so far (the
    # scheduler schedules them for verification in the request's next step).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "shed"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # finish_reason "shed" (the `slo` policy gave up on it before it started): seconds after which
    # a retry may succeed (the server's Retry-After).
    retry_after: float | None = None
    # Seconds from arrival to first being scheduled; set on a request's first output only.
    queue_time: float | None = None
    # With tracing on (--trace-dir), on the final output: what happened to it in the engine.
    timeline: RequestTimeline | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
