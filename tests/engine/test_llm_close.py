"""Freeing an offline LLM: `close()`, `with LLM(...)`, and `del llm` with no garbage collection.

An engine used to sit in reference cycles (EngineCore <-> its structured-output manager's bound
tokenizer loader, a drafter <-> its model runner, the free-block queue's doubly linked blocks),
so a dropped LLM kept its KV pool (1 GiB on the CPU by default) and weights until a full
collection. These tests run with the collector off and watch the KV tensors, the weights and the
engine core through weak references: they must go when the last reference does.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import LLMClosedError
from tokenmill.sampling_params import StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = ["the quick brown fox", "hello world hello world"]


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The cyclic collector off: what dies here dies by reference counting alone."""
    gc.collect()  # earlier tests' garbage is not this test's
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _llm(model_dir, **overrides) -> LLM:
    return LLM(str(model_dir), **({"device": "cpu", "max_model_len": 128} | overrides))


def _watch(llm: LLM) -> dict[str, weakref.ref]:
    """Weak references to what holds memory: the engine core, the runner, its KV tensors and model."""
    runner = llm.engine.runner
    watched = {
        "engine": weakref.ref(llm.engine),
        "runner": weakref.ref(runner),
        "model": weakref.ref(runner.model),
    }
    watched |= {f"kv[{i}]": weakref.ref(t) for i, t in enumerate(runner.kv_cache_tensors)}
    drafter = runner.speculator.draft_model if runner.speculator is not None else None
    if drafter is not None:
        watched["drafter model"] = weakref.ref(drafter.model)
        watched |= {f"drafter kv[{i}]": weakref.ref(t) for i, t in enumerate(drafter.kv_caches)}
    return watched


def _alive(watched: dict[str, weakref.ref]) -> list[str]:
    return [name for name, ref in watched.items() if ref() is not None]


def _greedy(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain"),
        pytest.param({"async_scheduling": True}, id="async-scheduling"),
        pytest.param({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, id="ngram"),
        pytest.param("draft_model", id="draft-model"),
    ],
)
def test_del_frees_the_engine_without_gc(tiny_llama_dir, no_gc, options) -> None:
    if options == "draft_model":
        options = {
            "speculative_config": {
                "method": "draft_model",
                "model": str(tiny_llama_dir),
                "num_speculative_tokens": 2,
            }
        }
    llm = _llm(tiny_llama_dir, **options)
    assert all(_greedy(llm))
    watched = _watch(llm)
    del llm
    assert _alive(watched) == []


def test_del_frees_a_structured_output_engine_without_gc(tiny_llama_dir, no_gc) -> None:
    llm = _llm(tiny_llama_dir)
    choice = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    texts = [out.outputs[0].text for out in llm.generate(PROMPTS, choice)]
    assert set(texts) <= {"yes", "no"}  # the grammar ran (its manager and compile threads are up)
    watched = _watch(llm)
    del llm
    assert _alive(watched) == []


def test_close_frees_while_the_llm_is_still_referenced(tiny_llama_dir, no_gc) -> None:
    llm = _llm(tiny_llama_dir)
    assert all(_greedy(llm))
    watched = _watch(llm)
    llm.close()
    assert llm.closed
    assert _alive(watched) == []
    llm.close()  # idempotent
    llm.shutdown()  # the older name, the same


def test_close_releases_the_memory_even_while_the_engine_is_held(tiny_llama_dir, no_gc) -> None:
    llm = _llm(tiny_llama_dir)
    watched = _watch(llm)
    engine = llm.engine  # e.g. a benchmark that kept it
    llm.close()
    assert _alive(watched) == ["engine", "runner"]  # the KV pool and the weights are gone anyway
    engine.shutdown()  # idempotent too
    del engine
    assert _alive(watched) == []


def test_a_closed_llm_refuses_every_call(tiny_llama_dir) -> None:
    from tokenmill.engine.llm import stream_generate

    llm = _llm(tiny_llama_dir)
    llm.close()
    calls = {
        "generate": lambda: llm.generate(PROMPTS, GREEDY),
        "chat": lambda: llm.chat([{"role": "user", "content": "hello"}], GREEDY),
        "stream_generate": lambda: list(stream_generate(llm, "hello", GREEDY)),
        "engine": lambda: llm.engine,
        "with": lambda: llm.__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(LLMClosedError, match="this LLM is closed"):
            call()
        assert name  # every call was tried
    assert llm.get_tokenizer() is not None  # what needs no engine still answers


def test_with_block_closes_and_generation_inside_is_unchanged(tiny_llama_dir) -> None:
    reference = _llm(tiny_llama_dir)
    expected = _greedy(reference)
    reference.close()
    with _llm(tiny_llama_dir) as llm:
        assert _greedy(llm) == expected
        llm.engine.check_invariants()
        kv = llm.engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_usable_blocks  # no block leaked
    assert llm.closed
    with pytest.raises(LLMClosedError):
        llm.generate(PROMPTS, GREEDY)


def test_with_block_closes_when_its_body_raises(tiny_llama_dir) -> None:
    with pytest.raises(KeyError, match="raised inside"), _llm(tiny_llama_dir) as llm:
        watched = _watch(llm)
        raise KeyError("raised inside")
    assert llm.closed
    runner = watched["runner"]()
    assert runner is None or (runner.model is None and runner.kv_cache_tensors == [])  # released either way


FIRST_LLM_SCRIPT = """
import gc, sys, weakref
gc.disable()
from tokenmill import LLM
assert "torch" not in sys.modules  # the LLM below imports it

def build():
    llm = LLM(sys.argv[1], device="cpu", max_model_len=128, num_kv_blocks=16)
    return llm, weakref.ref(llm.engine.runner.kv_cache_tensors[0])

llm, kv = build()
del llm
print("kv alive" if kv() is not None else "kv freed")
"""


def test_the_first_llm_of_a_process_is_freed_on_del(tiny_llama_dir) -> None:
    # Importing torch leaves a self-referencing frame (torch.fx.wrap's) that holds every frame on
    # the importing stack: the LLM that imports it, and a function that returns it, would outlive
    # `del llm` unless the import runs off their stack. Only a fresh process imports torch here.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FIRST_LLM_SCRIPT, str(tiny_llama_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "kv freed"


def test_generate_freezes_the_collector_only_while_it_runs(tiny_llama_dir) -> None:
    """`generate` keeps the model and engine out of the collector's walks while it runs
    (engine/gc_frozen.py) and gives them back after, also when it raises; output is unchanged."""
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects for good; generate leaves those alone")
    llm = _llm(tiny_llama_dir)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert gc.get_freeze_count() == 0
    seen: list[int] = []
    get_output = llm.client.get_output

    def recording_get_output():
        seen.append(gc.get_freeze_count())
        return get_output()

    llm.client.get_output = recording_get_output  # type: ignore[method-assign]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0

    def failing_get_output():
        raise RuntimeError("boom")

    llm.client.get_output = failing_get_output  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(PROMPTS, GREEDY)
    assert gc.get_freeze_count() == 0
    llm.close()


def test_generate_leaves_objects_someone_else_froze_frozen(tiny_llama_dir) -> None:
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects for good")
    llm = _llm(tiny_llama_dir)
    gc.freeze()  # as the serving engine process does after start-up
    try:
        llm.generate(PROMPTS, GREEDY)
        # Still frozen (an unfreeze would have emptied the permanent generation; the count itself
        # falls by the frozen objects that died meanwhile).
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        llm.close()
