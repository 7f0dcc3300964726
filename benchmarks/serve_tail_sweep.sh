#!/usr/bin/env bash
# GPU serving under load (issue 24): for each request rate, a FRESH `tokenmill serve` (no warm-up
# traffic) with $MODEL's shapes (default Llama-3.1-8B) and dummy bf16 weights, traced (--trace-dir), driven by
# `tokenmill bench serve` with 512-token prompts and 256-token answers (Poisson arrivals, or all
# at once for "inf" = saturation). Each result JSON carries metrics.tail: where the slowest 1 % of
# requests spent their time (bench/tail.py).
#   RATES="8 16 24 32 inf" benchmarks/serve_tail_sweep.sh
# TOKENIZER: one whose vocabulary covers the model's; unset, benchmarks/make_dummy_tokenizer.py writes
# one of the model's vocab_size under /tmp. A smaller one (SmolLM2's 49,152 ids, the `.gputok` of the
# runs before 2026-12-05) on Llama-3.1-8B's 128,256 leaves 62 % of sampled ids without text, and
# `bench serve` times the first chunk with text: the slowest 1 % then wait ~10 tokens more (BENCHMARKS.md,
# "Issue 24, `--api-server-count 2` on the H200").
# Env: SECONDS_OF_LOAD per rate (40), SATURATION_PROMPTS (1000), SERVE_ARGS (extra server flags),
# TAG (result-name suffix), MAX_CONCURRENCY (unset: no cap; N: at most N requests in flight at every
# rate, a request's TTFT counted from when it is sent; with "inf" that is a closed loop of N, with a
# rate above capacity a loop whose requests start staggered; results named "-cN"). The result JSON goes to $OUT; the server and bench logs and the traces
# are packed into one $OUT/serve-tail-sweep$TAG-logs.tgz at the end (the device tool returns only a
# few files per call).
set -u
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-benchmarks/configs/llama-3.1-8b}
TOKENIZER=${TOKENIZER:-$(python3 benchmarks/make_dummy_tokenizer.py --for-model "$MODEL")} || exit 1
RATES=${RATES:-8 16 24 32 inf}
SECONDS_OF_LOAD=${SECONDS_OF_LOAD:-40}
SATURATION_PROMPTS=${SATURATION_PROMPTS:-1000}
SERVE_ARGS=${SERVE_ARGS:-}
TAG=${TAG:-}
DEVICE_NAME=${DEVICE_NAME:-$(python3 -c 'import torch; print(torch.cuda.get_device_name().split()[1].lower())' 2>/dev/null || echo gpu)}
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')

for rate in $RATES; do
  trace="$OUT/trace-rate-$rate$TAG"
  rm -rf "$trace"
  started=$(date +%s.%N)
  # shellcheck disable=SC2086
  "${TOKENMILL[@]}" serve --model "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" --max-model-len 4096 \
    --port 8000 --trace-dir "$trace" $SERVE_ARGS >"$OUT/server-rate-$rate$TAG.log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:8000/health >/dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 0.5
  done
  if ! curl -sf http://127.0.0.1:8000/health >/dev/null; then
    echo "rate $rate: server not healthy"; tail -30 "$OUT/server-rate-$rate$TAG.log"; kill $server 2>/dev/null; exit 1
  fi
  echo "rate $rate: server healthy after $(python3 -c "import time; print(round(time.time() - $started, 1))") s"
  limit=()
  name="serve-tail-$(basename "$MODEL")-$DEVICE_NAME-rate-$rate$TAG"
  if [ -n "${MAX_CONCURRENCY:-}" ]; then
    limit=(--max-concurrency "$MAX_CONCURRENCY")
    name="serve-tail-$(basename "$MODEL")-$DEVICE_NAME-rate-$rate-c$MAX_CONCURRENCY$TAG"
  fi
  if [ "$rate" = inf ]; then n=$SATURATION_PROMPTS; else n=$(python3 -c "print(max(200, int($rate * $SECONDS_OF_LOAD)))"); fi
  timeout 300 "${TOKENMILL[@]}" bench serve --tokenizer "$TOKENIZER" --dataset-name random --random-input-len 512 --random-output-len 256 \
    --num-prompts "$n" --request-rate "$rate" "${limit[@]}" --ignore-eos --disable-tqdm --server-trace-dir "$trace" \
    --save-result --result-dir "$OUT" --result-filename "$name" 2>&1 |
    tee "$OUT/bench-rate-$rate$TAG.log" | grep -vE "^(Total|Request|Benchmark|Successful|Maximum)" | tail -34
  kill -TERM $server
  wait $server
done
cd "$OUT" && tar czf "serve-tail-sweep$TAG-logs.tgz" server-rate-*"$TAG".log bench-rate-*"$TAG".log trace-rate-*"$TAG" &&
  rm -rf server-rate-*"$TAG".log bench-rate-*"$TAG".log trace-rate-*"$TAG"
