"""The EAGLE-3 drafter and the target's aux hidden states on CUDA (Triton attention, the CUDA linear
method, the Triton elementwise ops) against the same models on the CPU (tests/model/test_eagle3.py
checks those against transformers and the published math). The chunked target run ends in a
one-token decode step, which goes through the fused-RoPE, deferred-norm layer path."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from tests.model.test_eagle3 import (  # noqa: F401  (target_dir: a fixture)
    PROMPT,
    _drafter_config,
    _drafter_tensors,
    _write_drafter,
    target_dir,
)
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import KernelConfig, ModelConfig
from tokenmill.model.eagle3 import load_eagle3_drafter
from tokenmill.model.eagle3_config import default_aux_layer_ids
from tokenmill.model.registry import load_model, resolve_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"),
]

BLOCK = 16
NUM_BLOCKS = 8
TABLE = [5, 2]  # 32 positions


def _backend(device: str, heads: int, kv_heads: int, head_dim: int):
    if device == "cpu":
        return TorchReferenceBackend(heads, kv_heads, head_dim, head_dim**-0.5, BLOCK)
    from tokenmill.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, BLOCK)


def _meta(start: int, n: int, device: str) -> AttentionMetadata:
    slots = [TABLE[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
    qsl = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([start + n], dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=n, num_reqs=1, max_query_len=n, max_seq_len=start + n, query_start_loc=qsl,
        seq_lens=seq, block_tables=torch.tensor([TABLE], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq.clone(), is_decode_only=n == 1,
    )  # fmt: skip
    return replace(
        meta, query_start_loc=qsl.to(device), seq_lens=seq.to(device),
        block_tables=meta.block_tables.to(device), slot_mapping=meta.slot_mapping.to(device),
    )  # fmt: skip


def _run(target_path, drafter_path, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Target aux states over PROMPT in chunks [6, 4, 1], then drafter steps 1 and 2, all on `device`."""
    config = ModelConfig(model=str(target_path))
    resolved = resolve_model(config)
    arch = resolved.arch
    target = load_model(
        config, arch, device, dtype, _backend(device, arch.num_heads, arch.num_kv_heads, arch.head_dim),
        resolved=resolved, kernel=KernelConfig(cpu_weight_packing=False),
    )  # fmt: skip
    drafter = load_eagle3_drafter(drafter_path, target, device, dtype, _backend(device, 4, 2, 16))
    caches = [
        torch.zeros(2, NUM_BLOCKS, BLOCK, arch.num_kv_heads, arch.head_dim, device=device, dtype=dtype)
        for _ in range(arch.num_layers)
    ]
    layers = default_aux_layer_ids(arch.num_layers)
    hidden, aux, start = [], [], 0
    with torch.inference_mode():
        for n in (6, 4, 1):
            ids = torch.tensor(PROMPT[start : start + n], device=device)
            pos = torch.arange(start, start + n, device=device)
            h, a = target.forward_with_aux_hidden_states(ids, pos, caches, _meta(start, n, device), layers)
            hidden.append(h)
            aux.append(a)
            start += n
        aux_all = torch.cat(aux)
        next_token = target.compute_logits(hidden[-1]).argmax(-1)
        step1_ids = torch.cat((torch.tensor(PROMPT[1:], device=device), next_token))
        n = len(step1_ids)
        cache = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, device=device, dtype=dtype)
        step1 = drafter(step1_ids, torch.arange(n, device=device), aux_all, cache, _meta(0, n, device))
        draft1 = drafter.greedy_draft_tokens(step1.normed[-1:])
        step2 = drafter(draft1, torch.tensor([n], device=device), step1.hidden_out[-1:], cache, _meta(n, 1, device))
        return {
            "aux": aux_all.float().cpu(),
            "hidden_out1": step1.hidden_out.float().cpu(),
            "logits1": drafter.compute_draft_logits(step1.normed).cpu(),
            "hidden_out2": step2.hidden_out.float().cpu(),
            "logits2": drafter.compute_draft_logits(step2.normed).cpu(),
            "drafts": torch.cat((draft1, drafter.greedy_draft_tokens(step2.normed))).cpu(),
        }


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):  # noqa: F811
    config = ModelConfig(model=str(target_dir))
    resolved = resolve_model(config)
    arch = resolved.arch
    cpu_target = load_model(config, arch, "cpu", torch.float32, _backend("cpu", arch.num_heads, arch.num_kv_heads, 16))
    return _write_drafter(
        tmp_path_factory.mktemp("eagle3_drafter"), _drafter_config(cpu_target), _drafter_tensors(cpu_target)
    )


def test_cuda_float32_equals_cpu(target_dir, drafter_dir):  # noqa: F811
    cpu = _run(target_dir, drafter_dir, "cpu", torch.float32)
    cuda = _run(target_dir, drafter_dir, "cuda", torch.float32)
    for key in ("aux", "hidden_out1", "logits1", "hidden_out2", "logits2"):
        torch.testing.assert_close(cuda[key], cpu[key], atol=2e-3, rtol=2e-3, msg=key)
    assert cuda["drafts"].tolist() == cpu["drafts"].tolist()


def test_cuda_bfloat16_stays_close_to_cpu_float32(target_dir, drafter_dir):  # noqa: F811
    cpu = _run(target_dir, drafter_dir, "cpu", torch.float32)
    bf16 = _run(target_dir, drafter_dir, "cuda", torch.bfloat16)
    for key in ("aux", "hidden_out1", "hidden_out2", "logits1", "logits2"):
        cosine = torch.nn.functional.cosine_similarity(bf16[key].flatten(), cpu[key].flatten(), dim=0)
        assert cosine > 0.995, (key, float(cosine))


def test_engine_replays_cuda_graphs_with_the_aux_hidden_states_and_drafts_as_eagerly(
    target_dir,  # noqa: F811
    drafter_dir,
):
    """Decode and verification steps replay CUDA graphs that keep the target's aux hidden states:
    greedy output is the target's own, and the drafter, fed from the graphs, proposes what it
    proposes from eager steps (the same drafted and accepted counts, float32)."""
    from tokenmill import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 900 + 20 for j in range(12 + 3 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=128, max_num_seqs=8)
    spec = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}

    def run(**extra):
        llm = LLM(str(target_dir), **options, **extra)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.check_invariants()
        stats = llm.engine.get_stats()
        assert stats["kv_cache_usage"] == 0.0
        graphs = llm.engine.runner.graph_runner
        return tokens, stats, graphs.num_replays if graphs is not None else 0, graphs

    expected, _, _, _ = run(enforce_eager=True)
    eager, eager_stats, _, _ = run(speculative_config=spec, enforce_eager=True)
    graphed, graph_stats, replays, graphs = run(speculative_config=spec)
    assert eager == expected and graphed == expected
    assert graphs is not None and graphs.aux_outputs and replays > 0
    assert (4 in graphs.spec_tokens_per_request), graphs.spec_tokens_per_request  # verification graphs, q = 1 + 3
    assert graph_stats["spec_decode_num_draft_tokens"] > 0
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert graph_stats[key] == eager_stats[key], key
