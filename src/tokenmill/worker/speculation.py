"""Speculative decoding in the model runner: sampling a verification step, and proposing drafts.

A step whose scheduler output carries draft tokens runs like any other (eager, piecewise graphs,
or a CUDA graph of its shape); its logits rows are the last known token's and one per draft, and
`verify_drafts` keeps the accepted run plus one token. Once the tokens are on the host the
`Speculator` proposes the next drafts of the step's requests (ngram lookup over the request's own
tokens, or a draft model), under the `DraftPolicy` that keeps speculation from costing more than
it saves; they return in `ModelRunnerOutput.spec_token_ids` and the scheduler schedules them next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.core.outputs import ModelRunnerOutput, TokenLogprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.rejection_sampler import VerifyResult
from tokenmill.spec_decode.draft_policy import DraftPolicy, disable_by_batch_size
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.worker.batch_inputs import HostBatch
from tokenmill.worker.draft_proposer import DraftModelProposer
from tokenmill.worker.request_state import RequestState

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def drafts_allowed(state: RequestState) -> bool:
    """Requests whose sampling reads their earlier output (penalties, min_tokens, bad words) get no
    drafts: each draft row's logits would depend on the drafts before it. (A grammar does not stop
    drafts: every draft position gets its own mask row, engine/structured_output/bitmask.py.)"""
    return not state.sampling_params.needs_output_history


class PendingVerifyStep:
    """A launched verification step: per request, its emitted tokens and accepted count are on their
    way to the host (the same contract as PendingStep)."""

    def __init__(
        self,
        output: ModelRunnerOutput,
        states: list[RequestState],
        drafts: list[list[int]],
        result: VerifyResult,
        packed_host: torch.Tensor,
        ready: torch.cuda.Event | None,
        metadata: SamplingMetadata | None,
        on_result: Callable[[ModelRunnerOutput, dict[str, tuple[int, int]]], None] | None,
    ) -> None:
        self._output = output
        self._states = states
        self._drafts = drafts
        self._result = result
        self._packed = packed_host
        self._ready = ready
        self._metadata = metadata
        self._on_result = on_result
        self._logprobs: tuple[list, list, list, list] | None = None

    def result(self) -> ModelRunnerOutput:
        output = self._output
        if self._packed is None:
            return output
        if self._ready is not None:
            from tokenmill.worker.model_runner import _wait_for

            _wait_for(self._ready)
        rows = self._packed.tolist()
        self._packed = None
        width = len(rows[0]) - 2 if rows else 0
        wants_logprobs = self._result.logprobs is not None and self._metadata is not None
        if wants_logprobs:
            self._logprobs = tuple(t.tolist() for t in self._result.logprobs)  # type: ignore[union-attr]
            output.logprobs = []
        verified: dict[str, tuple[int, int]] = {}  # request id -> (drafts, accepted)
        first_row = 0
        for state, drafts, row in zip(self._states, self._drafts, rows, strict=True):
            num_accepted, bad = row[width], row[width + 1]
            request_rows = first_row
            first_row += len(drafts) + 1
            if bad:
                output.errored[state.request_id] = "the model produced non-finite (NaN or inf) logits for this request"
                continue
            tokens = row[: num_accepted + 1]
            state.token_ids.extend(tokens)
            state.num_tokens = len(state.token_ids)
            output.req_ids.append(state.request_id)
            output.sampled_token_ids.append(tokens)
            verified[state.request_id] = (len(drafts), num_accepted)
            if wants_logprobs:
                output.logprobs.append(self._logprob_rows(request_rows, tokens))  # type: ignore[union-attr]
        if self._on_result is not None:
            self._on_result(output, verified)
        return output

    def _logprob_rows(self, first_row: int, tokens: list[int]) -> list[TokenLogprobs] | None:
        """The logprobs of a request's emitted tokens (its rows from `first_row`), if it asked."""
        assert self._metadata is not None and self._logprobs is not None
        k = self._metadata.num_logprobs[first_row]
        if k is None:
            return None
        token_lp, rank, top_ids, top_lps = self._logprobs
        return [
            TokenLogprobs([token, *top_ids[row][:k]], [token_lp[row], *top_lps[row][:k]], rank[row])
            for row, token in enumerate(tokens, start=first_row)
        ]


