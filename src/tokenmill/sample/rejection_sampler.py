"""Verifying draft tokens: which of a request's k drafts the target model keeps, and one more token.

A verification step gives each sampling request k + 1 logits rows: the row of its last known token
and one per draft (k = 0 for a request with no drafts: one row, plain sampling). Row i scores the
token after draft i - 1, so draft i is judged at row i, and the first draft that fails ends the run:
the request gets its accepted drafts plus one token from the row of the first failure (or, when all
k pass, from the last row: the bonus token). Everything stays on the device; the caller brings the
packed result to the host with one copy.

- Greedy rows keep a draft while it equals the argmax of the processed logits, and emit the argmax:
  exactly the tokens non-speculative greedy decoding gives.
- Random rows use the accept / residual rule of Leviathan et al. (2023) with the draft treated as
  deterministic (every proposer here proposes one token, q = 1 on it): accept draft x with probability
  p(x); on rejection sample from p with x removed (max(p - q, 0), renormalised). The emitted token is
  distributed exactly as p, the distribution the plain sampler draws from (temperature, top-k, top-p,
  min-p, logits processors included). A request's own generator draws its uniforms and noise, so a
  seeded request is reproducible whatever else shares the batch.

Requests whose sampling reads their earlier output (penalties, min_tokens, bad words) are given no
drafts by the proposers: their processed logits would depend on the drafts before each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler, exponential_race, gather_logprobs


@dataclass(slots=True)
class VerifyLayout:
    """Where each request's rows are: host lists turned into device index tensors once per step."""

    num_drafts: list[int]  # per sampling request, in row order
    draft_of_row: torch.Tensor  # [N] int64: the draft judged at each row, -1 on a request's last row
    padded_rows: torch.Tensor  # [R, K + 1] int64: request j's row i, padded with its last row
    valid: torch.Tensor  # [R, K + 1] bool: i <= num_drafts[j]

    @staticmethod
    def build(
        drafts: list[list[int]], device: torch.device, staging: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> VerifyLayout:
        """`staging`: a (pinned host, device) pair of int64 buffers to copy through (the runner's,
        reused step after step: allocating pinned memory per step costs more than the step); None:
        fresh tensors."""
        num_drafts = [len(d) for d in drafts]
        num_reqs = len(drafts)
        width = max(num_drafts, default=0) + 1
        lengths = np.asarray(num_drafts, dtype=np.int64)
        first_row = np.zeros(num_reqs, dtype=np.int64)
        np.cumsum(lengths[:-1] + 1, out=first_row[1:])
        last_row = first_row + lengths
        num_rows = int(last_row[-1]) + 1 if num_reqs else 0
        draft_of_row = np.full(num_rows, -1, dtype=np.int64)
        if num_rows > num_reqs:
            flat = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(lengths.sum()))
            draft_starts = np.cumsum(lengths) - lengths  # each request's first draft in `flat`
            draft_rows = np.repeat(first_row - draft_starts, lengths) + np.arange(len(flat))
            draft_of_row[draft_rows] = flat
        offsets = np.arange(width, dtype=np.int64)
        padded = np.minimum(first_row[:, None] + offsets, last_row[:, None])
        valid = offsets[None, :] <= lengths[:, None]
        packed = np.concatenate([draft_of_row, padded.ravel(), valid.ravel().astype(np.int64)])
        if staging is not None and packed.size <= staging[0].numel():
            host, dev = staging[0][: packed.size], staging[1][: packed.size]
            host.numpy()[:] = packed
            dev.copy_(host, non_blocking=True)
        else:
            dev = torch.from_numpy(packed).to(device)
        grid = num_reqs * width
        return VerifyLayout(
            num_drafts,
            dev[:num_rows],
            dev[num_rows : num_rows + grid].view(num_reqs, width),
            dev[num_rows + grid :].view(num_reqs, width).bool(),
        )


@dataclass(slots=True)
class VerifyResult:
    # [R, K + 3] int64 on the device: the emitted tokens of each request's rows (K + 1 columns),
    # then the number of accepted drafts, then a non-finite-logits flag.
    packed: torch.Tensor
    # Per row, when some row asked for logprobs: (token logprob, rank, top ids, top logprobs).
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def verify_drafts(
    logits: torch.Tensor, layout: VerifyLayout, md: SamplingMetadata | None, nonfinite: torch.Tensor | None = None
) -> VerifyResult:
    """`logits` [N, V]: the rows of `layout` in order; `md`: one entry per row (a request's row
    infos repeat, sharing its generator), or None when every row is plain greedy (the argmax of the
    raw logits, no logprobs). `nonfinite` [N] bool: the model's non-finite rows when the caller
    masked the logits first (a grammar's -inf); None: computed here."""
    if nonfinite is None:
        nonfinite = ~torch.isfinite(logits.sum(dim=-1))
    draft = layout.draft_of_row
    has_draft = draft >= 0
    safe_draft = draft.clamp(min=0)
    if md is None or md.all_greedy:
        # Greedy: a draft is kept while it is the argmax; every row emits its argmax.
        emitted = (logits if md is None else Sampler.processed_logits(logits.float(), md)).argmax(dim=-1)
        accepted = emitted == draft
    else:
        processed = Sampler.processed_logits(logits.float(), md)
        probs = Sampler.random_probs(processed, md)
        p_draft = probs.gather(1, safe_draft.unsqueeze(1)).squeeze(1)
        accepted = has_draft & (_uniforms(probs.shape[0], md, probs.device) < p_draft)
        # The residual for a deterministic draft: p without the draft token. (The race draws from
        # unnormalised weights; a row whose residual is all zero had p(x) = 1 and always accepts.)
        residual = torch.where(
            has_draft.unsqueeze(1),
            probs.scatter(1, safe_draft.unsqueeze(1), 0.0),
            probs,
        )
        emitted = torch.where(accepted, safe_draft, exponential_race(residual, md.generators))
        if md.greedy_mask is not None:
            greedy_ids = processed.argmax(dim=-1)
            accepted = torch.where(md.greedy_mask, greedy_ids == draft, accepted)
            emitted = torch.where(md.greedy_mask, greedy_ids, emitted)
    accepted = accepted & has_draft
    rows = layout.padded_rows
    # The run of accepted drafts from the first one: a cumulative product along the row positions.
    num_accepted = (accepted[rows] & layout.valid).long().cumprod(dim=1).sum(dim=1)
    bad = (nonfinite[rows] & layout.valid).any(dim=1)
    packed = torch.cat([emitted[rows], num_accepted.unsqueeze(1), bad.long().unsqueeze(1)], dim=1)
    logprobs = None
    if md is not None and md.max_num_logprobs is not None:
        raw = torch.log_softmax(logits.float(), dim=-1)
        logprobs = gather_logprobs(raw, emitted, md.max_num_logprobs)
    return VerifyResult(packed, logprobs)


def _uniforms(num_rows: int, md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """U[0, 1) per row; rows of a seeded request draw from its generator, in row order."""
    u = torch.rand(num_rows, device=device) if len(md.generators) < num_rows else torch.empty(num_rows, device=device)
    for row, generator in sorted(md.generators.items()):
        u[row : row + 1].uniform_(generator=generator)
    return u
