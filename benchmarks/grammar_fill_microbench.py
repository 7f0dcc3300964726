import json, time, os
import xgrammar as xgr
from transformers import AutoTokenizer
from tokenmill.bench.json_schemas import SCHEMAS
tok = AutoTokenizer.from_pretrained(".gputok")
V = 128256
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
comp = xgr.GrammarCompiler(info)
t = time.perf_counter(); gs = [comp.compile_json_schema(json.dumps(c.schema), any_whitespace=False, separators=(",", ":")) for c in SCHEMAS]; ct = time.perf_counter() - t
ms = []
for i in range(64):
    g = gs[i % len(gs)]; m = xgr.GrammarMatcher(g)
    ex = json.dumps(SCHEMAS[i % len(gs)].example, separators=(",", ":"))
    m.accept_string(ex[: (i * 7) % len(ex)]); ms.append(m)
bm = xgr.allocate_token_bitmask(64, V).numpy()
print("cpus", os.cpu_count(), "compile 14 schemas s", round(ct, 2))
for threads in (1, 2, 4, 8, "auto"):
    b = xgr.BatchGrammarMatcher(max_threads=threads)
    b.batch_fill_next_token_bitmask(ms, bm)
    t = time.perf_counter()
    for _ in range(50): b.batch_fill_next_token_bitmask(ms, bm)
    print("threads", threads, "fill 64 rows ms", round((time.perf_counter() - t) / 50 * 1000, 3))
