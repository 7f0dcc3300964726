"""Write a GGUF with random quantized weights at a real model's shapes, for CPU benchmarks of GGUF files.

No hub is reachable here, so the benchmarks cannot download a Q4_K_M file; this writes one of the
same shapes and block types from an HF config.json (Llama family: `general.architecture` llama),
with random blocks whose float16 scales keep weights within a few tenths. `--recipe q4_k_m` follows
llama.cpp's Q4_K_M mix in spirit: Q4_K for q / k / o / gate / up, Q6_K for v, down and the table
(tied) or output; `q8_0` and `q4_1` write every matmul in that type (the kernels' own types);
norms stay F32. The vocabulary inside is make_dummy_tokenizer.py's words ("w0", "w1", ...) as a
gpt2-type token list without merges, enough for llama.cpp to load the file (send it token ids);
tokenmill takes the same words with --tokenizer (make_dummy_tokenizer.py --for-model CONFIG_DIR).

    python3 benchmarks/make_dummy_gguf.py benchmarks/configs/llama-3.2-1b /tmp/llama-3.2-1b-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from tqdm import tqdm

RECIPES = {
    "q4_k_m": {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
               "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "table": Q.Q6_K},
    "q8_0": dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "table"), Q.Q8_0),
    "q4_1": dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "table"), Q.Q4_1),
}  # fmt: skip
# Byte offsets of each block type's float16 scale(s) and a value that keeps weights small.
_SCALES = {
    Q.Q4_K: ((0, 4e-4), (2, 2e-3)),  # d, dmin
    Q.Q6_K: ((208, 2e-5),),  # d (after ql, qh, scales)
    Q.Q8_0: ((0, 1e-3),),
    Q.Q4_1: ((0, 1e-2), (2, -0.07)),  # d, m
}


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: Q) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[kind]
    if cols % block:
        raise ValueError(f"{kind.name} needs rows of a multiple of {block} weights, got {cols}")
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset, value in _SCALES[kind]:
        data[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write(config_dir: Path, out: Path, recipe: str, seed: int = 0) -> Path:
    cfg = json.loads((config_dir / "config.json").read_text())
    if cfg.get("architectures", ["LlamaForCausalLM"])[0] != "LlamaForCausalLM":
        raise ValueError(f"{config_dir}: only Llama-family configs are written (GGUF architecture llama)")
    types = RECIPES[recipe]
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(str(out), arch="llama")
    writer.add_name(config_dir.name)
    writer.add_block_count(layers)
    writer.add_context_length(min(int(cfg["max_position_embeddings"]), 8192))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"w{i}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["w 0"])  # llama.cpp refuses a gpt2 vocabulary without merges
    eos = cfg.get("eos_token_id")
    writer.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos or 0))
    rng = np.random.default_rng(seed)
    shapes = {
        "attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter),
    }  # fmt: skip

    def add(name: str, rows: int, cols: int, kind: Q) -> None:
        raw = random_blocks(rng, rows, cols, kind)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)

    add("token_embd.weight", vocab, hidden, types["table"])
    if not cfg.get("tie_word_embeddings", False):
        add("output.weight", vocab, hidden, types["table"])
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in tqdm(range(layers), desc="layers", unit="layer"):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, dtype=np.float32))
        for name, (rows, cols) in shapes.items():
            add(f"blk.{layer}.{name}.weight", rows, cols, types[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir", type=Path, help="a directory with an HF config.json (Llama family)")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="q4_k_m")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.config_dir, args.out, args.recipe, args.seed))


if __name__ == "__main__":
    main()
