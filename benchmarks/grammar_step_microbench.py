"""The host time a constrained decode step adds after its forward is launched (async scheduling):
accepting the previous step's 64 tokens, then the mask of the next step ready. That chain is what
the device waits for when it outlasts the forward. Timed with the engine's own classes
(RequestGrammar, BitmaskFiller, StepFill, one fill thread), for each chunk size: 0 = every row
filled after all accepts (the engine before StepFill), N = rows sent to the fill thread N at a time
as their tokens are accepted. Modes alternate step by step over the same token streams (each mode
has its own matchers), so machine load hits them alike.

64 requests walk the json-schema workload's examples (tokenized, compact JSON), restarting at the
end. `--work-us` adds that much pure-Python work per request between accepts, standing in for the
rest of the scheduler's update (the engine spends ~25 us a request there on the development CPU).

  python benchmarks/grammar_step_microbench.py --tokenizer .gputok --chunks 0,8,16 --steps 300
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time

import numpy as np
import xgrammar as xgr
from transformers import AutoTokenizer

from tokenmill.bench.json_schemas import SCHEMAS
from tokenmill.core.request import Request
from tokenmill.engine.structured_output.bitmask import BitmaskFiller
from tokenmill.engine.structured_output.request_grammar import RequestGrammar
from tokenmill.engine.structured_output.step_fill import StepFill
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

ROWS = 64


class Mode:
    """One chunk size's matchers (same streams, same positions as every other mode)."""

    def __init__(self, chunk: int, compiled: list, streams: list[list[int]], vocab: int) -> None:
        self.chunk = chunk
        self.compiled = compiled
        self.streams = streams
        self.filler = BitmaskFiller(vocab)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self.request = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="x")))
        self.grammars = [self._new(i) for i in range(ROWS)]
        self.positions = [0] * ROWS
        self.times: list[float] = []
        self.accept_times: list[float] = []
        self.masks: list[bytes] = []

    def _new(self, i: int) -> RequestGrammar:
        return RequestGrammar(self.compiled[i % len(self.compiled)], self.request)

    def step(self, work_us: float, keep_masks: bool) -> None:
        ids = [f"r{i}" for i in range(ROWS)]
        by_id = dict(zip(ids, self.grammars, strict=True))
        started = time.perf_counter()
        step = None
        if self.chunk > 0:
            step = StepFill(ids, self.filler.buffer_for(ROWS), self.pool, self.filler.fill_rows, self.chunk)
        for i, grammar in enumerate(self.grammars):
            error = grammar.accept([], self.streams[i][self.positions[i]])
            assert error is None, error
            if step is not None:
                step.accepted(ids[i], grammar)
            _busy(work_us)
        self.accept_times.append(time.perf_counter() - started)
        if step is not None:
            output = step.finish(by_id).result()
        else:
            rows = [(ids[i], g) for i, g in enumerate(self.grammars) if g.needs_mask]
            output = self.pool.submit(self.filler.fill, rows).result()
        self.times.append(time.perf_counter() - started)
        if keep_masks:
            self.masks.append(output.bitmask)
        for i in range(ROWS):  # a stream at its end starts over (a new request in its place)
            self.positions[i] += 1
            if self.positions[i] == len(self.streams[i]):
                self.positions[i] = 0
                self.grammars[i] = self._new(i)


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=".gputok")
    parser.add_argument("--chunks", default="0,8,16")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--work-us", type=float, default=0.0)
    parser.add_argument("--result-name", default=None, help="write benchmarks/results/NAME.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    compiled = [
        compiler.compile_json_schema(json.dumps(c.schema), any_whitespace=False, separators=(",", ":"))
        for c in SCHEMAS
    ]
    eos = tokenizer.eos_token_id
    streams = []
    for i in range(ROWS):
        text = json.dumps(SCHEMAS[i % len(SCHEMAS)].example, separators=(",", ":"))
        streams.append(tokenizer.encode(text, add_special_tokens=False) + [eos])
    # Requests start at different places of their streams, like a running batch.
    chunks = [int(c) for c in args.chunks.split(",")]
    modes = [Mode(c, compiled, streams, vocab) for c in chunks]
    for mode in modes:
        for i in range(ROWS):
            for token in streams[i][: (i * 5) % (len(streams[i]) - 1)]:
                assert mode.grammars[i].accept([], token) is None
                mode.positions[i] += 1
    for n in range(args.steps):
        for mode in modes:
            mode.step(args.work_us, keep_masks=n < 50)
    for mode in modes[1:]:
        assert mode.masks == modes[0].masks, f"chunk {mode.chunk}: masks differ from chunk {modes[0].chunk}"
    result = {
        "cpus": os.cpu_count(),
        "loadavg_1min": os.getloadavg()[0],
        "rows": ROWS,
        "vocab": vocab,
        "steps": args.steps,
        "work_us_per_request": args.work_us,
        "accept_then_mask_ms": {
            str(m.chunk): {
                "p50": round(statistics.median(m.times) * 1000, 3),
                "mean": round(statistics.fmean(m.times) * 1000, 3),
                "p90": round(float(np.percentile(m.times, 90)) * 1000, 3),
                "accepts_p50": round(statistics.median(m.accept_times) * 1000, 3),
            }
            for m in modes
        },
    }
    print(json.dumps(result))
    if args.result_name:
        from tokenmill.bench.results import write_result

        config = {k: result.pop(k) for k in ("rows", "vocab", "steps", "work_us_per_request")}
        print(f"wrote {write_result('grammar-step-microbench', config, result, name=args.result_name)}")
    for mode in modes:
        mode.pool.shutdown()


if __name__ == "__main__":
    main()
