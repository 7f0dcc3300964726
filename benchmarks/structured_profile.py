"""Where a constrained decode step's host time goes: offline `LLM` (dummy weights at real shapes, a
tokenizer for the grammars), 64 requests plain then constrained by the json-schema workload's
schemas, wall time of each, then cProfile of the constrained run (top functions by own time).

  python benchmarks/structured_profile.py --model benchmarks/configs/llama-3.1-8b --tokenizer .gputok
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.json_schemas import SCHEMAS
from tokenmill.sampling_params import StructuredOutputsParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--num", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    llm = LLM(model=args.model, tokenizer=args.tokenizer, load_format="dummy", max_model_len=2048)
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(args.num)]
    constrained = [
        SamplingParams(
            temperature=0.0, max_tokens=256,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)].schema, disable_any_whitespace=True),
        )
        for i in range(args.num)
    ]  # fmt: skip
    llm.generate(prompts, constrained)  # compiles every grammar, warms the shapes
    started = time.perf_counter()
    outs = llm.generate(prompts, constrained)
    con_s = time.perf_counter() - started
    lengths = [max(1, len(o.outputs[0].token_ids)) for o in outs]
    valid = sum(_valid(o.outputs[0].text) for o in outs)
    reasons = [o.outputs[0].finish_reason for o in outs]
    errors = sorted({o.error for o in outs if o.error})
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts, plain)
    started = time.perf_counter()
    llm.generate(prompts, plain)
    plain_s = time.perf_counter() - started
    steps = max(lengths)
    print(json.dumps({
        "requests": args.num, "tokens": sum(lengths), "max_len": steps, "valid_json": valid,
        "finish_reasons": {r: reasons.count(r) for r in set(reasons)}, "errors": errors[:3],
        "constrained_s": round(con_s, 3), "plain_s": round(plain_s, 3), "ratio": round(con_s / plain_s, 3),
        "constrained_ms_per_step": round(con_s / steps * 1000, 2), "plain_ms_per_step": round(plain_s / steps * 1000, 2),
        "engine_stats": {k: v for k, v in llm.engine.get_stats().items() if k.endswith(("_sum", "_count"))},
    }))  # fmt: skip
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(prompts, constrained)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())


def _valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
