"""The EAGLE-3 drafter (model/eagle3.py) against a plain-torch forward written here from the
published math, and the target's aux hidden states against transformers' output_hidden_states.

The target is a tiny random Llama of 8 layers (the default aux layers 2, L // 2, L - 3 = 2, 4, 5
need more than the shared fixtures' 2); the drafter checkpoint is written here in the published
layout (midlayer.*, fc, norm, lm_head, d2t, t2d; no embedding) with a draft vocab smaller than
the target's. Both run float32 on the CPU over a paged KV cache with the torch reference backend.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.conftest import write_tiny_checkpoint
from tests.engine.hf_oracle import hf_load_kwargs
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import KernelConfig, ModelConfig
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.eagle3 import Eagle3Drafter, load_eagle3_drafter
from tokenmill.model.eagle3_config import Eagle3Config, default_aux_layer_ids
from tokenmill.model.llama import CausalLM
from tokenmill.model.registry import load_model, resolve_model

BLOCK_SIZE = 4
NUM_BLOCKS = 16
TARGET_LAYERS = 8
DRAFT_VOCAB = 200
DRAFT_ROPE_THETA = 5000.0  # the drafter's own RoPE, unlike the target's llama3-scaled one
DRAFT_EPS = 1e-5
PROMPT = [5, 87, 301, 12, 640, 33, 910, 71, 402, 250, 19]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("eagle3_target"), "llama", tiny_tokenizer, seed=11,
        num_hidden_layers=TARGET_LAYERS, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip


def _backend(heads: int, kv_heads: int, head_dim: int) -> TorchReferenceBackend:
    return TorchReferenceBackend(heads, kv_heads, head_dim, head_dim**-0.5, BLOCK_SIZE)


@pytest.fixture(scope="module")
def target(target_dir) -> CausalLM:
    config = ModelConfig(model=str(target_dir))
    resolved = resolve_model(config)
    arch = resolved.arch
    return load_model(
        config, arch, "cpu", torch.float32, _backend(arch.num_heads, arch.num_kv_heads, arch.head_dim),
        resolved=resolved, kernel=KernelConfig(cpu_weight_packing=False),
    )  # fmt: skip


def _drafter_config(target: CausalLM, **overrides) -> dict:
    arch = target.arch
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "max_position_embeddings": 2048,
        "rms_norm_eps": DRAFT_EPS,
        "rope_theta": DRAFT_ROPE_THETA,
        "tie_word_embeddings": False,
        "vocab_size": arch.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB,
    }
    config.update(overrides)
    return config


def _drafter_tensors(target: CausalLM, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tensors in the published layout; norms near 1, d2t/t2d for a random draft vocab."""
    gen = torch.Generator().manual_seed(seed)
    H, V, inter = target.arch.hidden_size, target.arch.vocab_size, 96
    q_rows, kv_rows = 4 * 16, 2 * 16

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    def norm() -> torch.Tensor:
        return torch.empty(H).uniform_(0.7, 1.3, generator=gen)

    draft_ids = torch.randperm(V, generator=gen)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    return {
        "fc.weight": rand(H, 3 * H),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(q_rows, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(kv_rows, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(kv_rows, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, q_rows),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": rand(inter, H),
        "midlayer.mlp.up_proj.weight": rand(inter, H),
        "midlayer.mlp.down_proj.weight": rand(H, inter),
        "norm.weight": norm(),
        "lm_head.weight": rand(DRAFT_VOCAB, H, scale=0.25),
        "d2t": draft_ids - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def _write_drafter(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    return path


def _load_drafter(path: Path, target: CausalLM) -> Eagle3Drafter:
    return load_eagle3_drafter(path, target, "cpu", torch.float32, _backend(4, 2, 16))


def _meta(block_table: list[int], start: int, num_tokens: int) -> AttentionMetadata:
    """One request computing positions start .. start + num_tokens - 1 (earlier ones cached)."""
    positions = range(start, start + num_tokens)
    slots = [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([start + num_tokens], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=start + num_tokens,
        query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc.clone(), seq_lens_cpu=seq_lens.clone(),
        is_decode_only=num_tokens == 1,
    )  # fmt: skip


BLOCK_TABLE = [9, 2, 14, 5, 0, 11]  # non-contiguous, enough for 24 positions


def _kv_caches(num_layers: int, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    return [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim) for _ in range(num_layers)]


def _target_aux(target: CausalLM, chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden, aux states) of PROMPT computed in `chunks` over a paged cache."""
    arch = target.arch
    caches = _kv_caches(arch.num_layers, arch.num_kv_heads, arch.head_dim)
    layers = default_aux_layer_ids(arch.num_layers)
    hidden, aux, start = [], [], 0
    with torch.inference_mode():
        for n in chunks:
            ids, pos = torch.tensor(PROMPT[start : start + n]), torch.arange(start, start + n)
            h, a = target.forward_with_aux_hidden_states(ids, pos, caches, _meta(BLOCK_TABLE, start, n), layers)
            hidden.append(h)
            aux.append(a)
            start += n
    return torch.cat(hidden), torch.cat(aux)


# -- the target's aux hidden states ---------------------------------------------------------------


def test_default_aux_layers_are_eagle3s():
    assert default_aux_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B
    assert default_aux_layer_ids(TARGET_LAYERS) == (2, 4, 5)


@pytest.mark.parametrize("chunks", [[len(PROMPT)], [6, 4, 1]], ids=["one_chunk", "chunked"])
def test_aux_hidden_states_equal_transformers_hidden_states(target, target_dir, chunks):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, **hf_load_kwargs(str(target_dir)))
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    hidden, aux = _target_aux(target, chunks)
    H = target.arch.hidden_size
    assert aux.shape == (len(PROMPT), 3 * H)
    for k, layer in enumerate(default_aux_layer_ids(TARGET_LAYERS)):
        torch.testing.assert_close(aux[:, k * H : (k + 1) * H], expected[layer][0], atol=2e-5, rtol=1e-4)
    # The final hidden states are forward's, unchanged by the capture.
    caches = _kv_caches(TARGET_LAYERS, target.arch.num_kv_heads, target.arch.head_dim)
    with torch.inference_mode():
        plain = target(torch.tensor(PROMPT), torch.arange(len(PROMPT)), caches, _meta(BLOCK_TABLE, 0, len(PROMPT)))
    torch.testing.assert_close(hidden, plain, atol=1e-5, rtol=1e-5)


def test_aux_layers_are_checked(target):
    caches = _kv_caches(TARGET_LAYERS, target.arch.num_kv_heads, target.arch.head_dim)
    with pytest.raises(ValueError, match="aux_layers"):
        target.forward_with_aux_hidden_states(
            torch.tensor(PROMPT[:2]), torch.arange(2), caches, _meta(BLOCK_TABLE, 0, 2), (5, 2, 4)
        )


# -- the reference drafter ------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + DRAFT_EPS) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated the rotate-half way with plain frequencies."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / DRAFT_ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def _reference_drafter(
    w: dict[str, torch.Tensor], embed: torch.Tensor, token_ids: list[int], hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_out [T, H], draft logits [T, Vd]) of one sequence at positions 0 .. T-1, with full
    causal attention; `hidden` [T, H] is each row's hidden input (already through fc)."""
    T = len(token_ids)
    positions = torch.arange(T)
    m = "midlayer."
    e = embed[torch.tensor(token_ids)]
    a = torch.cat((_rms(e, w[m + "input_layernorm.weight"]), _rms(hidden, w[m + "hidden_norm.weight"])), -1)
    q = _rope((a @ w[m + "self_attn.q_proj.weight"].T).view(T, 4, 16), positions)
    k = _rope((a @ w[m + "self_attn.k_proj.weight"].T).view(T, 2, 16), positions)
    v = (a @ w[m + "self_attn.v_proj.weight"].T).view(T, 2, 16)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # 2 query heads per KV head
    scores = torch.einsum("qhd,khd->hqk", q, k) / 16**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, 64)
    r = hidden + attn @ w[m + "self_attn.o_proj.weight"].T
    x = _rms(r, w[m + "post_attention_layernorm.weight"])
    mlp = (F.silu(x @ w[m + "mlp.gate_proj.weight"].T) * (x @ w[m + "mlp.up_proj.weight"].T)) @ w[
        m + "mlp.down_proj.weight"
    ].T
    out = r + mlp
    return out, _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("chunks", [[len(PROMPT)], [7, len(PROMPT) - 7]], ids=["one_chunk", "chunked"])
def test_drafter_matches_the_published_math(target, tmp_path, chunks):
    """Step 1 from the target's fused features (tokens shifted by one: row p gets the target's
    features at p and the token at p + 1), then step 2 from the drafter's own hidden_out."""
    tensors = _drafter_tensors(target)
    drafter = _load_drafter(_write_drafter(tmp_path / "drafter", _drafter_config(target), tensors), target)
    _, aux = _target_aux(target, [len(PROMPT)])
    with torch.inference_mode():
        next_token = int(target.compute_logits(_target_aux(target, [len(PROMPT)])[0][-1:]).argmax())
    step1_ids = PROMPT[1:] + [next_token]
    n = len(step1_ids)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16)

    hidden_out, normed, start = [], [], 0
    with torch.inference_mode():
        for size in chunks:
            out = drafter(
                torch.tensor(step1_ids[start : start + size]), torch.arange(start, start + size),
                aux[start : start + size], cache, _meta(BLOCK_TABLE, start, size),
            )  # fmt: skip
            hidden_out.append(out.hidden_out)
            normed.append(out.normed)
            start += size
        hidden_out, normed = torch.cat(hidden_out), torch.cat(normed)
        draft1 = drafter.greedy_draft_tokens(normed[-1:])
        step2 = drafter(draft1, torch.tensor([n]), hidden_out[-1:], cache, _meta(BLOCK_TABLE, n, 1))
        draft2 = drafter.greedy_draft_tokens(step2.normed)

    embed = target.embed_tokens.detach()
    fused = aux @ tensors["fc.weight"].T
    ref_out, ref_logits = _reference_drafter(tensors, embed, step1_ids, fused)
    draft_to_target = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    torch.testing.assert_close(hidden_out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.compute_draft_logits(normed), ref_logits, atol=1e-4, rtol=1e-4)
    ref_draft1 = int(draft_to_target[ref_logits[-1].argmax()])
    assert int(draft1) == ref_draft1
    assert bool(tensors["t2d"][ref_draft1])  # a draft always lands in the draft vocab's target ids

    ref2_out, ref2_logits = _reference_drafter(
        tensors, embed, step1_ids + [ref_draft1], torch.cat((fused, ref_out[-1:]))
    )
    torch.testing.assert_close(step2.hidden_out, ref2_out[-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.compute_draft_logits(step2.normed), ref2_logits[-1:], atol=1e-4, rtol=1e-4)
    assert int(draft2) == int(draft_to_target[ref2_logits[-1].argmax()])


def test_pytorch_bin_checkpoints_load_and_logits_map_into_the_target_vocab(target, tmp_path):
    """The EAGLE repo publishes pytorch_model.bin; draft logits land on the target ids d2t names."""
    tensors = _drafter_tensors(target)
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_drafter_config(target)))
    torch.save(tensors, path / "pytorch_model.bin")
    drafter = _load_drafter(path, target)
    draft_logits = torch.randn(3, DRAFT_VOCAB)
    full = drafter.logits_in_target_vocab(draft_logits)
    assert full.shape == (3, target.arch.vocab_size)
    in_draft = tensors["t2d"]
    torch.testing.assert_close(full[:, in_draft], draft_logits)  # draft ids ascend with target ids
    assert torch.isneginf(full[:, ~in_draft]).all()
    assert drafter.to_target_ids(draft_logits.argmax(-1)).tolist() == full.argmax(-1).tolist()


def test_forward_refuses_a_hidden_input_of_another_width(target, tmp_path):
    drafter = _load_drafter(_write_drafter(tmp_path / "d", _drafter_config(target), _drafter_tensors(target)), target)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16)
    with pytest.raises(ValueError, match="hidden_in has width 128; expected 192"):
        drafter(torch.tensor([3]), torch.tensor([0]), torch.zeros(1, 128), cache, _meta(BLOCK_TABLE, 0, 1))


# -- loading --------------------------------------------------------------------------------------


def _edited(target: CausalLM, **edits: torch.Tensor | None) -> dict[str, torch.Tensor]:
    tensors = _drafter_tensors(target)
    for name, tensor in edits.items():
        name = name.replace("__", ".")
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    return tensors


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"midlayer__mlp__down_proj__weight": None}, "missing tensors: midlayer.mlp.down_proj.weight"),
        ({"d2t": None}, "missing tensors: d2t"),
        ({"midlayer__self_attn__q_norm__weight": torch.ones(16)}, "midlayer.self_attn.q_norm.weight: unexpected"),
        ({"fc__weight": torch.zeros(64, 128)}, r"fc.weight: shape \(64, 128\) does not match the model's \(64, 192\)"),
        ({"midlayer__self_attn__k_proj__weight": torch.zeros(32, 64)}, "midlayer.self_attn.k_proj.weight: shape"),
        ({"lm_head__weight": torch.zeros(DRAFT_VOCAB + 1, 64)}, "lm_head.weight: shape"),
        ({"midlayer__hidden_norm__weight": torch.ones(65)}, "midlayer.hidden_norm.weight: shape"),
        ({"d2t": torch.full((DRAFT_VOCAB,), 10**6)}, "d2t maps draft ids to target ids"),
        ({"t2d": torch.ones(1000, dtype=torch.bool)}, "d2t and t2d disagree"),
        ({"embed_tokens__weight": torch.zeros(1000, 64)}, "embed_tokens.weight: differs from the target's"),
    ],
    ids=["missing", "missing_d2t", "unexpected", "fc_shape", "k_proj_shape", "lm_head_shape", "norm_shape",
         "d2t_range", "t2d", "own_embedding"],
)  # fmt: skip
def test_load_errors_name_the_tensor(target, tmp_path, edit, message):
    path = _write_drafter(tmp_path / "bad", _drafter_config(target), _edited(target, **edit))
    with pytest.raises(ValueError, match=message):
        _load_drafter(path, target)


