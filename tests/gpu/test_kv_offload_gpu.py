"""The host KV tier (--kv-offload-gb) on a CUDA GPU: pinned host pool, copies on a side stream with an
event per layer, each layer's compute waiting for its own copies (worker/kv_connector/host_tier.py).

A device pool too small for a multi-turn workload evicts earlier conversations' blocks to the host;
their second turns load them back, a prefix evicted whole in one copy per layer. Greedy output (fp32) with the tier equals the output without it
and transformers', loads happened, and every layer of a step with copies was waited for inside the
forward (eagerly and through piecewise CUDA graphs); nothing is left pending or leaked.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy
from tests.engine.test_kv_offload import HOST_GB as SEQUENTIAL_HOST_GB
from tests.engine.test_kv_offload import check_one_copy_per_layer, sequential_rehits
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_connector_metadata import HostTierMetadata
from tokenmill.worker.kv_connector.host_tier import HostKVTierWorker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

CONVERSATIONS, PROMPT_LEN, MAX_NEW = 8, 64, 6
DEVICE_BLOCKS = 24  # 384 tokens: the 8 first turns (5 blocks each) do not all fit
HOST_GB = 0.01


def _multi_turn(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Second-turn prompts and every output (first turns, then second turns)."""
    rng = random.Random(11)
    vocab = llm.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = [[rng.randrange(5, vocab) for _ in range(PROMPT_LEN)] for _ in range(CONVERSATIONS)]
    outs1 = llm.generate([{"prompt_token_ids": p} for p in first], params)
    second = [
        p + o.outputs[0].token_ids + [rng.randrange(5, vocab) for _ in range(10)]
        for p, o in zip(first, outs1, strict=True)
    ]
    outs2 = llm.generate([{"prompt_token_ids": p} for p in second], params)
    return second, [o.outputs[0].token_ids for o in outs1 + outs2]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(
        path, device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=DEVICE_BLOCKS, max_num_seqs=8,
        max_num_batched_tokens=128, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("enforce_eager", "async_scheduling"), [(True, True), (False, True), (False, False)],
    ids=["eager-async", "graphs-async", "graphs-sync"],
)  # fmt: skip
def test_host_tier_on_gpu_keeps_greedy_output_and_loads_per_layer(
    tiny_llama_dir, enforce_eager: bool, async_scheduling: bool
) -> None:
    """Async scheduling (the GPU default) queues a step's copies while the previous step runs."""
    path = str(tiny_llama_dir)
    options = {"enforce_eager": enforce_eager, "async_scheduling": async_scheduling}
    off = _llm(path, **options)
    base_second, base_outputs = _multi_turn(off)
    assert "kv_offload_hits" not in off.engine.get_stats()
    del off

    on = _llm(path, kv_offload_gb=HOST_GB, **options)
    connector = on.engine.runner.kv_connector
    assert isinstance(connector, HostKVTierWorker) and connector.is_cuda
    assert all(host.is_pinned() for host in connector.host_tensors)
    second, outputs = _multi_turn(on)
    torch.cuda.synchronize()
    assert second == base_second
    assert outputs == base_outputs, "the host tier changed greedy output"
    for prompt, output in zip(second, outputs[CONVERSATIONS:], strict=True):
        assert output == hf_greedy(path, prompt, MAX_NEW)[0]
    stats = on.engine.get_stats()
    assert stats["kv_offload_blocks_stored"] > 0 and stats["kv_offload_blocks_loaded"] > 0
    assert stats["kv_offload_hits"] > 0, "no second turn was served from the host tier"
    # Steps with copies have prefill chunks: eager or piecewise graphs, both calling the per-layer
    # hooks (a whole-step decode graph would wait for all layers at once instead).
    assert connector.layers_waited_in_forward > 0
    if not enforce_eager:
        assert on.engine.runner.piecewise is not None and on.engine.runner.piecewise.num_replays > 0
    assert connector._step is None, "a step's copies were left pending"
    on.engine.check_invariants()
    kv = on.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_rehit_on_gpu_is_one_copy_per_layer_with_greedy_output_unchanged(tiny_llama_dir) -> None:
    path = str(tiny_llama_dir)
    without, _, _ = sequential_rehits(path, device="cuda", dtype="float32", enforce_eager=True)
    outputs, loads, llm = sequential_rehits(
        path, device="cuda", dtype="float32", enforce_eager=True, kv_offload_gb=SEQUENTIAL_HOST_GB
    )
    torch.cuda.synchronize()
    assert outputs == without, "the host tier changed greedy output"
    connector = llm.engine.runner.kv_connector
    assert isinstance(connector, HostKVTierWorker) and connector.is_cuda
    check_one_copy_per_layer(loads, connector)


def test_side_streams_order_saves_after_compute_and_loads_after_saves() -> None:
    """The worker alone on CUDA: a step saves blocks the compute stream is still writing (a slow
    kernel queued first) and, in the same step, loads other slots into those same blocks. The saves
    must see the compute stream's writes, each layer's loads must come after its saves (separate
    streams), and the compute stream must see the loads; slots listed in descending order are one
    copy per layer."""
    layers, blocks = 4, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = [torch.randn(2, blocks, 16, 2, 32, device="cuda", generator=gen) for _ in range(layers)]
    worker = HostKVTierWorker(pool, 128)
    first = list(range(32))
    # Step 1: blocks 0..31 evicted tail first (slots descend in block order).
    worker.start_load_kv(HostTierMetadata(save_device_blocks=first[::-1], save_host_slots=first))
    worker.wait_for_load()
    torch.cuda.synchronize()
    saved = [t[:, :32].clone() for t in pool]
    assert worker.save_calls == layers
    # Step 2: the compute stream is slow to write blocks 32..63; the step saves them and loads
    # slots 31..0 (old blocks 0..31) into them.
    torch.cuda._sleep(50_000_000)
    for t in pool:
        t[:, 32:].mul_(2.0)
    expected_saved = [t[:, 32:].clone() for t in pool]  # queued after the writes: what the save must see
    targets = list(range(32, 64))
    worker.start_load_kv(
        HostTierMetadata(
            save_device_blocks=targets, save_host_slots=list(range(32, 64)),
            load_host_slots=first[::-1], load_device_blocks=targets,
        )
    )  # fmt: skip
    for layer in range(layers):
        worker.wait_for_layer_load(layer)
    worker.wait_for_load()
    after = [t[:, 32:].clone() for t in pool]  # on the compute stream: after the loads
    torch.cuda.synchronize()
    assert worker.load_calls == layers and worker.save_calls == 2 * layers
    for layer in range(layers):
        host = worker.host_tensors[layer].view(torch.float32).view(128, 2, 16, 2, 32)
        assert torch.equal(host[32:64].transpose(0, 1).cuda(), expected_saved[layer]), "a save missed a write"
        assert torch.equal(after[layer], saved[layer]), "a load is missing or landed wrong"  # slot 31-k: block k
    worker.release()
