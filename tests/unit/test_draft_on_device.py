"""The drafting loop of the model drafters (worker/draft_proposer.draft_on_device): each step is
fed the previous step's ids on the device, the views still drafting are a prefix, and the drafts
come back in one copy, each view's first wanted[j]."""

from __future__ import annotations

import pytest
import torch

from tokenmill.worker.draft_proposer import PLACEHOLDER, DraftView, collect_drafts, draft_on_device


def _views(n: int) -> list[DraftView]:
    return [DraftView(f"r{i}", [10 + i], [[0]], 1) for i in range(n)]


def test_each_step_gets_the_previous_ids_of_the_views_still_drafting():
    views = _views(3)
    wanted = [4, 2, 1]
    calls = []

    def decode_step(step_views, ids):
        calls.append(([v.request_id for v in step_views], ids.tolist(), [list(v.token_ids) for v in step_views]))
        return ids * 10 + 1  # a "drafter" whose next id follows from the one it is fed

    first = torch.tensor([1, 2, 3])
    drafts = collect_drafts(views, wanted, draft_on_device(first, views, wanted, decode_step))
    assert [c[0] for c in calls] == [["r0", "r1"], ["r0"], ["r0"]]
    assert [c[1] for c in calls] == [[1, 2], [11], [111]]
    # The host holds a placeholder where each fed draft goes: positions follow from lengths alone.
    assert calls[0][2] == [[10, PLACEHOLDER], [11, PLACEHOLDER]]
    assert calls[2][2] == [[10, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]]
    assert drafts == {"r0": [1, 11, 111, 1111], "r1": [2, 21], "r2": [3]}


def test_draft_counts_must_come_most_first():
    with pytest.raises(ValueError, match="most first"):
        draft_on_device(torch.tensor([1, 2]), _views(2), [1, 3], lambda views, ids: ids)