class Speculator:
    """Proposes each step's drafts once its tokens are on the host."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        disable = disable_by_batch_size(config.disable_by_batch_size, runner.device.type)
        self.policy = DraftPolicy(self.k, disable, config.min_acceptance_rate)
        self.max_model_len = runner.max_model_len
        self.ngram: NgramProposer | None = None
        # A proposer that runs a model (draft_model, eagle3): its own KV cache on the target's blocks.
        self.draft_model: DraftModelProposer | None = None
        if config.method == "ngram":
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "draft_model":
            self.draft_model = DraftModelProposer(config, runner)
        else:
            from tokenmill.worker.eagle3_proposer import Eagle3Proposer

            self.draft_model = Eagle3Proposer(config, runner)  # type: ignore[assignment]
        logger.info(
            "speculative decoding: %s, up to %d drafts per request, none above %d requests in a step",
            config.method, self.k, disable,
        )  # fmt: skip

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a request's scheduled tokens that proposing writes (a draft model's)."""
        return self.draft_model.num_lookahead_tokens if self.draft_model is not None else 0

    @property
    def needs_aux_hidden_states(self) -> bool:
        """EAGLE-3: the target's forward must keep its aux hidden states."""
        return getattr(self.draft_model, "needs_aux_hidden_states", False)

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        """The target layers whose input the drafter reads (EAGLE-3), for the CUDA graphs to keep."""
        if not self.needs_aux_hidden_states:
            return None
        return tuple(self.draft_model.aux_layers)  # type: ignore[union-attr]

    def keep_step_aux(self, batch: HostBatch, aux) -> None:  # noqa: ANN001 - a tensor
        """EAGLE-3: bind the target's aux hidden states of a CUDA graph replay to the step's host
        batch, for `after_step` to find them (an eager `target_forward` binds its own)."""
        self.draft_model.keep_step_aux(batch, aux)  # type: ignore[union-attr]

    def target_forward(self, input_ids, positions, kv_caches, meta, batch: HostBatch):  # noqa: ANN001, ANN201 - tensors
        return self.draft_model.target_forward(input_ids, positions, kv_caches, meta, batch)  # type: ignore[union-attr]

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)

    def after_step(
        self,
        output: ModelRunnerOutput,
        requests: list[RequestState],
        step_starts: list[int],
        step_lens: list[int],
        verified: dict[str, tuple[int, int]] | None,
        batch: HostBatch | None = None,
    ) -> None:
        """Record the step's acceptance and propose the next drafts of the requests that sampled.
        `requests`, `step_starts`, `step_lens`: the step's requests (batch order), the first position
        each computed and how many; `verified`: request id -> (drafts, accepted) of this step."""
        policy = self.policy
        if verified:
            for request_id, (num_drafts, num_accepted) in verified.items():
                policy.record(request_id, num_drafts, num_accepted)
        wanted: dict[str, int] = {}
        if policy.drafting_allowed(len(requests)):
            sampled = set(output.req_ids)
            for state in requests:
                if state.request_id in sampled and drafts_allowed(state):
                    k = min(policy.num_drafts(state.request_id), self.max_model_len - len(state.token_ids))
                    if k > 0:
                        wanted[state.request_id] = k
        if self.draft_model is not None:
            # Also with nothing wanted: the drafter's cache follows every position the target computed.
            output.spec_token_ids = self.draft_model.propose(requests, step_starts, step_lens, wanted, batch)
            return
        assert self.ngram is not None
        proposals: dict[str, list[int]] = {}
        states = {state.request_id: state for state in requests}
        for request_id, k in wanted.items():
            proposal = self.ngram.propose(states[request_id].token_ids, k)
            if proposal:
                proposals[request_id] = proposal
        output.spec_token_ids = proposals
