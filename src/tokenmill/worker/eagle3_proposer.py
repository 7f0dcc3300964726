"""The `eagle3` proposer: an EAGLE-3 drafter (model/eagle3.py) reading the target's hidden states.

The target runs its forward with `forward_with_aux_hidden_states` (the residual stream entering
three of its layers, concatenated). After each step, with its tokens on the host:

1. the drafter runs over the rows of the step whose next token is known: row p takes the token at
   p + 1 and the target's features at p, and writes the drafter's one-layer KV at p (its own cache
   over the target's block tables). For a verifying request those are the rows up to its last
   accepted draft (the last one's next token is the one the target added), for a prefill chunk
   all its rows. At each drafting request's last row it predicts the first draft;
2. k - 1 single-row steps follow, each feeding the previous draft and the drafter's own hidden
   state, one position further.

Drafts are the drafter's greedy tokens mapped from its vocabulary to the target's (d2t). Drafter
KV past the accepted tokens is rewritten by the next round's first pass, which starts at the
target's next step start. Decode and verification steps replay CUDA graphs that keep the aux
hidden states as a second output (worker/cuda_graphs.py); steps with prefill chunks run the
target eagerly (`target_forward`). Either way the states are bound to the step's host batch
(`keep_step_aux`), which `propose` gets back. The drafter itself runs eagerly; its k - 1 single-row
steps are each fed the previous draft on the device (draft_proposer.draft_on_device), so they queue
back to back with one copy of the drafts to the host at the end.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.worker.batch_inputs import HostBatch, build_host_batch
from tokenmill.worker.draft_proposer import (
    DrafterKVCache,
    DraftView,
    collect_drafts,
    draft_on_device,
    feed_input_ids,
)
from tokenmill.worker.request_state import RequestState

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Steps whose aux hidden states wait for their tokens: one in flight and one being finished with
# async scheduling; more only if steps fail before `propose` runs.
MAX_STEPS_KEPT = 4


class Eagle3Proposer(DrafterKVCache):
    needs_aux_hidden_states = True
    num_kv_layers = 1  # the drafter's one decoder layer

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        from tokenmill.model.eagle3 import load_eagle3_drafter
        from tokenmill.model.eagle3_config import Eagle3Config
        from tokenmill.model.loader.hf_config import read_hf_config
        from tokenmill.model.resolve import locate_model_dir

        assert config.model is not None
        self.runner = weakref.proxy(runner)
        self.k = config.num_speculative_tokens
        if runner.kv_groups.num_groups > 1:
            raise ValueError("speculative method 'eagle3' needs a target without sliding-window layers")
        path = locate_model_dir(config.model, config.revision, runner.config.model.download_dir)
        drafter_config = Eagle3Config.from_hf_config(read_hf_config(path), runner.arch)
        self.aux_layers = drafter_config.aux_layer_ids
        self.arch = drafter_config.arch
        self.attn_backend = runner.make_attention_backend(runner.config.attention_backend, self.arch)
        self.drafter = load_eagle3_drafter(
            path, runner.model, runner.device, runner.dtype, self.attn_backend, kernel=runner.config.kernel
        )
        self.kv_caches: list[torch.Tensor] = []
        # The target's aux hidden states by step (keyed by the id of the step's host batch, which
        # `propose` gets back): with async scheduling the next step's forward runs before this
        # step's tokens come back, so one slot would hand `propose` the wrong step's states.
        self._aux_by_step: OrderedDict[int, tuple[HostBatch, torch.Tensor]] = OrderedDict()
        logger.info(
            "EAGLE-3 drafter %s: aux layers %s, draft vocabulary %d",
            config.model, self.aux_layers, drafter_config.draft_vocab_size,
        )  # fmt: skip

    def target_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta,
        batch: HostBatch,
    ) -> torch.Tensor:
        """The target's eager forward for the step of host batch `batch`, keeping its aux hidden
        states for `propose`."""
        hidden, aux = self.runner.model.forward_with_aux_hidden_states(
            input_ids, positions, kv_caches, meta, self.aux_layers
        )
        self.keep_step_aux(batch, aux)
        return hidden

    def keep_step_aux(self, batch: HostBatch, aux: torch.Tensor) -> None:
        """Bind the aux hidden states of the step whose host batch is `batch` to it (from its eager
        forward or its CUDA graph replay). At most MAX_STEPS_KEPT steps are kept (a step that
        failed never comes back to `propose`)."""
        self._aux_by_step[id(batch)] = (batch, aux)  # the batch itself too: its id stays unique
        while len(self._aux_by_step) > MAX_STEPS_KEPT:
            self._aux_by_step.popitem(last=False)

    @torch.inference_mode()
    def propose(
        self,
        states: list[RequestState],
        step_starts: list[int],
        step_lens: list[int],
        num_drafts: dict[str, int],
        batch: HostBatch | None = None,
    ) -> dict[str, list[int]]:
        kept = self._aux_by_step.pop(id(batch), None) if batch is not None else None
        if kept is None:
            return {}
        aux = kept[1]
        runner = self.runner
        views: list[DraftView] = []
        lens: list[int] = []
        rows: list[np.ndarray] = []
        for i, (state, start, length) in enumerate(zip(states, step_starts, step_lens, strict=True)):
            # Rows whose next token is known: up to the last accepted one (a verify step), the whole
            # chunk otherwise.
            num_rows = max(min(length, len(state.token_ids) - 1 - start), 0)
            shifted = DraftView(state.request_id, state.token_ids[1:], state.block_ids, len(state.token_ids) - 1)
            views.append(shifted)
            lens.append(num_rows)
            first = int(batch.query_start_loc[i])
            rows.append(np.arange(first, first + num_rows))
        keep = [i for i, n in enumerate(lens) if n > 0]
        if not keep:
            return {}
        first_batch = build_host_batch(
            [views[i] for i in keep], [step_starts[i] for i in keep], [lens[i] for i in keep],  # type: ignore[misc]
            runner.block_size,
        )
        row_index = torch.from_numpy(np.concatenate([rows[i] for i in keep])).to(aux.device)
        proposing = [
            j for j, i in enumerate(keep)
            if num_drafts.get(states[i].request_id, 0) > 0 and step_starts[i] + lens[i] == len(states[i].token_ids) - 1
        ]  # fmt: skip
        # Most drafts first: each later step's requests are a prefix (draft_on_device). The rows'
        # index goes to the device before the drafter's first pass, while the device is idle.
        proposing.sort(key=lambda j: -num_drafts[states[keep[j]].request_id])
        rows_of = [int(first_batch.query_start_loc[j + 1]) - 1 for j in proposing]
        last_rows = torch.tensor(rows_of, dtype=torch.long, device=aux.device) if proposing else None
        input_ids, positions, meta = runner.build_metadata(first_batch)
        drafter = self.drafter
        out = drafter(input_ids, positions, aux[row_index], self.kv_caches[0], meta)
        if last_rows is None:
            return {}
        hidden = out.hidden_out[last_rows]
        next_ids = drafter.greedy_draft_tokens(out.normed[last_rows])
        drafting = [views[keep[j]] for j in proposing]  # their token lists are copies (a slice): drafts go on them
        wanted = [num_drafts[v.request_id] for v in drafting]

        def decode_step(step_views: list[DraftView], ids: torch.Tensor) -> torch.Tensor:
            """One single-row step of the first len(step_views) drafting requests, fed their previous
            draft (on the device) and the drafter's own hidden state."""
            nonlocal hidden
            n = len(step_views)
            step_batch = build_host_batch(
                step_views, [len(v.token_ids) - 1 for v in step_views], [1] * n,  # type: ignore[arg-type]
                runner.block_size,
            )
            input_ids, positions, meta = runner.build_metadata(step_batch)
            feed_input_ids(input_ids, ids)
            out = drafter(input_ids, positions, hidden[:n], self.kv_caches[0], meta)
            # The requests drafting at a later step are a prefix of these: their rows are all it reads.
            hidden = out.hidden_out
            return drafter.greedy_draft_tokens(out.normed)

        return collect_drafts(drafting, wanted, draft_on_device(next_ids, drafting, wanted, decode_step))
