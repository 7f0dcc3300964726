"""A tensor-parallel LLM dropped without close(): its workers end when the last reference goes.

The workers hold the devices' memory, so an engine that outlived `del llm` (the LoRA hooks used to
hold their executor, a cycle) or an executor that died without stopping them kept that memory
until the process exited. The collector is off here: reference counting alone must do it.
"""

from __future__ import annotations

import gc
import subprocess
import weakref

from tests.distributed.conftest import SMALL_ENGINE
from tokenmill import LLM, SamplingParams


def _start(path: str) -> tuple[LLM, weakref.ref, list[subprocess.Popen]]:
    llm = LLM(path, tensor_parallel_size=2, enable_lora=True, **SMALL_ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids) == 4
    executor = llm.engine.executor
    assert type(executor).__name__ == "MultiprocExecutor"
    return llm, weakref.ref(executor), list(executor._processes)


def test_dropped_tp_llm_ends_its_workers_without_gc(tp_qwen2_dir):
    gc.collect()
    gc.disable()
    try:
        llm, executor, workers = _start(str(tp_qwen2_dir))
        assert all(p.poll() is None for p in workers)
        del llm
        assert executor() is None
        for process in workers:  # shutdown() waited for them: they are gone already
            assert process.poll() is not None, f"worker {process.pid} outlived its dropped LLM"
    finally:
        gc.enable()
        for process in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
