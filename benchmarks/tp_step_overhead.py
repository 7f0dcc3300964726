"""CPU: the per-step cost of tensor parallelism (gloo workers) against one process, decode steps.

For each tensor-parallel size, an `LLM` generates `--output-len` tokens for `--batch` random
prompts (greedy, EOS ignored), after one untimed warm-up call; the decode time per step is
(wall(output_len + 1 tokens) - wall(1 token)) / output_len, so prefill drops out. Sizes are
measured in turn, `--repeats` rounds (A B A B: the shared machine's load hits both), and the
median is kept. Every rank gets `--threads` torch threads (one process at TP=1).

Models: the default model (9 query / 3 KV heads: TP=1 and 3) and a Llama checkpoint written here
with random weights (hidden 512, 8 layers, 8 heads / 4 KV heads, ~30M parameters: TP=1, 2).

    PYTHONPATH=src python benchmarks/tp_step_overhead.py [--batch 1 8] [--output-len 32]

writes benchmarks/results/tp-step-overhead-cpu-<commit>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def write_llama_checkpoint(path: Path) -> Path:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def decode_ms_per_step(llm, batch: int, output_len: int, seed: int) -> float:  # noqa: ANN001
    import random

    from tokenmill import SamplingParams

    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(16)]} for _ in range(batch)]

    def wall(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    wall(2)  # warm-up
    return (wall(output_len + 1) - wall(1)) / output_len * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--models", nargs="+", default=["default-model", "llama-30m"], choices=["default-model", "llama-30m"]
    )
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the workers' budget: threads x size below

    import torch

    from tokenmill import LLM
    from tokenmill.bench.results import git_commit, write_result

    torch.set_num_threads(args.threads)
    from tokenmill.model.loader.default_model import default_model_path

    setups = {"default-model": (None, (1, 3)), "llama-30m": (None, (1, 2))}
    if "llama-30m" in args.models:
        llama = write_llama_checkpoint(Path(tempfile.mkdtemp(prefix="tp-bench-")) / "llama-30m")
        setups["llama-30m"] = (str(llama), (1, 2))
    setups = {name: setup for name, setup in setups.items() if name in args.models}
    # The random Llama has the default model's vocabulary size: it borrows its tokenizer.
    tokenizer = {"default-model": None, "llama-30m": str(default_model_path())}
    metrics: dict[str, dict] = {}
    for name, (model, sizes) in setups.items():
        engines = {}
        for size in sizes:
            os.environ["OMP_NUM_THREADS"] = str(args.threads * size)  # split back to `threads` per rank
            # cpu_quantized_gemv off: tensor parallelism runs the GGUF's dequantized fp32 weights, so TP=1 must too.
            engines[size] = LLM(
                model, tokenizer=tokenizer[name], device="cpu", max_model_len=256, num_kv_blocks=512,
                tensor_parallel_size=size, cpu_quantized_gemv=False,
            )  # fmt: skip
        for batch in args.batch:
            samples: dict[int, list[float]] = {size: [] for size in sizes}
            for repeat in range(args.repeats):
                for size in sizes:
                    samples[size].append(
                        decode_ms_per_step(engines[size], batch, args.output_len, seed=repeat)
                    )
            medians = {size: statistics.median(values) for size, values in samples.items()}
            base = medians[1]
            entry = {f"tp{size}_ms_per_step": round(ms, 3) for size, ms in medians.items()}
            entry.update({f"tp{size}_samples_ms": [round(v, 3) for v in samples[size]] for size in sizes})
            for size in sizes[1:]:
                entry[f"tp{size}_over_tp1"] = round(medians[size] / base, 3)
                entry[f"tp{size}_minus_tp1_ms"] = round(medians[size] - base, 3)
            metrics[f"{name}/batch{batch}"] = entry
            print(name, f"batch {batch}:", entry, flush=True)
        for llm in engines.values():
            llm.shutdown()
    path = write_result(
        "tp-step-overhead",
        {"batch": args.batch, "models_run": args.models, "output_len": args.output_len, "repeats": args.repeats, "threads_per_rank": args.threads,
         "models": {"default-model": "SmolLM2-135M-Instruct GGUF, dequantized fp32 (cpu_quantized_gemv off)",
                    "llama-30m": "random Llama, hidden 512, 8 layers, 8/4 heads, fp32"}},
        metrics,
        out_dir=args.out_dir,
        name=f"tp-step-overhead-cpu-{git_commit()[:7]}",
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
