"""The Ray executor on a local Ray cluster: the same workers as Ray actors in a placement group give
transformers' greedy tokens, and a killed actor turns the engine dead (an error, not a hang)."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import SMALL_ENGINE
from tests.distributed.test_tensor_parallel import PROMPTS, assert_greedy_equals_hf
from tokenmill import LLM, SamplingParams
from tokenmill.errors import EngineDeadError

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tokenmill[ray]')")


@pytest.mark.slow
def test_ray_actors_run_tensor_parallel_steps_and_a_lost_actor_ends_the_engine(tp_qwen2_dir):
    path = str(tp_qwen2_dir)
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **SMALL_ENGINE)
    executor = llm.engine.executor
    try:
        assert type(executor).__name__ == "RayExecutor"
        assert_greedy_equals_hf(llm, path, PROMPTS)
        ray.kill(executor._actors[1])
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate(
                {"prompt_token_ids": PROMPTS[0]},
                SamplingParams(temperature=0.0, max_tokens=4),
                use_tqdm=False,
            )
    finally:
        llm.shutdown()
    assert not ray.is_initialized(), "the local Ray cluster the engine started outlived it"
