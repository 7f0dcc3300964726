"""The `draft_model` proposer: a smaller model with the same tokenizer guesses the next k tokens.

The drafter has its own weights and its own KV cache tensors, but shares the target's block
tables: block b of a request holds the same positions in both caches, so the scheduler's
allocation (with `k` lookahead slots past each decoding request's tokens) covers both. After each
target step, with the step's tokens on the host:

1. catch-up: the drafter runs over the tokens the target computed this step plus the token the
   step produced (a request's positions from its step start up to its newest token), which writes
   its KV there and gives, at each request's newest token, its first draft;
2. k - 1 single-token steps, each fed the previous draft on the device, give the rest
   (`draft_on_device`): the drafts go to the host in one copy at the end, not one per step.

Positions past the accepted tokens hold drafter KV of rejected guesses; the next catch-up starts
at the target's step start, which is never past them, and writes them again. The catch-up runs
for every step, also when no request drafts (a large batch), so the drafter's cache never misses
a position the target computed; prefix-cache hits reuse blocks whose drafter KV was written when
they were computed. Drafts are the drafter's argmax: the verification treats them as deterministic
proposals, which keeps the target's distribution for sampled requests too.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenmill.config import ModelConfig, SpeculativeConfig
from tokenmill.worker.batch_inputs import HostBatch, build_host_batch
from tokenmill.worker.kv_cache import allocate_kv_caches, kv_bytes_per_block
from tokenmill.worker.request_state import RequestState

if TYPE_CHECKING:
    from tokenmill.model.arch import ArchConfig
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class DraftView:
    """What build_host_batch reads of a request, with draft tokens appended to its tokens."""

    request_id: str
    token_ids: list[int]
    block_ids: list[list[int]]
    num_tokens: int


class DrafterKVCache:
    """What a proposer that runs a model keeps beside the target: its own KV cache over the
    target's block tables (the pool is sized for both), written up to k - 1 positions past a
    request's newest token (the scheduler's lookahead slots).

    The runner owns its proposer, so the proposer holds the runner through a weak proxy
    (`weakref.proxy`, ReferenceError once it is gone): a strong reference back would put both in
    a cycle, and a dropped engine's KV pool and weights would wait for a full garbage collection."""

    runner: ModelRunner  # a weakref.proxy
    arch: ArchConfig
    k: int
    num_kv_layers: int
    kv_caches: list[torch.Tensor]

    @property
    def num_lookahead_tokens(self) -> int:
        return self.k

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(
            self.num_kv_layers, self.runner.block_size, self.arch.num_kv_heads, self.arch.head_dim,
            self.runner.kv_cache_dtype,
        )  # fmt: skip

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.num_kv_layers, num_blocks, self.runner.block_size, self.arch.num_kv_heads,
            self.arch.head_dim, self.runner.kv_cache_dtype, self.runner.device,
        )  # fmt: skip


