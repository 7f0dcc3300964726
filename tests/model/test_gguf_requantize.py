"""GGUF block types the CPU kernels do not read (Q4_0, Q5_0, Q5_1, the K-quants of a Q4_K_M file)
are requantized to Q8_0 at load, so their few-row matmuls read blocks instead of float32 copies.

The requantizer's blocks decode (gguf's own Q8_0 dequantizer) to within half a Q8_0 step of the
weights, and are gguf's Q8_0 encoding but for rounding ties. A tiny Llama (hidden 256, the
K-quants' block) written with Q4_K attention, Q6_K down projections and table (as Q4_K_M files
do), Q4_0 / Q5_1 gate and up: one-row steps read Q8_0 blocks for every product and keep the float
path's greedy tokens, logprobs within the requantization's error.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.quantized_linear import quantized_blocks
from tokenmill.model.loader.gguf_loader import requantize_q8_0

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402


def test_requantized_blocks_decode_within_half_a_step():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 512)) * rng.uniform(0.001, 1.0, (64, 1))).astype(np.float32)
    w[3, 32:64] = 0.0  # an all-zero block: scale 0, no division by it
    rows = requantize_q8_0(w)
    assert rows.shape == (64, 512 // 32 * 34) and rows.dtype == np.uint8
    decoded = gguf.quants.dequantize(rows, Q.Q8_0)
    step = np.abs(w.reshape(64, -1, 32)).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(decoded - w).reshape(64, -1, 32) <= step / 2 * (1 + 2**-10) + 1e-12)
    assert not decoded[3, 32:64].any()
    # gguf's Q8_0 encoding but for round-half-to-even ties and scales at float16's edge
    assert (rows == gguf.quants.quantize(w, Q.Q8_0)).mean() > 0.99


def _random_k_blocks(rng: np.random.Generator, shape: tuple[int, int], kind: Q) -> np.ndarray:
    """Random Q4_K / Q6_K rows with small float16 scales: weights of a few tenths at most."""
    rows, cols = shape
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    if kind == Q.Q4_K:  # d, dmin (float16) lead: d * scale * q - dmin * min, 6-bit scales and mins
        blocks[..., 0:2] = np.frombuffer(np.float16(4e-4).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
    else:  # Q6_K's d (float16) trails: d * int8 scale * (q - 32)
        blocks[..., 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


# HF module -> (GGUF block tensor, its type), a Q4_K_M-like mix plus the legacy types.
_TENSORS = {
    "input_layernorm": ("attn_norm", None),
    "self_attn.q_proj": ("attn_q", Q.Q4_K),
    "self_attn.k_proj": ("attn_k", Q.Q4_K),
    "self_attn.v_proj": ("attn_v", Q.Q6_K),
    "self_attn.o_proj": ("attn_output", Q.Q4_K),
    "post_attention_layernorm": ("ffn_norm", None),
    "mlp.gate_proj": ("ffn_gate", Q.Q4_0),
    "mlp.up_proj": ("ffn_up", Q.Q5_1),
    "mlp.down_proj": ("ffn_down", Q.Q6_K),
}


def _write(path: Path, cfg: dict, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(64)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for name, (array, kind) in tensors.items():
        if kind is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_shape=array.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory, tiny_tokenizer) -> tuple[Path, Path, Path]:
    """(a file of the types above, the same file with each of them requantized to Q8_0 by the
    test, the HF checkpoint whose tokenizer both use)."""
    root = tmp_path_factory.mktemp("k_quants")
    src = write_tiny_checkpoint(
        root / "hf", "llama", tiny_tokenizer, seed=5, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2, tie_word_embeddings=True,
    )  # fmt: skip
    cfg = json.loads((src / "config.json").read_text())
    from safetensors.torch import load_file

    rng = np.random.default_rng(3)
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        array = np.ascontiguousarray(tensor.numpy(), dtype=np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name, kind = "token_embd.weight", Q.Q6_K
        elif name == "model.norm.weight":
            gguf_name, kind = "output_norm.weight", None
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            base, kind = _TENSORS[module]
            gguf_name = f"blk.{layer}.{base}.{suffix}"
        if kind in (Q.Q4_K, Q.Q6_K):
            # Random blocks (gguf cannot write K-quants): no Q/K permutation to mind, any rows will do.
            tensors[gguf_name] = (_random_k_blocks(rng, array.shape, kind), kind)
        elif kind is not None:
            tensors[gguf_name] = (gguf.quants.quantize(array, kind), kind)
        else:
            tensors[gguf_name] = (array, None)
    as_q8_0 = {
        name: (array, None)
        if kind is None
        else (requantize_q8_0(gguf.quants.dequantize(array, kind)), Q.Q8_0)
        for name, (array, kind) in tensors.items()
    }
    # The tied table: the blocks path looks embeddings up in the file's exact table and multiplies
    # lm_head by its requantized blocks, so the requantized file gets both, untied.
    as_q8_0["output.weight"] = as_q8_0["token_embd.weight"]
    as_q8_0["token_embd.weight"] = tensors["token_embd.weight"]
    return (
        _write(root / "tiny-llama-k-quants.gguf", cfg, tensors),
        _write(root / "tiny-llama-as-q8_0.gguf", cfg, as_q8_0),
        src,
    )


def _greedy(path: Path, src: Path, quantized: bool, activation_bits: int) -> tuple[list[int], list[float]]:
    llm = LLM(
        str(path), tokenizer=str(src), device="cpu", max_model_len=128, cpu_quantized_gemv=quantized,
        kv_cache_dtype="float32", kernel_config={"cpu_activation_bits": activation_bits},
    )  # fmt: skip
    model = llm.engine.runner.model
    for layer in model.layers:
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            blocks = quantized_blocks(layer.get_submodule(name))
            assert (blocks.quant_type if blocks else None) == (1 if quantized else None), name
    assert (quantized_blocks(model.lm_head) is not None) == quantized  # the Q6_K table
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": [5, 17, 300, 42, 7, 99, 12]}, params)[0].outputs[0]
    llm.engine.check_invariants()
    return out.token_ids, [next(iter(lp.values())).logprob for lp in out.logprobs]


@pytest.mark.parametrize("activation_bits", [0, 16])
def test_k_quant_and_legacy_blocks_are_read_as_q8_0(k_quant_gguf, activation_bits):
    """One-row steps of the mixed file read Q8_0 blocks for every product: the float path of the
    file requantized by the test gives the same tokens, logprobs within 1e-4 (5e-3 with 16-bit
    integer activations, as for any Q8_0 file); the original file's float path (its exact weights)
    the same greedy tokens."""
    path, as_q8_0, src = k_quant_gguf
    blocks = _greedy(path, src, True, activation_bits)
    requantized_floats = _greedy(as_q8_0, src, False, activation_bits)
    assert blocks[0] == requantized_floats[0]
    assert blocks[1] == pytest.approx(requantized_floats[1], abs=5e-3 if activation_bits else 1e-4)
    exact_floats = _greedy(path, src, False, activation_bits)
    assert blocks[0] == exact_floats[0]
    assert blocks[1] == pytest.approx(exact_floats[1], abs=0.1)  # the requantization's own error


def test_the_blocks_come_from_the_float_loads_dequantization(k_quant_gguf):
    """Loading dequantizes each K-quant once: iter_gguf_weights leaves the Q8_0 rows that
    iter_gguf_quantized then hands out (the same rows it would make itself)."""
    from tokenmill.model.loader.gguf_loader import iter_gguf_quantized, iter_gguf_weights
    from tokenmill.model.loader.gguf_metadata import gguf_arch_config

    path = k_quant_gguf[0]
    arch = gguf_arch_config(path)
    made: dict[str, np.ndarray] = {}
    for _ in iter_gguf_weights(path, arch, made):
        pass
    assert len(made) == 2 * 7 + 1  # every matmul weight of both layers (K-quants, Q4_0, Q5_1); the table
    handed_out = {name: rows for name, _, rows in iter_gguf_quantized(path, arch, made)}
    assert not made
    for name, _, rows in iter_gguf_quantized(path, arch):
        np.testing.assert_array_equal(handed_out.pop(name), rows)


def test_blocks_that_serve_every_row_replace_the_float_weights(k_quant_gguf):
    """Where the blocks serve every row count (16-bit integer activations on a VNNI or AVX2 build),
    they are attached before loading and the float32 weights they replace are never made: the
    block layers hold no `weight`, only the embedding table (which a tied lm_head shares) and the
    norms stay float32. Elsewhere the float weights load and stay for the rows the blocks skip."""
    from tokenmill.kernels.cpu.quant_gemv import ALL_ROWS

    path, _, src = k_quant_gguf
    llm = LLM(
        str(path),
        tokenizer=str(src),
        device="cpu",
        max_model_len=128,
        kernel_config={"cpu_activation_bits": 16},
    )
    model = llm.engine.runner.model
    methods = [layer.self_attn.qkv_proj.method for layer in model.layers]
    serves_every_row = methods[0].max_rows >= ALL_ROWS
    for layer in model.layers:
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear = layer.get_submodule(name)
            assert quantized_blocks(linear) is not None, name
            assert ("weight" in linear._parameters) != serves_every_row, name
    assert model.lm_head.weight is model.embed_tokens  # tied: the table stays for the embedding
    float_bytes = sum(p.nbytes for p in model.parameters())
    table_bytes = model.embed_tokens.nbytes
    if serves_every_row:
        assert float_bytes < table_bytes * 1.01  # the table plus the norms
    # The roofline's bytes a token: the blocks decode reads (the tied table's too), not the float table.
    from tokenmill.model.layers.linear import linear_layers
    from tokenmill.worker.runner_facts import describe_runner

    blocks = [b for b in map(quantized_blocks, linear_layers(model)) if b is not None]
    read = sum((b.vnni if b.vnni is not None else b.blocks).nbytes for b in blocks)
    norms = sum(p.nbytes for name, p in model.named_parameters() if "norm" in name)
    if serves_every_row:
        assert describe_runner(llm.engine.runner, 0).decode_weight_bytes == read + norms
    out = llm.generate({"prompt_token_ids": [5, 17, 300, 42]}, SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
