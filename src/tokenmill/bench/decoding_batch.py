"""A batch of requests brought to steady decode, for the profiles that time one decode step
(benchmarks/profile_decode.py on the GPU, benchmarks/profile_cpu_decode.py on the CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM


def add_requests(llm: LLM, batch: int, input_len: int, output_len: int, tag: str) -> list[str]:
    """`batch` greedy requests of random `input_len`-token prompts that generate `output_len` tokens."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    ids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        prompt = rng.integers(100, llm.info.vocab_size, size=input_len).tolist()
        llm.engine.add_request(llm.input_processor.make_request(rid, prompt, params))
        ids.append(rid)
    return ids


def step_until_decoding(llm: LLM, batch: int) -> None:
    """Step the engine until all `batch` requests run and every prompt is computed."""
    for _ in range(1000):
        llm.engine.step()
        running = llm.engine.scheduler.running
        if len(running) == batch and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
            return
    raise RuntimeError("requests never all reached decode")
