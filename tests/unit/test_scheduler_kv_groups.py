"""The scheduler over KV cache groups (sliding-window layers), with the fake runner of
test_scheduler.py: it writes every group's slots and reads back, per group, what attention reads
(a sliding group: only the window of the step's first query). On top, after every step, each
scheduled request's blocks in a sliding group are bounded by the window, not by its length."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler import (
    Harness,
    make_request,
    reference_output,
    request_specs,
    scheduler_configs,
    spec_request,
)
from tokenmill.core.kv_cache_groups import KVCacheGroups, max_live_sliding_blocks, plan_kv_cache_groups

MISTRAL_LIKE = plan_kv_cache_groups(2, (8, 8))
GEMMA2_LIKE = plan_kv_cache_groups(4, (8, None, 8, None))
GEMMA3_LIKE = plan_kv_cache_groups(6, (8, 8, 8, 8, 8, None))  # 5:1, one full group and five sliding


class BoundedHarness(Harness):
    """Harness whose every step checks the sliding groups' live blocks against the window bound."""

    def __init__(self, kv_cache_groups: KVCacheGroups, **kwargs: object) -> None:
        super().__init__(kv_cache_groups=kv_cache_groups, **kwargs)  # type: ignore[arg-type]
        self.max_live: dict[int, int] = {}  # per group: the most blocks one request held in it

    def step(self):  # noqa: ANN201 - the harness's outputs
        outputs = super().step()
        so = self.steps[-1]
        kv = self.scheduler.kv
        for request_id, num_new in so.num_scheduled_tokens.items():
            if not kv.has_blocks(request_id):
                continue  # finished with this step
            for group, (window, live) in enumerate(zip(kv.windows, kv.num_live_blocks(request_id), strict=True)):
                self.max_live[group] = max(self.max_live.get(group, 0), live)
                if window is not None:
                    bound = max_live_sliding_blocks(window, kv.block_size, num_new)
                    assert live <= bound, f"{request_id} holds {live} blocks in group {group}, bound {bound}"
        return outputs


@pytest.mark.parametrize("plan", [MISTRAL_LIKE, GEMMA2_LIKE, GEMMA3_LIKE], ids=["mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_long_requests_hold_window_bounded_blocks(plan: KVCacheGroups, async_mode: bool) -> None:
    # Prompts of 5-8 windows, chunked by a budget of 12 tokens, then 40 tokens of decode.
    h = BoundedHarness(plan, num_blocks=200, block_size=4, max_num_batched_tokens=12, async_mode=async_mode)
    prompts = {f"r{i}": [(7 * i + k) % 97 for k in range(40 + 8 * i)] for i in range(3)}
    for request_id, prompt in prompts.items():
        h.add(make_request(request_id, prompt, max_tokens=40))
    h.run()
    for request_id, prompt in prompts.items():
        assert h.tokens[request_id] == reference_output(prompt, 40, 256), request_id
    kv = h.scheduler.kv
    for group, window in enumerate(kv.windows):
        if window is None:
            assert h.max_live[group] >= (40 + 16 + 40 - 1) // 4  # full groups grow with the sequence
        else:
            assert h.max_live[group] <= max_live_sliding_blocks(window, 4, 12)
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.usage == 0


@pytest.mark.parametrize(
    ("plan", "num_blocks"), [(MISTRAL_LIKE, 12), (GEMMA2_LIKE, 26)], ids=["mistral", "gemma2"]
)
def test_preemption_with_sliding_groups_keeps_outputs_identical(plan: KVCacheGroups, num_blocks: int) -> None:
    prompts = {f"r{i}": [(11 * i + k) % 97 for k in range(20 + 3 * i)] for i in range(4)}
    # Chunks of 8 tokens: prefills hold several blocks of their window at once (whole-prompt chunks
    # would mostly wait for room instead: a sliding group rarely needs a block it does not free).
    h = BoundedHarness(
        plan, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    for request_id, prompt in prompts.items():
        h.add(make_request(request_id, prompt, max_tokens=24))
    h.run()
    assert h.scheduler.num_preemptions_total > 0
    for request_id, prompt in prompts.items():
        assert h.tokens[request_id] == reference_output(prompt, 24, 256), request_id
    assert h.scheduler.kv.num_free_blocks == h.scheduler.kv.num_usable_blocks


@pytest.mark.parametrize("plan", [MISTRAL_LIKE, GEMMA2_LIKE, GEMMA3_LIKE], ids=["mistral", "gemma2", "gemma3"])
def test_prefix_hit_across_groups_skips_the_shared_prefix(plan: KVCacheGroups) -> None:
    h = BoundedHarness(plan, num_blocks=200, block_size=4)
    prefix = [(5 * k + 1) % 97 for k in range(37)]
    h.add(make_request("first", [*prefix, 1, 2], max_tokens=30))  # 30 decodes: early blocks slide out
    h.run()
    later = h.add(make_request("later", [*prefix, 3], max_tokens=5))
    h.step()
    # 36 tokens (9 full blocks of the shared 37) need no computing, in every group.
    assert later.num_cached_tokens == 36 and h.steps[-1].num_scheduled_tokens == {"later": 2}
    h.run()
    assert h.tokens["later"] == reference_output([*prefix, 3], 5, 256)
    assert h.finals["later"].num_cached_tokens == 36


# (window per layer): 1-4 layers, each full or sliding by 1-16 tokens.
layer_windows = st.lists(st.one_of(st.none(), st.integers(1, 16)), min_size=1, max_size=4)


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=scheduler_configs, windows=layer_windows, specs=st.lists(request_specs, min_size=1, max_size=8))
def test_random_workloads_over_random_groups(
    async_mode: bool, config: dict, windows: list[int | None], specs: list[tuple]
) -> None:
    plan = plan_kv_cache_groups(len(windows), windows)
    num_blocks = config["num_blocks"] + (1 if plan.has_sliding else 0)  # the null block
    if num_blocks < 2 and plan.has_sliding:
        return
    h = BoundedHarness(plan, **{**config, "num_blocks": num_blocks}, async_mode=async_mode)
    requests = [h.add(spec_request(f"r{i}", spec)) for i, spec in enumerate(specs)]
    h.run(max_steps=5000)
    max_model_len, block_size = config["max_model_len"], config["block_size"]
    budget = config["max_num_batched_tokens"]
    for request in requests:
        final = h.finals[request.request_id]
        prompt_len, max_tokens = request.num_prompt_tokens, request.max_tokens
        assert max_tokens is not None
        final_len = min(prompt_len + max_tokens, max_model_len)
        positions_needed = max(final_len - 1, prompt_len)  # the last token is sampled, never computed
        # Alone in the pool it never holds more than this: then it must complete.
        fits = prompt_len <= max_model_len and (
            plan.blocks_for_one_sequence(positions_needed, block_size, budget) <= num_blocks
        )
        if final.finish_reason == "length":
            assert h.tokens[request.request_id] == reference_output(
                request.prompt_token_ids, max_tokens, max_model_len
            )
        else:
            assert not fits, (request, final)
            assert final.finish_reason == "error" and final.error
    h.scheduler.check_invariants()
    assert h.scheduler.kv.num_free_blocks == h.scheduler.kv.num_usable_blocks
