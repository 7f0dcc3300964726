"""GGUF files of Gemma 2, Gemma 3 and Phi-3 load as the Hugging Face checkpoints they came from.

Each tiny random checkpoint (transformers' save_pretrained) is converted here the way llama.cpp's
converter writes these families (its metadata keys; Gemma's RMSNorm weights stored as 1 + w;
Phi-3's fused qkv / gate_up tensors and LongRoPE factor tensors; Gemma 3's local RoPE base and
layer pattern left to the reader), with our own tables, not gguf_families'. Then: the GGUF's
ArchConfig and weights equal the checkpoint's; greedy tokens and logprobs (fp32, CPU) equal
transformers' on the checkpoint; a Q8_0 file's one-row steps read its blocks (Phi-3's fused
tensors too) and match the float path. Also what llama.cpp leaves out of the file: Gemma's
query_pre_attn_scalar for the 27B models, and the end-of-turn tokens chat models stop at.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.gemma_checkpoints import write_gemma_checkpoint
from tests.engine.hf_oracle import hf_greedy
from tests.engine.rope_window_checkpoints import write_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import ModelConfig
from tokenmill.model.loader.gguf_metadata import gguf_hf_config
from tokenmill.model.registry import load_model
from tokenmill.model.resolve import resolve_model

gguf = pytest.importorskip("gguf")

# HF module -> GGUF block tensor, as llama.cpp's tensor map names them for each family.
_GEMMA_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_PHI3_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_LAYERS = 6  # llama.cpp's Gemma 3 pattern: layers 0-4 slide, layer 5 attends globally
GEMMA3_GLOBAL_ROPE = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}


def _weights(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}


def _write_gguf(src: Path, dst: Path, family: str, quantize=None) -> Path:
    """`src` (an HF checkpoint of `family`) as llama.cpp's converter writes it; with `quantize` (a
    GGMLQuantizationType) the matmul weights and the embedding table in that type."""
    cfg = json.loads((src / "config.json").read_text())
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(str(dst), arch=family)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    extra: dict[str, np.ndarray] = {}
    if family == "gemma2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    elif family == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        full = cfg["rope_parameters"]["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(cfg["sliding_window"])
    else:  # phi3
        rope = cfg.get("rope_parameters") or {}
        rotary = int(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0) * head_dim)
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        original = cfg.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
            extra["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    names = _PHI3_NAMES if family == "phi3" else _GEMMA_NAMES
    for name, tensor in _weights(src).items():
        array = tensor.numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        if family != "phi3" and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp's Gemma converters store 1 + w
        if quantize is not None and array.ndim == 2:
            quantized = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), quantize)
            writer.add_tensor(gguf_name, quantized, raw_shape=quantized.shape, raw_dtype=quantize)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    for gguf_name, array in extra.items():
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _checkpoint(family: str, path: Path, tokenizer) -> Path:
    if family == "gemma2":  # query_pre_attn_scalar = head_dim: what a GGUF of a non-27B model implies
        return write_gemma_checkpoint(path, "gemma2", tokenizer, seed=21, query_pre_attn_scalar=16)
    if family == "gemma3":
        return write_gemma_checkpoint(
            path, "gemma3", tokenizer, seed=22, query_pre_attn_scalar=16, num_hidden_layers=GEMMA3_LAYERS,
            layer_types=["sliding_attention"] * (GEMMA3_LAYERS - 1) + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": GEMMA3_GLOBAL_ROPE,
            },
        )  # fmt: skip
    return write_checkpoint(path, family, tokenizer, seed=23)  # a rope_window_checkpoints spec


CASES = ["gemma2", "gemma3", "phi3_longrope_long_partial", "phi3_sliding"]


@pytest.fixture(scope="module", params=CASES)
def converted(request, tmp_path_factory, tiny_tokenizer) -> tuple[str, Path, Path]:
    """(case, HF checkpoint, its F32 GGUF)."""
    case = request.param
    family = case.split("_")[0]
    root = tmp_path_factory.mktemp(f"gguf-{case}")
    src = _checkpoint(case if family == "phi3" else family, root / "hf", tiny_tokenizer)
    return case, src, _write_gguf(src, root / f"tiny-{case}.gguf", family)


def _backend(arch) -> TorchReferenceBackend:
    return TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale, 16)


def _settings(arch) -> dict:
    """ArchConfig's fields but rope_scaling (compared apart), floats as the file's float32 holds them."""
    fields = dataclasses.asdict(arch)
    return {
        k: float(np.float32(v)) if isinstance(v, float) else v
        for k, v in fields.items()
        if k != "rope_scaling"
    }


def test_arch_and_weights_equal_the_checkpoints(converted):
    case, src, gguf_path = converted
    from_hf, from_gguf = (resolve_model(ModelConfig(model=str(p))) for p in (src, gguf_path))
    assert from_gguf.format == "gguf"
    assert _settings(from_gguf.arch) == _settings(from_hf.arch)
    ours, theirs = from_gguf.arch.rope_scaling, from_hf.arch.rope_scaling
    assert (ours is None) == (theirs is None)
    if theirs is not None:  # the file holds LongRoPE's factors as float32
        for key, value in theirs.items():
            assert ours[key] == (pytest.approx(value, rel=1e-6) if key != "rope_type" else value), key
    models = [
        load_model(ModelConfig(model=r.path), r.arch, "cpu", torch.float32, _backend(r.arch), resolved=r)
        for r in (from_hf, from_gguf)
    ]
    hf_params, gguf_params = (dict(m.named_parameters()) for m in models)
    assert hf_params.keys() == gguf_params.keys()
    for name, value in hf_params.items():
        # Gemma's norms went through 1 + w and back: within float32 rounding
        torch.testing.assert_close(gguf_params[name], value, atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(models[1].rotary.cos_cache, models[0].rotary.cos_cache, atol=1e-6, rtol=1e-6)


def _prompts(vocab_size: int, count: int = 3, length: int = 40) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, vocab_size) for _ in range(length + 9 * i)] for i in range(count)]


MAX_NEW = 10


def test_greedy_tokens_and_logprobs_equal_transformers_on_the_checkpoint(converted):
    """Prompts of 40-58 tokens: past the Gemma windows (16, 24), the Phi-3 window (32) and its
    LongRoPE original context (32)."""
    case, src, gguf_path = converted
    # float32 KV (a GGUF's default is float16, llama.cpp's; it moves logprobs ~1e-3): the oracle's path
    llm = LLM(str(gguf_path), tokenizer=str(src), device="cpu", max_model_len=256, kv_cache_dtype="float32")
    prompts = _prompts(llm.engine.runner.model.arch.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(str(src), prompt, MAX_NEW)
        completion = out.outputs[0]
        assert completion.token_ids == tokens, case
        ours = [next(iter(lp.values())).logprob for lp in completion.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-4), case
    llm.engine.check_invariants()


@pytest.mark.parametrize("activation_bits", [0, 16])
def test_q8_0_one_row_steps_read_the_blocks_and_match_the_float_path(converted, tmp_path, activation_bits):
    """Q8_0 matmuls: one request's steps read the file's blocks (Phi-3's fused attn_qkv / ffn_up as
    whole merged layers, its q/k rows permuted for partial rotary as the float weights are) and give
    the float32 path's tokens, logprobs within 1e-4 (5e-3 with 16-bit integer activations, where
    Phi-3's decode steps run the layers in one C++ call)."""
    from gguf.constants import GGMLQuantizationType

    from tokenmill.model.layers.quantized_linear import quantized_blocks

    case, src, _ = converted
    q8_path = _write_gguf(
        src, tmp_path / f"tiny-{case}-q8_0.gguf", case.split("_")[0], GGMLQuantizationType.Q8_0
    )
    prompt = {"prompt_token_ids": _prompts(64, count=1, length=36)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    results = []
    for quantized in (True, False):
        llm = LLM(
            str(q8_path), tokenizer=str(src), device="cpu", max_model_len=256, cpu_quantized_gemv=quantized,
            kernel_config={"cpu_activation_bits": activation_bits},
        )  # fmt: skip
        layer = llm.engine.runner.model.layers[1]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            blocks = quantized_blocks(layer.get_submodule(name))
            assert (blocks.quant_type if blocks else None) == (1 if quantized else None), (case, name)
        out = llm.generate(prompt, params)[0].outputs[0]
        results.append((out.token_ids, [next(iter(lp.values())).logprob for lp in out.logprobs]))
    assert results[0][0] == results[1][0]
    assert results[0][1] == pytest.approx(results[1][1], abs=5e-3 if activation_bits else 1e-4)


def _metadata_only_gguf(
    path: Path, arch: str, layers: int, hidden: int, heads: int, head_dim: int, **extra
) -> Path:
    """A GGUF with a family's metadata and one tensor: enough for gguf_hf_config."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(4 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    if "window_pattern" in extra:
        pattern = extra["window_pattern"]
        key = f"{arch}.attention.sliding_window_pattern"
        if isinstance(pattern, list):
            writer.add_array(key, pattern)
        else:
            writer.add_uint32(key, pattern)
    tokens = extra.get("tokens", ["<pad>", "<eos>", "<bos>"])
    writer.add_token_list(tokens)
    writer.add_token_types(extra.get("token_types", [3] * len(tokens)))
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "layers", "hidden", "heads", "head_dim", "scalar"),
    [
        ("gemma2", 46, 4608, 32, 128, 144.0),  # Gemma 2 27B: hidden / heads
        ("gemma2", 42, 3584, 16, 256, 256.0),  # 9B: head_dim
        ("gemma3", 62, 5376, 32, 128, 168.0),  # Gemma 3 27B
        ("gemma3", 26, 1152, 4, 256, 256.0),  # 1B (hidden / heads would be 288)
    ],
)
def test_gemma_query_scalar_follows_llama_cpps_rule(tmp_path, arch, layers, hidden, heads, head_dim, scalar):
    cfg = gguf_hf_config(_metadata_only_gguf(tmp_path / "m.gguf", arch, layers, hidden, heads, head_dim))
    assert cfg["query_pre_attn_scalar"] == scalar


def test_end_of_turn_control_tokens_end_generation(tmp_path):
    """A chat GGUF names one EOS; its end-of-turn control token (Gemma's <end_of_turn>) ends a
    turn too, as in llama.cpp; the same text as an ordinary token does not."""
    tokens = ["<pad>", "<eos>", "<bos>", "<end_of_turn>", "<|im_end|>"]
    path = _metadata_only_gguf(
        tmp_path / "chat.gguf", "gemma2", 26, 2304, 8, 256, tokens=tokens, token_types=[3, 3, 3, 3, 1]
    )
    assert gguf_hf_config(path)["eos_token_id"] == [1, 3]
    assert resolve_model(ModelConfig(model=str(path))).arch.eos_token_ids == (1, 3)


def test_a_gemma_gguf_carries_its_own_tokenizer(tmp_path, monkeypatch):
    """A Gemma GGUF's SentencePiece vocabulary (tokenizer model "llama", byte fallback tokens)
    becomes a working tokenizer without --tokenizer (transformers' converter, cached by us), and its
    <end_of_turn> ends generation beside <eos>."""
    from tokenmill.model.tokenizer import _load_gguf_tokenizer

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))  # the converted tokenizer is cached there
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens += [f"<0x{i:02X}>" for i in range(256)] + ["▁hello", "▁world", "▁", *"helowrd"]
    path = tmp_path / "gemma-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gemma2")
    for add, value in (
        (writer.add_block_count, 1), (writer.add_context_length, 128), (writer.add_embedding_length, 32),
        (writer.add_feed_forward_length, 64), (writer.add_head_count, 2), (writer.add_head_count_kv, 1),
        (writer.add_key_length, 16), (writer.add_value_length, 16), (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_tokenizer_model, "llama"), (writer.add_tokenizer_pre, "default"), (writer.add_token_list, tokens),
        (writer.add_token_types, [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * 10),
        (writer.add_token_scores, [0.0] * 262 + [-1.0, -2.0] + [-4.0] * 8),
        (writer.add_bos_token_id, 2), (writer.add_eos_token_id, 1), (writer.add_unk_token_id, 3),
        (writer.add_pad_token_id, 0), (writer.add_add_bos_token, True),
    ):  # fmt: skip
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = _load_gguf_tokenizer(path)
    ids = tokenizer.encode("hello world")
    assert ids[0] == 2 and tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (1, 2)
    assert resolve_model(ModelConfig(model=str(path))).arch.eos_token_ids == (1, 5)


@pytest.mark.parametrize(
    ("pattern", "sliding"),
    [
        (None, [True] * 5 + [False] + [True] * 2),  # llama.cpp's one global layer in six
        (4, [True, True, True, False] * 2),  # the file's own period
        ([True, False] * 4, [True, False] * 4),  # one flag a layer
    ],
)
def test_gemma3_layer_pattern_is_the_files_where_it_says(tmp_path, pattern, sliding):
    extra = {} if pattern is None else {"window_pattern": pattern}
    path = _metadata_only_gguf(tmp_path / "m.gguf", "gemma3", 8, 1152, 4, 256, **extra)
    windows = resolve_model(ModelConfig(model=str(path))).arch.sliding_windows
    assert [w is not None for w in windows] == sliding
