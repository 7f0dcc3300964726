"""A serving-like mix of steps driven through an offline engine, for start-up warm-up checks.

`num_decodes` greedy requests with ~600-token prompts decode while new 512-token prompts arrive,
with a one-token prompt, a prefix-cache hit, short prompts and a sampled request among them; then a
one-token prompt and a wholly cached prompt alone (decode-only steps of one request that no
whole-step graph takes). benchmarks/warmup_compiles.py times it and tests/gpu/test_kernel_warmup_gpu.py
asserts that it compiles no kernel after start-up.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


def run_mixed_workload(llm: Any, num_decodes: int = 40, seed: int = 0, step: Callable[[], list] | None = None) -> int:
    """Runs the workload on `llm` (a tokenmill.LLM) with `step` (default: its engine's) doing each
    engine step; returns the number of steps."""
    from tokenmill import SamplingParams

    rng = random.Random(seed)
    vocab = llm.info.vocab_size
    engine = llm.engine
    step = step or engine.step

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    def add(request_id: str, tokens: list[int], max_tokens: int, **params: Any) -> None:
        params.setdefault("temperature", 0.0)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
        engine.add_request(llm.input_processor.make_request(request_id, tokens, sampling))

    for i in range(num_decodes):
        add(f"long-{i}", prompt(rng.randint(560, 640)), rng.randint(120, 160))
    decoding: set[str] = set()
    steps = 0
    while len(decoding) < num_decodes:
        decoding.update(out.request_id for out in step() if out.new_token_ids)
        steps += 1
    first_new, second_new = prompt(512), prompt(512)
    arrivals = {
        0: [("new-0", first_new, 16, {})],
        2: [("one-token", prompt(1), 8, {})],
        4: [("new-1", second_new, 16, {})],
        6: [("prefix-hit", first_new + prompt(7), 8, {})],  # a 7-token chunk after the cached 512
        8: [("new-2", prompt(512), 16, {})],
        10: [(f"short-{n}", prompt(n), 8, {}) for n in (2, 5, 9, 17, 33)],
        12: [("sampled", prompt(300), 12, {"temperature": 0.8, "top_p": 0.9, "seed": 1})],
        14: [("new-3", prompt(512), 16, {}), ("new-4", prompt(520), 16, {})],
    }
    tick = 0
    while engine.has_work() or tick <= max(arrivals):
        for request_id, tokens, max_tokens, params in arrivals.get(tick, []):
            add(request_id, tokens, max_tokens, **params)
        tick += 1
        step()
        steps += 1
    for request_id, tokens in (("lone-token", prompt(1)), ("cached", second_new)):
        add(request_id, tokens, 4)
        while engine.has_work():
            step()
            steps += 1
    return steps
