"""Where a constrained decode step's host time goes: offline `LLM` (dummy weights at real shapes, a
tokenizer for the grammars), 64 requests plain then constrained by the json-schema workload's
schemas, wall time of each, then cProfile of the constrained run (top functions by own time).

  python benchmarks/structured_profile.py --model benchmarks/configs/llama-3.1-8b --tokenizer .gputok
  (GPU A/B of xgrammar threads and the early fill, ~2-3 min on an H200: add
   --fill-threads 1,4,8 --fill-chunks 0,64 --rounds 2)

`--fill-chunks 0,8` times the constrained run once per TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK value,
alternating (`--rounds` times), in one engine: 0 fills a step's rows after all its accepts, N sends
them to the fill thread N at a time as the tokens are accepted (async scheduling only).
`--fill-threads 1,8` does the same for TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS (xgrammar threads of
the step's batch fill), and also times the plain run in each round: "ratio_by_fill_threads" is
constrained / plain wall time of the same round. `--tiny`
replaces the model by a 1-layer hidden-16 one with the same 128K vocabulary, so on a CPU a step is
mostly the host work that constraints add (the mask is as wide as on the GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import tempfile
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
    parser.add_argument("--async-scheduling", action="store_true", help="also on a CPU (the default on CUDA)")
    parser.add_argument("--fill-chunks", default="", help="comma-separated chunk sizes to compare, e.g. 0,8")
    parser.add_argument("--fill-threads", default="", help="comma-separated xgrammar thread counts to compare, e.g. 1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="--model's config at 1 layer, hidden 16")
    args = parser.parse_args()
    model = _tiny(args.model) if args.tiny else args.model
    extra = {"async_scheduling": True} if args.async_scheduling else {}
    llm = LLM(model=model, tokenizer=args.tokenizer, load_format="dummy", max_model_len=2048, **extra)
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
    by_chunk: dict[str, list[float]] = {}
    chunk_env = os.environ.get("TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK")
    for _ in range(args.rounds if args.fill_chunks else 0):
        for chunk in args.fill_chunks.split(","):
            os.environ["TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK"] = chunk
            wall, mask_ms = _timed_constrained_run(llm, prompts, constrained, outs, steps)
            by_chunk.setdefault(chunk, []).append(round(wall / steps * 1000, 2))
            by_chunk.setdefault(chunk + "_mask_after_accepts", []).append(round(mask_ms, 2))
    if args.fill_chunks:  # the thread comparison below runs at the caller's chunk setting
        os.environ.pop("TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK", None)
        if chunk_env is not None:
            os.environ["TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK"] = chunk_env
    by_threads: dict[str, list[float]] = {}
    for _ in range(args.rounds if args.fill_threads else 0):
        for threads in args.fill_threads.split(","):
            os.environ["TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS"] = threads
            wall, mask_ms = _timed_constrained_run(llm, prompts, constrained, outs, steps)
            started = time.perf_counter()
            llm.generate(prompts, plain)
            plain_wall = time.perf_counter() - started
            by_threads.setdefault(threads, []).append(round(wall / steps * 1000, 2))
            by_threads.setdefault(threads + "_plain", []).append(round(plain_wall / steps * 1000, 2))
            by_threads.setdefault(threads + "_ratio", []).append(round(wall / plain_wall, 3))
            by_threads.setdefault(threads + "_mask_after_accepts", []).append(round(mask_ms, 2))
    print(json.dumps({
        "requests": args.num, "tokens": sum(lengths), "max_len": steps, "valid_json": valid,
        "finish_reasons": {r: reasons.count(r) for r in set(reasons)}, "errors": errors[:3],
        "constrained_s": round(con_s, 3), "plain_s": round(plain_s, 3), "ratio": round(con_s / plain_s, 3),
        "constrained_ms_per_step": round(con_s / steps * 1000, 2), "plain_ms_per_step": round(plain_s / steps * 1000, 2),
        "constrained_ms_per_step_by_fill_chunk": by_chunk,
        "ms_per_step_by_fill_threads": by_threads,
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


def _mask_sum(llm: LLM) -> float:
    return llm.engine.get_stats().get("structured_output_mask_seconds_sum", 0.0)


def _timed_constrained_run(llm: LLM, prompts, constrained, first_outputs, steps: int) -> tuple[float, float]:  # noqa: ANN001
    """The constrained batch again: its wall seconds and mask ms per step; greedy tokens unchanged."""
    before = _mask_sum(llm)
    started = time.perf_counter()
    again = llm.generate(prompts, constrained)
    wall = time.perf_counter() - started
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first_outputs], (
        "greedy outputs changed"
    )
    return wall, (_mask_sum(llm) - before) / steps * 1000


def _tiny(model: str) -> str:
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, torch_dtype="float32")  # fmt: skip
    path = tempfile.mkdtemp(prefix="tiny-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
