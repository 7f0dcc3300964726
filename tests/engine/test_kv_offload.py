"""The host-memory KV tier (--kv-offload-gb) end to end on the CPU: a device pool small enough
that a multi-turn workload's earlier conversations are evicted, so their second turns hit blocks
copied back from the host tier. Greedy output must equal transformers' (fp32) and the output
without the tier, cached-token accounting must include the host hits, and every block and host
slot must be accounted for at the end."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.engine.hf_oracle import hf_greedy
from tests.engine.sliding_window_checkpoints import write_sliding_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import RequestOutput
from tokenmill.worker.kv_connector.host_tier import HostKVTierWorker

NUM_CONVERSATIONS = 8
PROMPT_LEN = 64  # 4 blocks of 16
MAX_NEW = 6
NUM_DEVICE_BLOCKS = 24  # 384 tokens: the 8 first turns (5 blocks each) do not all fit
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # tiny llama: 2 layers, K+V, 16 tokens, 2 heads of 16, fp32
HOST_GB = 64 * BYTES_PER_BLOCK / 2**30  # 64 host blocks


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _turns(
    llm: LLM, vocab_size: int, before_second_turn: Callable[[], None] | None = None
) -> tuple[list[list[int]], list[RequestOutput], list[RequestOutput]]:
    """Two turns of every conversation (each turn's requests together): the second turn's prompts
    and each turn's outputs."""
    rng = random.Random(7)
    first = [[rng.randrange(5, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(NUM_CONVERSATIONS)]
    outs1 = llm.generate([{"prompt_token_ids": p} for p in first], PARAMS)
    second = [
        p + o.outputs[0].token_ids + [rng.randrange(5, vocab_size) for _ in range(10)]
        for p, o in zip(first, outs1, strict=True)
    ]
    if before_second_turn is not None:
        before_second_turn()
    return second, outs1, llm.generate([{"prompt_token_ids": p} for p in second], PARAMS)


def _multi_turn(llm: LLM, vocab_size: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The second turn's prompts, all outputs, and the second turn's cached tokens."""
    second, outs1, outs2 = _turns(llm, vocab_size)
    outputs = [o.outputs[0].token_ids for o in outs1 + outs2]
    return second, outputs, [o.num_cached_tokens for o in outs2]


@pytest.fixture(scope="module")
def without_tier(tiny_llama_dir) -> tuple[list[list[int]], list[list[int]], list[int]]:
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=256, num_kv_blocks=NUM_DEVICE_BLOCKS)
    result = _multi_turn(llm, llm.info.vocab_size)
    assert "kv_offload_hits" not in llm.engine.get_stats()
    return result


def _wait_for_all_layers_first(connector: HostKVTierWorker, monkeypatch) -> None:  # noqa: ANN001
    """Every layer's copies before the forward (what a whole-step CUDA graph replay gets), instead of
    each at its layer's hook."""
    start = connector.start_load_kv

    def start_and_wait(metadata) -> None:  # noqa: ANN001
        start(metadata)
        connector.wait_for_load()

    monkeypatch.setattr(connector, "start_load_kv", start_and_wait)


@pytest.mark.parametrize(
    ("async_scheduling", "per_layer"), [(False, True), (True, True), (False, False)],
    ids=["sync", "async", "sync-wait-all"],
)  # fmt: skip
def test_rehits_from_the_host_tier_keep_greedy_output(
    tiny_llama_dir, without_tier, monkeypatch, async_scheduling: bool, per_layer: bool
) -> None:
    path = str(tiny_llama_dir)
    llm = LLM(
        path, device="cpu", max_model_len=256, num_kv_blocks=NUM_DEVICE_BLOCKS, kv_offload_gb=HOST_GB,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    if not per_layer:
        _wait_for_all_layers_first(llm.engine.runner.kv_connector, monkeypatch)
    second, outputs, cached = _multi_turn(llm, llm.info.vocab_size)
    base_second, base_outputs, base_cached = without_tier
    assert second == base_second
    assert outputs == base_outputs, "the host tier changed greedy output"
    for prompt, output in zip(second, outputs[NUM_CONVERSATIONS:], strict=True):
        assert output == hf_greedy(path, prompt, MAX_NEW)[0]
    stats = llm.engine.get_stats()
    assert stats["kv_offload_blocks_stored"] > 0
    assert stats["kv_offload_hits"] > 0, "no second turn was served from the host tier"
    # The host hits are counted as cached prompt tokens (usage.prompt_tokens_details.cached_tokens);
    # the tier's counter also has the hits of requests resuming after a preemption, which report
    # the cached tokens of their first admission.
    gained = sum(cached) - sum(base_cached)
    assert 0 < gained <= stats["kv_offload_hits"]
    assert all(c % 16 == 0 and c <= len(p) - 1 for c, p in zip(cached, second, strict=True))
    assert stats["kv_offload_bytes"] <= stats["kv_offload_capacity_bytes"] == 64 * BYTES_PER_BLOCK
    # Every device block free (or evictable), every host slot held or free, nothing pending.
    llm.engine.check_invariants()
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    connector = llm.engine.runner.kv_connector
    assert isinstance(connector, HostKVTierWorker)
    assert connector.host_bytes == 64 * BYTES_PER_BLOCK
    if per_layer:  # every layer's copies ran when the forward reached it (the attention layers' hooks)
        assert connector.layers_waited_in_forward > 0 and connector.layers_waited_at_once == 0
    else:
        assert connector.layers_waited_in_forward == 0 and connector.layers_waited_at_once > 0


def sequential_rehits(path: str, **llm_kwargs: object) -> tuple[list[list[int]], list[tuple[int, int]], LLM]:
    """Three conversations one at a time, as in benchmarks/kv_offload.py: each first turn (10 blocks)
    pushes the earlier ones out of the device pool (tail first, over one or more steps), then each
    second turn alone. All outputs, and per second turn (host->device copy calls, block-layers loaded)."""
    llm = LLM(path, max_model_len=256, num_kv_blocks=NUM_DEVICE_BLOCKS, **llm_kwargs)  # type: ignore[arg-type]
    rng = random.Random(5)
    first = [[rng.randrange(5, llm.info.vocab_size) for _ in range(160)] for _ in range(3)]
    tokens = [llm.generate([{"prompt_token_ids": p}], PARAMS)[0].outputs[0].token_ids for p in first]
    connector = llm.engine.runner.kv_connector
    loads = []
    for prompt, answer in zip(first, list(tokens), strict=True):
        before = (connector.load_calls, connector.block_layers_loaded) if connector is not None else (0, 0)
        tokens.append(llm.generate([{"prompt_token_ids": prompt + answer + [7, 8, 9]}], PARAMS)[0].outputs[0].token_ids)
        if connector is not None:
            loads.append((connector.load_calls - before[0], connector.block_layers_loaded - before[1]))
    llm.engine.check_invariants()
    return tokens, loads, llm


def check_one_copy_per_layer(loads: list[tuple[int, int]], connector: HostKVTierWorker) -> None:
    layers = connector.num_layers
    hits = [(calls, moved) for calls, moved in loads if moved]
    assert hits, "no second turn loaded from the host tier"
    for calls, moved in hits:
        assert moved >= 4 * layers  # at least 4 blocks per layer came back ...
        assert calls == layers  # ... in one copy per layer (it was one per block and layer)
    assert 4 * connector.save_calls <= connector.block_layers_saved  # saves: runs of blocks too


def test_a_rehit_of_a_prefix_evicted_whole_loads_in_one_copy_per_layer(tiny_llama_dir) -> None:
    """A second turn loads its whole prefix back from slots handed out as one run (its blocks were
    evicted tail first, so listed in block order their slots descend): one host->device copy per
    layer, and greedy output as without the tier."""
    without, _, _ = sequential_rehits(str(tiny_llama_dir), device="cpu")
    outputs, loads, llm = sequential_rehits(str(tiny_llama_dir), device="cpu", kv_offload_gb=HOST_GB)
    assert outputs == without, "the host tier changed greedy output"
    connector = llm.engine.runner.kv_connector
    assert isinstance(connector, HostKVTierWorker)
    check_one_copy_per_layer(loads, connector)


def test_models_with_sliding_window_layers_are_refused(tmp_path, tiny_tokenizer) -> None:
    path = write_sliding_checkpoint(tmp_path / "mistral", "mistral", tiny_tokenizer)
    with pytest.raises(ValueError, match="needs a model without sliding-window layers"):
        LLM(str(path), device="cpu", max_model_len=256, num_kv_blocks=64, kv_offload_gb=0.01)


def test_a_tier_too_small_for_one_block_is_refused(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match=f"holds no KV block of {BYTES_PER_BLOCK} bytes"):
        LLM(str(tiny_llama_dir), device="cpu", max_model_len=256, num_kv_blocks=64, kv_offload_gb=1e-9)


def test_an_fp8_kv_cache_round_trips_through_the_host_tier(tiny_llama_dir) -> None:
    """The tier copies raw bytes: an fp8 (e4m3) cache comes back exactly, so the output with the
    tier equals the output without it."""
    results = []
    for gb in (0, HOST_GB / 4):  # fp8: a quarter of the fp32 block
        llm = LLM(
            str(tiny_llama_dir), device="cpu", max_model_len=256, num_kv_blocks=NUM_DEVICE_BLOCKS,
            kv_cache_dtype="fp8", kv_offload_gb=gb,
        )  # fmt: skip
        results.append(_multi_turn(llm, llm.info.vocab_size))
        llm.engine.check_invariants()
    assert results[1][1] == results[0][1]
    assert llm.engine.get_stats()["kv_offload_hits"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_load_mid_forward_ends_its_step_and_leaks_nothing(
    tiny_llama_dir, without_tier, monkeypatch, async_scheduling: bool
) -> None:
    """A host-tier copy that fails at layer 1 of a step that loads (after layer 0 ran): the step's
    requests end with the error, every device block and host slot is accounted for, the tier forgets
    what the step would have saved, and the same prompts asked again get the right tokens."""
    path = str(tiny_llama_dir)
    llm = LLM(
        path, device="cpu", max_model_len=256, num_kv_blocks=NUM_DEVICE_BLOCKS, kv_offload_gb=HOST_GB,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    connector = llm.engine.runner.kv_connector
    assert isinstance(connector, HostKVTierWorker)
    real_copy = connector._copy_layer
    armed, faults = [], []

    def copy_layer(layer, step) -> None:  # noqa: ANN001 - the worker's own types
        if armed and not faults and step.loads.blocks is not None and layer == 1:
            faults.append(layer)
            raise RuntimeError("injected host-tier load fault")
        real_copy(layer, step)

    monkeypatch.setattr(connector, "_copy_layer", copy_layer)
    # Armed for the second turn, whose re-hits load (the first turn's preempted requests may too).
    second, outs1, outs2 = _turns(llm, llm.info.vocab_size, before_second_turn=lambda: armed.append(True))
    assert faults, "no second-turn step loaded from the host tier"
    failed = [i for i, o in enumerate(outs2) if o.outputs[0].finish_reason == "error"]
    assert failed and all("injected host-tier load fault" in (outs2[i].error or "") for i in failed)
    base_second, base_outputs, _ = without_tier
    assert second == base_second
    expected = base_outputs[NUM_CONVERSATIONS:]
    for i, out in enumerate(outs2):
        if i not in failed:
            assert out.outputs[0].token_ids == expected[i]
    llm.engine.check_invariants()
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert connector._step is None, "the failed step's copies outlived it"
    again = llm.generate([{"prompt_token_ids": second[i]} for i in failed], PARAMS)
    assert [o.outputs[0].token_ids for o in again] == [expected[i] for i in failed]
    llm.engine.check_invariants()
