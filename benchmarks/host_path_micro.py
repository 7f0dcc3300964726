"""Micro-timings (best of 7) of the host-path functions the host-step work changed, for an A/B of two
source trees run one after the other (same machine, alternating):

  for tree in /tmp/base/src src; do PYTHONPATH=$tree:. python benchmarks/host_path_micro.py --tokenizer .gputok; done

build_host_batch (64 in-flight decodes and two 256-token prefill chunks; also from the runner's
kept numpy block tables where the tree has them), a stats histogram's
stats(), needs_mask + is_terminated of 64 live JSON grammars (what a step's fill and stop checks
ask), and one step's extra masks (64 JSON rows over the tokenizer's vocabulary). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np


def best(f, n: int, reps: int = 7) -> float:  # noqa: ANN001
    b = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            f()
        b = min(b, (time.perf_counter() - t) / n)
    return round(b * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokenizer", default=None, help="an HF tokenizer directory (default: the tests' tiny BPE)"
    )
    args = parser.parse_args()
    out: dict[str, float] = {}
    # 1. build_host_batch: 64 in-flight decodes + 2 prefill chunks of 256
    from tokenmill.core.outputs import NewRequestData
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.batch_inputs import build_host_batch
    from tokenmill.worker.request_state import RequestState

    rng = random.Random(0)
    reqs = []
    nc = []
    ns = []
    for i in range(64):
        plen = rng.randint(100, 600)
        o = rng.randint(1, 200)
        toks = [rng.randrange(1000) for _ in range(plen + o)]
        nb = -(-(plen + o + 1) // 16)
        st = RequestState(
            NewRequestData(
                f"r{i}",
                toks[:plen],
                SamplingParams(temperature=0),
                (2,),
                [list(range(i * 100, i * 100 + nb))],
                0,
                toks[plen:],
                None,
            )
        )
        st.num_tokens += 1
        reqs.append(st)
        nc.append(plen + o)
        ns.append(1)
    for i in range(2):
        toks = [rng.randrange(1000) for _ in range(512)]
        reqs.append(
            RequestState(
                NewRequestData(
                    f"p{i}",
                    toks,
                    SamplingParams(temperature=0),
                    (2,),
                    [list(range(9000 + i * 100, 9020 + i * 100))],
                    0,
                    [],
                    None,
                )
            )
        )
        nc.append(64 * i)
        ns.append(256)
    out["build_host_batch_us"] = best(lambda: build_host_batch(reqs, nc, ns, 16), 300)
    out["build_host_batch_fixed_width_us"] = best(
        lambda: build_host_batch(reqs, nc, ns, 16, block_table_width=256), 300
    )
    try:  # the runner's kept numpy block tables (trees that have them)
        from tokenmill.worker.request_state import BlockTables
    except ImportError:
        BlockTables = None  # noqa: N806
    if BlockTables is not None:
        kept = BlockTables()
        for state in reqs:
            kept.add(state)
        out["build_host_batch_kept_tables_us"] = best(
            lambda: build_host_batch(reqs, nc, ns, 16, tables=kept), 300
        )
        out["build_host_batch_kept_tables_fixed_width_us"] = best(
            lambda: build_host_batch(reqs, nc, ns, 16, block_table_width=256, tables=kept), 300
        )
    # 2. stats histogram
    from tokenmill.stats_histogram import StatsHistogram

    h = StatsHistogram("iteration_tokens_total", tuple(float(2**i) for i in range(15)))
    out["histogram_stats_us"] = best(h.stats, 3000)
    # 3. grammar: needs_mask + is_terminated of 64 live JSON grammars (what _rows and _check_stop ask)
    import xgrammar as xgr
    from tests.conftest import build_tiny_tokenizer
    from transformers import AutoTokenizer

    from tokenmill.bench.json_schemas import SCHEMAS
    from tokenmill.core.request import Request
    from tokenmill.engine.structured_output.bitmask import apply_extra_masks
    from tokenmill.engine.structured_output.request_grammar import RequestGrammar
    from tokenmill.sampling_params import StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else build_tiny_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    comp = xgr.GrammarCompiler(info)
    grammars = []
    for i in range(64):
        case = SCHEMAS[i % len(SCHEMAS)]
        req = Request(
            f"r{i}", [1], SamplingParams(structured_outputs=StructuredOutputsParams(json=case.schema))
        )
        g = RequestGrammar(comp.compile_json_schema(json.dumps(case.schema), any_whitespace=False), req)
        g.matcher.accept_string(json.dumps(case.example, separators=(",", ":"))[: 3 + i % 15])
        grammars.append(g)
    out["needs_mask_and_is_terminated_64_us"] = best(
        lambda: [(g.needs_mask, g.is_terminated) for g in grammars], 300
    )
    # 4. a step's extra masks: 64 JSON rows over the tokenizer's vocabulary (one shared mask)
    words = -(-len(tok) // 32)
    rows = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, size=(64, words), dtype=np.int32)
    mask = np.random.default_rng(1).integers(-(2**31), 2**31 - 1, size=words, dtype=np.int32)
    for g in grammars:
        g.extra_mask = mask
    out["extra_masks_64_rows_us"] = best(lambda: apply_extra_masks(rows, grammars), 100)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