def test_an_embedding_equal_to_the_targets_loads_and_stays_shared(target, tmp_path):
    embed = target.embed_tokens.detach().clone()
    path = _write_drafter(tmp_path / "emb", _drafter_config(target), _edited(target, embed_tokens__weight=embed))
    drafter = _load_drafter(path, target)
    assert drafter.embed_tokens is target.embed_tokens
    assert "embed_tokens" not in dict(drafter.named_parameters())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 drafter"),
        ({"num_hidden_layers": 2}, "num_hidden_layers=2; expected 1"),
        ({"vocab_size": 999}, "vocab_size 999 differs from the target's 1000"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "names 2 layers; expected 3"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 8]}, r"expected 3 distinct layer indices in 0 \.\. 7"),
        ({"target_hidden_size": 32}, "target hidden states of width 32"),
    ],
)
def test_config_errors(target, overrides, message):
    with pytest.raises(UnsupportedModelError, match=message):
        Eagle3Config.from_hf_config(_drafter_config(target, **overrides), target.arch)


def test_config_reads_the_drafters_own_rope_and_aux_layers(target):
    config = Eagle3Config.from_hf_config(
        _drafter_config(target, eagle_config={"eagle_aux_hidden_state_layer_ids": [6, 1, 3]}), target.arch
    )
    assert config.aux_layer_ids == (1, 3, 6)
    assert config.arch.rope_theta == DRAFT_ROPE_THETA and config.arch.rope_scaling is None
    assert config.draft_vocab_size == DRAFT_VOCAB and config.fc_input_size == 3 * target.arch.hidden_size
    no_theta = {k: v for k, v in _drafter_config(target).items() if k != "rope_theta"}
    assert Eagle3Config.from_hf_config(no_theta, target.arch).arch.rope_theta == 10000.0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_with_an_eagle3_drafter_keeps_greedy_output(target_dir, target, tmp_path, async_scheduling):
    """The eagle3 proposer in the engine: drafts from the drafter are verified (a random drafter's
    are mostly rejected), the greedy output is the target's own, batched and chunked, no KV leaks.
    With async scheduling (the GPU default) a step's aux hidden states travel with its batch, and
    none stay behind once the requests are done."""
    from tokenmill import LLM, SamplingParams

    drafter = _write_drafter(tmp_path / "drafter", _drafter_config(target), _drafter_tensors(target))
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 900 + 20 for j in range(12 + 3 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    options = dict(
        device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=24, async_scheduling=async_scheduling
    )
    expected = [o.outputs[0].token_ids for o in LLM(str(target_dir), **options).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    llm = LLM(str(target_dir), speculative_config=spec, **options)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["kv_cache_usage"] == 0.0
    llm.engine.check_invariants()
    assert not llm.engine.runner.speculator.draft_model._aux_by_step  # every step's states were used


def test_engine_drafts_equal_the_drafter_run_step_by_step(target_dir, target, tmp_path):
    """The proposer feeds each draft step the previous draft on the device (no host round trip):
    its first proposal after the prefill must be the drafter's greedy chain computed here, step by
    step with explicit token ids."""
    from tokenmill import LLM, SamplingParams

    tensors = _drafter_tensors(target, seed=1)  # a seed whose chain of drafts varies
    # Make each draft follow from its input token: a random drafter's output is mostly its hidden
    # input carried on the residual stream, so a wrong token fed would still give the same chain.
    tensors["midlayer.hidden_norm.weight"] = tensors["midlayer.hidden_norm.weight"] * 0.01
    tensors["midlayer.self_attn.o_proj.weight"] = tensors["midlayer.self_attn.o_proj.weight"] * 30
    path = _write_drafter(tmp_path / "drafter", _drafter_config(target), tensors)
    spec = {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    llm = LLM(str(target_dir), device="cpu", max_model_len=128, block_size=4, speculative_config=spec)
    proposer = llm.engine.runner.speculator.draft_model
    proposals: list[dict[str, list[int]]] = []
    real_propose = proposer.propose

    def recording_propose(*args, **kwargs):
        drafts = real_propose(*args, **kwargs)
        if drafts:
            proposals.append(drafts)
        return drafts

    proposer.propose = recording_propose
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    (engine_drafts,) = proposals[0].values()

    drafter = _load_drafter(path, target)
    final, aux = _target_aux(target, [len(PROMPT)])
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16)
    with torch.inference_mode():
        next_token = int(target.compute_logits(final[-1:]).argmax())
        step_ids = PROMPT[1:] + [next_token]
        n = len(step_ids)
        out = drafter(torch.tensor(step_ids), torch.arange(n), aux, cache, _meta(BLOCK_TABLE, 0, n))
        hidden, draft = out.hidden_out[-1:], drafter.greedy_draft_tokens(out.normed[-1:])
        expected = [int(draft)]
        for position in range(n, n + 2):
            out = drafter(draft, torch.tensor([position]), hidden, cache, _meta(BLOCK_TABLE, position, 1))
            hidden, draft = out.hidden_out, drafter.greedy_draft_tokens(out.normed)
            expected.append(int(draft))
    assert engine_drafts == expected
    assert len(set(expected)) > 1  # a chain that repeats one token would not show a wrong feed