class DraftModelProposer(DrafterKVCache):
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        from tokenmill.model.registry import load_model
        from tokenmill.model.resolve import resolve_model

        assert config.model is not None
        self.runner = weakref.proxy(runner)
        self.k = config.num_speculative_tokens
        target = runner.config.model
        model_config = ModelConfig(
            model=config.model,
            revision=config.revision,
            download_dir=target.download_dir,
            dtype=target.dtype,
            # Dummy target weights (benchmarks): the drafter is dummy too (same seed, same shapes:
            # the target itself as its own drafter accepts everything).
            load_format="dummy" if target.load_format == "dummy" else "auto",
            max_model_len=runner.max_model_len,
            seed=target.seed,
        )
        self.resolved = resolve_model(model_config)
        arch = self.resolved.arch
        if runner.kv_groups.num_groups > 1 or arch.sliding_windows:
            raise ValueError(
                "speculative method 'draft_model' needs a target and a drafter without sliding-window "
                "layers (their KV caches share one block table); use method 'ngram'"
            )
        if arch.max_position_embeddings < runner.max_model_len:
            raise ValueError(
                f"the drafter {config.model} handles {arch.max_position_embeddings} positions, fewer than "
                f"max_model_len={runner.max_model_len}; lower --max-model-len or pick another drafter"
            )
        target_vocab = runner.arch.vocab_size
        if abs(arch.vocab_size - target_vocab) > 1024:
            raise ValueError(
                f"the drafter's vocabulary ({arch.vocab_size} tokens) is not the target's ({target_vocab}): "
                "a draft model must share the target's tokenizer"
            )
        self.target_vocab_size = target_vocab
        self.arch = arch
        self.num_kv_layers = arch.num_layers
        self.attn_backend = runner.make_attention_backend(runner.config.attention_backend, arch)
        self.model = load_model(
            model_config, arch, runner.device, runner.dtype, self.attn_backend, resolved=self.resolved,
            kernel=runner.config.kernel,
        )  # fmt: skip
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None  # CudaGraphRunner of its single-token steps (CUDA)
        self.piecewise = None  # PiecewiseGraphs of its catch-up passes (CUDA)
        logger.info(
            "draft model %s: %d layers, hidden %d (%s)", config.model, arch.num_layers, arch.hidden_size,
            self.resolved.format,
        )  # fmt: skip

    def capture_cuda_graphs(self, max_drafting_batch: int) -> None:
        """The drafter's CUDA graphs: its single-token steps up to the largest batch that drafts,
        and piecewise graphs for its catch-up passes (a few tokens per request), as the target's."""
        from tokenmill.worker.cuda_graphs import CudaGraphRunner

        runner = self.runner
        if not self.attn_backend.supports_cuda_graphs or runner.buffers is None:
            return
        self.graphs = CudaGraphRunner(
            self.model, self.attn_backend, runner.buffers, self.kv_caches,
            min(max_drafting_batch, runner.config.scheduler.max_num_seqs),
        )  # fmt: skip
        self.graphs.capture()
        if runner.config.kernel.piecewise_cuda_graphs and getattr(self.model, "supports_piecewise_graphs", False):
            from tokenmill.worker.piecewise_graphs import PiecewiseGraphs

            self.piecewise = PiecewiseGraphs(
                self.model, self.attn_backend, runner.buffers, self.kv_caches,
                runner.config.scheduler.max_num_batched_tokens,
            )  # fmt: skip
            self.piecewise.capture()

    def _forward(self, batch, input_ids_on_device: torch.Tensor | None = None) -> torch.Tensor:  # noqa: ANN001 - a HostBatch
        """The drafter's final hidden states of a step: a piecewise graph when captured, else eager.
        `input_ids_on_device`: the step's input ids, already on the device (they replace the
        batch's own, placeholders)."""
        runner = self.runner
        num_tokens = len(batch.input_ids)
        size = self.piecewise.padded_size(num_tokens) if self.piecewise is not None else None
        if size is not None:
            input_ids, _, meta = runner.build_metadata(batch, padded_tokens=size)
            feed_input_ids(input_ids, input_ids_on_device)
            return self.piecewise.run(size, num_tokens, meta)[:num_tokens]
        input_ids, positions, meta = runner.build_metadata(batch)
        feed_input_ids(input_ids, input_ids_on_device)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _decode_step(self, views: list[DraftView], input_ids: torch.Tensor) -> torch.Tensor:
        """One token for each of `views`, whose newest token (a placeholder in its token_ids) is
        `input_ids[i]` on the device, through a CUDA graph when one fits: the argmax ids
        [len(views)], on the device."""
        runner = self.runner
        key = self.graphs.graph_key(len(views), 1) if self.graphs is not None else None
        positions = [len(v.token_ids) - 1 for v in views]
        if key is None:
            batch = build_host_batch(views, positions, [1] * len(views), runner.block_size)  # type: ignore[arg-type]
            return self._argmax(self._forward(batch, input_ids))
        batch = build_host_batch(
            views, positions, [1] * len(views), runner.block_size,  # type: ignore[arg-type]
            block_table_width=runner.max_blocks_per_req,
        )  # fmt: skip
        staged, _, _ = runner.build_metadata(batch, padded_reqs=key[0])
        feed_input_ids(staged, input_ids)
        logits = self.graphs.replay(key)[: len(views)]
        return logits[:, : self.target_vocab_size].argmax(dim=-1)

    @torch.inference_mode()
    def propose(
        self,
        states: list[RequestState],
        step_starts: list[int],
        step_lens: list[int],
        num_drafts: dict[str, int],
        batch: HostBatch | None = None,
    ) -> dict[str, list[int]]:
        """Catch the drafter up on the step's tokens and propose `num_drafts[request]` drafts for
        the requests named there. `step_starts` / `step_lens`: per request of the step (batch
        order), the first position the target computed and how many. (`batch`, the target's step,
        is what EAGLE-3 reads its rows from; a plain drafter rebuilds its own.)"""
        runner = self.runner
        starts: list[int] = []
        lens: list[int] = []
        for state, start, length in zip(states, step_starts, step_lens, strict=True):
            # Up to the newest token: the target's accepted run plus the token it added. A prefill
            # chunk short of the prompt's end added none (more prompt follows): just the chunk,
            # whose blocks are all the scheduler allocated.
            known_after = len(state.token_ids) - start
            lens.append(known_after if known_after <= length + 1 else length)
            starts.append(start)
        batch = build_host_batch(states, starts, lens, runner.block_size)  # type: ignore[arg-type]
        proposing = [
            i for i, s in enumerate(states) if num_drafts.get(s.request_id, 0) > 0 and starts[i] + lens[i] == len(s.token_ids)
        ]
        # Most drafts first: each later step's requests are a prefix (draft_on_device). The rows'
        # index goes to the device before the forward, while the device is idle.
        proposing.sort(key=lambda i: -num_drafts[states[i].request_id])
        rows = [int(batch.query_start_loc[i + 1]) - 1 for i in proposing]
        last_rows = torch.tensor(rows, dtype=torch.long, device=runner.device) if proposing else None
        hidden = self._forward(batch)
        if last_rows is None:
            return {}
        next_ids = self._argmax(hidden[last_rows])
        views = [
            DraftView(states[i].request_id, list(states[i].token_ids), states[i].block_ids, len(states[i].token_ids))
            for i in proposing
        ]
        wanted = [num_drafts[v.request_id] for v in views]
        return collect_drafts(views, wanted, draft_on_device(next_ids, views, wanted, self._decode_step))

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        return logits[:, : self.target_vocab_size].argmax(dim=-1)


