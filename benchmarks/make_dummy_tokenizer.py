"""Write a tokenizer whose every id decodes to visible text, for serving benchmarks on dummy weights.

A model with random weights samples ids from its whole vocabulary. Served with a smaller real
tokenizer (the default model's 49,152 ids on a 151,936-id Qwen3 shape), the ids beyond it decode
to no text, so the API server streams nothing for them and a client's TTFT / ITL also depend on
which ids came out (suspected in the MoE serving runs of BENCHMARKS.md, not established). This one is a
word-level vocabulary of exactly `--vocab-size` entries, id i <-> "w{i}", split on whitespace and
joined with spaces: every id is one visible word, and text made of them round-trips to the same
ids, so `bench serve --dataset-name random` prompts keep their length.

    python3 benchmarks/make_dummy_tokenizer.py .gputok-151936 --vocab-size 151936
    TOKENIZER=.gputok-151936 MODEL=benchmarks/configs/qwen3-30b-a3b benchmarks/serve_tail_sweep.sh
    python3 benchmarks/make_dummy_tokenizer.py --for-model benchmarks/configs/llama-3.1-8b  # prints its path

The serving scripts (serve_tail_sweep.sh, gpu_serve_suite.sh, disagg_itl.sh, multi_gpu.sh, spec_gpu.sh) use
--for-model when TOKENIZER is unset. Not for structured output: grammars need a real vocabulary
(and their masks sample only ids the tokenizer knows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

UNKNOWN = "w0"  # never produced by a round trip; text outside the vocabulary maps here


def build(vocab_size: int) -> Tokenizer:
    if vocab_size < 2:
        raise ValueError(f"--vocab-size must be at least 2, got {vocab_size}")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return tokenizer


def write(out_dir: Path, vocab_size: int) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    build(vocab_size).save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, "unk_token": UNKNOWN}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


def for_model(model_dir: Path, cache: Path) -> Path:
    """The dummy tokenizer of `model_dir`'s config.json vocab_size under `cache`, written once."""
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    out_dir = cache / f"dummy-tokenizer-{vocab_size}"
    return out_dir if (out_dir / "tokenizer.json").is_file() else write(out_dir, vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", help="where to write it (or --for-model)")
    parser.add_argument("--vocab-size", type=int, help="the model config's vocab_size")
    parser.add_argument(
        "--for-model",
        type=Path,
        help="a model directory: its config's vocab_size, written once under --cache; prints only the path",
    )
    parser.add_argument("--cache", type=Path, default=Path("/tmp"), help="where --for-model keeps them")
    args = parser.parse_args()
    if args.for_model is not None:
        print(for_model(args.for_model, args.cache))
        return
    if args.out_dir is None or args.vocab_size is None:
        parser.error("give OUT_DIR --vocab-size N, or --for-model MODEL_DIR")
    print(f"wrote {write(args.out_dir, args.vocab_size)} ({args.vocab_size} ids)")


if __name__ == "__main__":
    main()
