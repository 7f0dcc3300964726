"""The executor and client seams: the engine core runs its steps through an Executor, the offline
LLM reaches its core through an InprocClient, and both frontends fan n > 1 out the same way."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.executor import Executor
from tokenmill.engine.executor.uniproc import UniProcExecutor
from tokenmill.engine.fanout import fan_out
from tokenmill.engine.llm import LLM
from tokenmill.sampling_params import SamplingParams


def test_n_children_get_their_own_ids_and_consecutive_seeds():
    children = fan_out("r", SamplingParams(n=3, seed=5, max_tokens=4))
    assert [(c.index, c.request_id) for c in children] == [(0, "r-0"), (1, "r-1"), (2, "r-2")]
    assert [c.params.seed for c in children] == [5, 6, 7] and all(c.params.n == 1 for c in children)
    assert [c.params.seed for c in fan_out("u", SamplingParams(n=2))] == [None, None]


def test_one_sequence_is_the_request_itself():
    params = SamplingParams(seed=9)
    [child] = fan_out("r", params)
    assert child == (0, "r", params)


def test_one_process_engines_get_the_uniproc_executor():
    assert Executor.get_class(EngineConfig(device="cpu")) is UniProcExecutor


def test_the_llm_steps_its_core_through_the_executor_and_an_inprocess_client(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    assert isinstance(llm.engine.executor, UniProcExecutor)
    assert llm.engine.runner is llm.engine.executor.driver_runner
    assert (llm.info.device, llm.info.dtype) == ("cpu", "float32")
    assert llm.client.engine_core is llm.engine
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, n=2, seed=1))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert llm.client.call_utility("check_invariants")["num_running"] == 0
    with pytest.raises(ValueError, match="unknown utility method"):
        llm.client.call_utility("reboot")