def feed_input_ids(staged: torch.Tensor, input_ids: torch.Tensor | None) -> None:
    """Put input ids that are on the device (the previous draft's argmax) over the staged ones."""
    if input_ids is not None:
        staged[: len(input_ids)].copy_(input_ids)


PLACEHOLDER = 0  # a draft's token id on the host until the drafts come back (the device has the real one)


def draft_on_device(
    first_ids: torch.Tensor,
    views: list[DraftView],
    wanted: list[int],
    decode_step: Callable[[list[DraftView], torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """The drafter's single-token steps, each fed the previous step's argmax on the device rather
    than through the host (a step's positions and slots follow from lengths alone; its token is a
    placeholder on the host), so no step waits for the one before. `wanted[j]`: how many drafts
    view j wants, most first, so that the views still drafting at every step are a prefix (plain
    slices on the device, no index copied from the host); `first_ids`: their first drafts;
    `decode_step(views, their input ids)` runs one step of the first len(views) views. Returns
    the per-step ids [len(views)] (rows past a view's wanted count: garbage)."""
    if any(a < b for a, b in zip(wanted, wanted[1:], strict=False)):
        raise ValueError(f"draft counts must come most first, got {wanted}")
    per_step = [first_ids]
    next_ids = first_ids
    for step in range(1, max(wanted, default=0)):
        n = sum(1 for k in wanted if k > step)  # the views that want more than `step` drafts
        for view in views[:n]:
            view.token_ids.append(PLACEHOLDER)
            view.num_tokens += 1
        step_ids = decode_step(views[:n], next_ids[:n])
        full = torch.zeros(len(views), dtype=step_ids.dtype, device=step_ids.device)
        full[:n] = step_ids
        per_step.append(full)
        next_ids = full
    return per_step


def collect_drafts(views: list[DraftView], wanted: list[int], per_step: list[torch.Tensor]) -> dict[str, list[int]]:
    """The drafts on the host, in one copy: view j's first wanted[j] ids."""
    rows = torch.stack(per_step, dim=1).tolist()
    return {view.request_id: row[:k] for view, row, k in zip(views, rows, wanted, strict=True)}
