"""xgrammar's bitmask fill for one decode step of 64 constrained requests at a 128K vocabulary
(Llama-3.1 logits width; SmolLM2's tokenizer), by BatchGrammarMatcher thread count, plus a
one-by-one accept_token pass: the host work a constrained step adds.

  python benchmarks/grammar_fill_microbench.py [TOKENIZER_DIR]   (default .gputok)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import xgrammar as xgr
from transformers import AutoTokenizer

from tokenmill.bench.json_schemas import SCHEMAS

VOCAB = 128256
ROWS = 64
REPEATS = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizer", nargs="?", default=".gputok", help="a tokenizer directory")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info)
    started = time.perf_counter()
    grammars = [
        compiler.compile_json_schema(json.dumps(c.schema), any_whitespace=False, separators=(",", ":"))
        for c in SCHEMAS
    ]
    compile_s = time.perf_counter() - started
    matchers = []
    for i in range(ROWS):
        matcher = xgr.GrammarMatcher(grammars[i % len(grammars)])
        example = json.dumps(SCHEMAS[i % len(grammars)].example, separators=(",", ":"))
        matcher.accept_string(example[: (i * 7) % len(example)])  # somewhere inside the object
        matchers.append(matcher)
    bitmask = xgr.allocate_token_bitmask(ROWS, VOCAB).numpy()
    print(f"cpus {os.cpu_count()}, {len(grammars)} schemas compiled in {compile_s:.2f} s")
    for threads in (1, 2, 4, 8, "auto"):
        batch = xgr.BatchGrammarMatcher(max_threads=threads)
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        started = time.perf_counter()
        for _ in range(REPEATS):
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
        print(f"threads {threads}: fill {ROWS} rows {(time.perf_counter() - started) / REPEATS * 1000:.3f} ms")
    space = tokenizer.encode(" ", add_special_tokens=False)
    forks = [m.fork() for m in matchers]
    started = time.perf_counter()
    for matcher in forks:
        for token in space:
            matcher.accept_token(token)
    print(f"accept_token one by one: {(time.perf_counter() - started) * 1000:.3f} ms for {ROWS} requests")


if __name__ == "__main__":
    main()
