"""Multi-LoRA in the engine: chunked prefill, preemption, the prefix cache keyed by adapter, more
adapters than device slots, the host cache, bad adapters and failed loads (offline LLM, CPU, fp32)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from tests.lora_adapters import greedy_tokens, merged_model, write_peft_adapter
from tokenmill import SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    return [write_peft_adapter(tiny_llama_dir, root / f"ad{i}", seed=20 + i, r=8) for i in range(4)]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(10, 900) for _ in range(rng.randint(20, 40))] for _ in range(8)]


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, adapter_dirs, prompts):
    """Greedy tokens of each prompt under each adapter (and None: the base), from transformers."""
    expected = {}
    for adapter in [None, *adapter_dirs]:
        model = merged_model(tiny_llama_dir, adapter)
        for i, prompt in enumerate(prompts):
            expected[(adapter, i)] = greedy_tokens(model, prompt, GREEDY.max_tokens)
    return expected


def _llm(model_dir, **kwargs):
    from tokenmill import LLM

    options = dict(device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    options.update(kwargs)
    return LLM(str(model_dir), **options)


def _loras(adapter_dirs):
    return [LoRARequest(f"ad{i}", i + 1, str(path)) for i, path in enumerate(adapter_dirs)]


def _token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_chunks_preemption_and_more_adapters_than_slots(tiny_llama_dir, adapter_dirs, prompts, oracle):
    """Eight requests over three adapters and the base in a pool too small for all: prompts are
    chunked, requests preempted and resumed, and a step never holds more than two adapters."""
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=32, num_kv_blocks=14, block_size=8, max_loras=2)
    loras = _loras(adapter_dirs)
    per_prompt = [loras[i % 3] if i % 4 else None for i in range(len(prompts))]
    outputs = llm.generate(_token_prompts(prompts), GREEDY, lora_request=per_prompt)
    assert llm.engine.get_stats()["num_preemptions_total"] > 0
    for i, (lora, out) in enumerate(zip(per_prompt, outputs, strict=True)):
        adapter = None if lora is None else adapter_dirs[lora.lora_int_id - 1]
        assert list(out.outputs[0].token_ids) == oracle[(adapter, i)], (i, lora)
    manager = llm.engine.executor.driver_runner.lora
    assert manager.num_slot_loads >= 3  # three adapters through two slots
    llm.engine.check_invariants()


def test_prefix_cache_is_keyed_by_adapter(tiny_llama_dir, adapter_dirs, prompts, oracle):
    llm = _llm(tiny_llama_dir, block_size=8)
    a, b = _loras(adapter_dirs)[:2]
    prompt = _token_prompts(prompts[:1])
    first = llm.generate(prompt, GREEDY, lora_request=a)[0]
    same = llm.generate(prompt, GREEDY, lora_request=a)[0]
    other = llm.generate(prompt, GREEDY, lora_request=b)[0]
    base = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens > 0  # the same adapter reuses its blocks
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0  # others never do
    assert list(other.outputs[0].token_ids) == oracle[(adapter_dirs[1], 0)]
    assert list(base.outputs[0].token_ids) == oracle[(None, 0)]
    # A reload under the same name is a new id: none of the old load's blocks.
    llm.engine.remove_lora(a.lora_int_id)
    reloaded = LoRARequest(a.lora_name, 99, str(adapter_dirs[2]))
    out = llm.generate(prompt, GREEDY, lora_request=reloaded)[0]
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == oracle[(adapter_dirs[2], 0)]
    llm.engine.check_invariants()


def test_host_cache_evicts_and_reloads(tiny_llama_dir, adapter_dirs, prompts, oracle):
    """max_cpu_loras=2 with four adapters: evicted ones are read from disk again when needed."""
    llm = _llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2)
    loras = _loras(adapter_dirs)
    for round_ in range(2):
        for i, lora in enumerate(loras):
            out = llm.generate(_token_prompts(prompts[i : i + 1]), GREEDY, lora_request=lora)[0]
            assert list(out.outputs[0].token_ids) == oracle[(adapter_dirs[i], i)], (round_, i)
    manager = llm.engine.executor.driver_runner.lora
    assert len(manager._host) <= 2
    assert manager.num_loads > len(loras)  # some were evicted and loaded again
    llm.engine.check_invariants()


def test_lora_leaves_greedy_base_output_unchanged(tiny_llama_dir, prompts):
    """Base-model requests on an engine with LoRA on equal an engine with LoRA off."""
    from tokenmill import LLM

    plain = LLM(str(tiny_llama_dir), device="cpu", dtype="float32").generate(_token_prompts(prompts), GREEDY)
    with_lora = _llm(tiny_llama_dir).generate(_token_prompts(prompts), GREEDY)
    for a, b in zip(plain, with_lora, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_logprobs_close_to_merged_transformers(tiny_llama_dir, adapter_dirs, prompts):
    import torch

    llm = _llm(tiny_llama_dir)
    lora = _loras(adapter_dirs)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    out = llm.generate(_token_prompts(prompts[:1]), params, lora_request=lora)[0].outputs[0]
    model = merged_model(tiny_llama_dir, adapter_dirs[0])
    ids = list(prompts[0]) + list(out.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)
    for step, token in enumerate(out.token_ids):
        ours = out.logprobs[step][token].logprob
        theirs = expected[len(prompts[0]) - 1 + step, token].item()
        assert abs(ours - theirs) < 1e-3, (step, ours, theirs)


def test_bad_adapters_are_refused_with_the_reason(tiny_llama_dir, qwen_like_adapter, tmp_path, adapter_dirs):
    llm = _llm(tiny_llama_dir)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapter_dirs[0], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    too_big = tmp_path / "rank16"
    shutil.copytree(adapter_dirs[0], too_big)
    config = json.loads((too_big / "adapter_config.json").read_text())
    config["r"] = 16
    (too_big / "adapter_config.json").write_text(json.dumps(config))
    unknown_module = tmp_path / "lm_head"
    shutil.copytree(adapter_dirs[0], unknown_module)
    config = json.loads((unknown_module / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    (unknown_module / "adapter_config.json").write_text(json.dumps(config))
    cases = {
        corrupt: "not a readable safetensors file",
        too_big: "r = 16",
        unknown_module: "lm_head",
        qwen_like_adapter: "another base model",
        tmp_path / "missing": "is not a directory",
    }
    for i, (path, message) in enumerate(cases.items()):
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(["hello"], GREEDY, lora_request=LoRARequest(f"bad{i}", 50 + i, str(path)))
    # Nothing was added; the engine serves the base and a good adapter as before.
    good = llm.generate(["hello"], GREEDY, lora_request=_loras(adapter_dirs)[0])[0]
    assert len(good.outputs[0].token_ids) == GREEDY.max_tokens
    llm.engine.check_invariants()


@pytest.fixture
def qwen_like_adapter(tiny_qwen3_dir, tmp_path):
    """An adapter of another base model (other shapes)."""
    return write_peft_adapter(tiny_qwen3_dir, tmp_path / "other_base", seed=5, r=8)


def test_a_load_that_fails_in_the_engine_fails_only_its_requests(tiny_llama_dir, adapter_dirs, tmp_path, prompts, oracle):
    """An adapter that passed the checks but whose file is gone when the engine reads it: its
    requests end with an error naming it; the others in the same batch finish normally."""
    llm = _llm(tiny_llama_dir)
    doomed_dir = tmp_path / "doomed"
    shutil.copytree(adapter_dirs[1], doomed_dir)
    doomed = LoRARequest("doomed", 77, str(doomed_dir))
    llm._lora_requests(doomed, 1)  # checked and handed to the engine, which loads it on its thread
    manager = llm.engine.executor.driver_runner.lora
    manager.remove_lora(doomed.lora_int_id)  # forget the load, so the next request reads the files again
    shutil.rmtree(doomed_dir)
    good = _loras(adapter_dirs)[0]
    outputs = llm.generate(_token_prompts(prompts[:2]), GREEDY, lora_request=[doomed, good])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert list(outputs[1].outputs[0].token_ids) == oracle[(adapter_dirs[0], 1)]
    llm.engine.check_invariants()


def test_lora_request_needs_lora_enabled(tiny_llama_dir, adapter_dirs):
    from tokenmill import LLM

    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32")
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate(["hi"], GREEDY, lora_request=_loras(adapter_dirs)[0])


def test_host_kv_tier_is_keyed_by_adapter(tiny_llama_dir, adapter_dirs, prompts, oracle):
    """--kv-offload-gb: blocks evicted from the device come back from the host tier only for the
    adapter that computed them (the adapter is in the block hashes)."""
    llm = _llm(tiny_llama_dir, block_size=8, max_model_len=64, num_kv_blocks=12, kv_offload_gb=64 * 4096 / 2**30)
    a, b = _loras(adapter_dirs)[:2]
    target = _token_prompts(prompts[:1])
    llm.generate(target, GREEDY, lora_request=a)
    for filler in prompts[1:4]:  # base-model prompts that push the target's blocks out of the device
        llm.generate(_token_prompts([filler]), GREEDY)
    assert llm.engine.get_stats()["kv_offload_blocks_stored"] > 0
    other = llm.generate(target, GREEDY, lora_request=b)[0]
    assert other.num_cached_tokens == 0  # adapter a's blocks are not adapter b's
    assert list(other.outputs[0].token_ids) == oracle[(adapter_dirs[1], 0)]
    hits_before = llm.engine.get_stats()["kv_offload_hits"]
    for filler in prompts[4:7]:
        llm.generate(_token_prompts([filler]), GREEDY)
    again = llm.generate(target, GREEDY, lora_request=a)[0]
    assert llm.engine.get_stats()["kv_offload_hits"] > hits_before  # from the host tier
    assert again.num_cached_tokens > 0
    assert list(again.outputs[0].token_ids) == oracle[(adapter_dirs[0], 0)]
    llm.engine.check_invariants()
