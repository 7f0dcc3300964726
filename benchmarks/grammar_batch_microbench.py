"""Host cost of one constrained decode step of 64 requests, per-matcher calls vs xgrammar's batch
API, with the engine's classes: accept each request's token, fill the mask rows, apply the extra
(JSON) masks and the empty-row check. Modes alternate step by step over the same token streams (each
mode has its own matchers), so machine load hits them alike, and their masks must be equal.

Modes (`--modes`, comma-separated ACCEPT:FILL:THREADS): ACCEPT `loop` (RequestGrammar.accept per
request, the scheduler before batching), `batch` (batch_accept.accept_batch: the engine's one hook
call a step) or `xgr` (xgrammar's BatchGrammarMatcher.batch_accept_token, one C++ call); FILL
`loop` (a fill_next_token_bitmask call per matcher; per request and draft with `--drafts`) or
`batch` (BitmaskFiller: one batch call, per draft depth with drafts) on THREADS xgrammar threads.
`loop:batch:1` is the engine before this change on a machine whose "auto" is 1 thread.

64 requests walk the json-schema workload's examples (tokenized, compact JSON), restarting at the
end. `--drafts K`: each request also verifies its next K tokens as drafts, the last one wrong for
every other request (a rejected draft and the rows after it).

  python benchmarks/grammar_batch_microbench.py --tokenizer .gputok --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import xgrammar as xgr
from transformers import AutoTokenizer

from tokenmill.bench.json_schemas import SCHEMAS
from tokenmill.core.request import Request
from tokenmill.engine.structured_output.batch_accept import accept_batch
from tokenmill.engine.structured_output.bitmask import BitmaskFiller, restrict
from tokenmill.engine.structured_output.json_safe import json_safe_words
from tokenmill.engine.structured_output.request_grammar import RequestGrammar
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

ROWS = 64


class Mode:
    def __init__(
        self, spec: str, compiled: list, streams: list[list[int]], vocab: int, extra: np.ndarray
    ) -> None:
        self.name = spec
        accept, fill, threads = spec.split(":")
        self.accept = accept
        self.filler = BitmaskFiller(vocab, threads=int(threads), batch=fill == "batch")
        self.compiled, self.streams, self.extra = compiled, streams, extra
        self.request = Request(
            "r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="x"))
        )
        self.grammars = [self._new(i) for i in range(ROWS)]
        self.positions = [0] * ROWS
        self.times: dict[str, list[float]] = {"accept": [], "fill": [], "apply": [], "total": []}
        self.masks: list[bytes] = []

    def _new(self, i: int) -> RequestGrammar:
        return RequestGrammar(self.compiled[i % len(self.compiled)], self.request, self.extra)

    def step(self, drafts: int, keep: bool) -> None:
        tokens = [self.streams[i][self.positions[i]] for i in range(ROWS)]
        t0 = time.perf_counter()
        if self.accept == "xgr":
            verdicts = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in self.grammars], tokens)
            errors = [g.accepted(ok, t) for g, ok, t in zip(self.grammars, verdicts, tokens, strict=True)]
        elif self.accept == "batch":
            errors = accept_batch([(g, [], t) for g, t in zip(self.grammars, tokens, strict=True)])
        else:
            errors = [g.accept([], t) for g, t in zip(self.grammars, tokens, strict=True)]
        t1 = time.perf_counter()
        assert not any(errors), errors
        for i in range(ROWS):
            self.positions[i] += 1
        rows = [(f"r{i}", g) for i, g in enumerate(self.grammars) if g.needs_mask]
        grammars = [g for _, g in rows]
        if drafts:
            output = self.filler.fill(rows, self._drafts(drafts))
            t2 = t3 = time.perf_counter()
            mask = output.bitmask
        else:
            buffer = self.filler.buffer_for(len(rows))
            self.filler.fill_rows(grammars, buffer)
            t2 = time.perf_counter()
            restrict(buffer[: len(rows)], grammars)
            t3 = time.perf_counter()
            mask = buffer[: len(rows)].tobytes()
        for name, value in (("accept", t1 - t0), ("fill", t2 - t1), ("apply", t3 - t2), ("total", t3 - t0)):
            self.times[name].append(value)
        if keep:
            self.masks.append(mask)
        for i in range(ROWS):  # a stream at its end starts over (a new request in its place)
            if self.positions[i] == len(self.streams[i]) or not self.grammars[i].needs_mask:
                self.positions[i] = 0
                self.grammars[i] = self._new(i)

    def _drafts(self, k: int) -> dict[str, list[int]]:
        out = {}
        for i in range(ROWS):
            proposal = self.streams[i][self.positions[i] : self.positions[i] + k]
            if proposal and i % 2:
                proposal[-1] = self.streams[i][0]  # "{": wrong inside an object
            if proposal:
                out[f"r{i}"] = proposal
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=".gputok")
    parser.add_argument("--modes", default="loop:loop:1,loop:batch:1,xgr:batch:1,batch:batch:1,batch:batch:2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--drafts", type=int, default=0, help="draft tokens per request (0: none)")
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
    extra = json_safe_words(info.decoded_vocab, vocab)
    eos = tokenizer.eos_token_id
    streams = []
    for i in range(ROWS):
        text = json.dumps(SCHEMAS[i % len(SCHEMAS)].example, separators=(",", ":"))
        streams.append(tokenizer.encode(text, add_special_tokens=False) + [eos])
    modes = [Mode(spec, compiled, streams, vocab, extra) for spec in args.modes.split(",")]
    for mode in modes:  # requests start at different places of their streams, like a running batch
        for i in range(ROWS):
            for token in streams[i][: (i * 5) % (len(streams[i]) - 1)]:
                assert mode.grammars[i].accept([], token) is None
                mode.positions[i] += 1
    for n in range(args.steps):
        for mode in modes:
            mode.step(args.drafts, keep=n < 50)
    for mode in modes[1:]:
        assert mode.masks == modes[0].masks, f"{mode.name}: masks differ from {modes[0].name}"
    result = {
        "cpus": os.cpu_count(),
        "loadavg_1min": os.getloadavg()[0],
        "rows": ROWS,
        "vocab": vocab,
        "steps": args.steps,
        "drafts": args.drafts,
        "masks_equal_steps": min(args.steps, 50),
        "ms_p50": {
            m.name: {k: round(statistics.median(v) * 1000, 3) for k, v in m.times.items()} for m in modes
        },
        "ms_mean": {
            m.name: {k: round(statistics.fmean(v) * 1000, 3) for k, v in m.times.items()} for m in modes
        },
    }
    print(json.dumps(result))
    if args.result_name:
        from tokenmill.bench.results import write_result

        config = {k: result.pop(k) for k in ("rows", "vocab", "steps", "drafts")}
        print(f"wrote {write_result('grammar-batch-microbench', config, result, name=args.result_name)}")


if __name__ == "__main__":
    main()
