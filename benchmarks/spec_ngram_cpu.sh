#!/usr/bin/env bash
# Issue 17 on the CPU: n-gram speculation against none, default model (SmolLM2-135M-Instruct), the
# copy-heavy workload of `bench serve` (chat prompts to rewrite / edit / extract from, 128-512
# tokens, max_tokens 128, greedy), at concurrency 1 and 8. Each side gets a fresh `tokenmill serve`:
#   off: no speculation;  on: --speculative-config '{"method": "ngram", "num_speculative_tokens": K}'
# and runs both concurrencies on it. Writes spec-ngram-cpu-<TAG>-<side>-c<N>.json (bench serve's
# results; the "on" ones carry metrics.spec_decode) and spec-ngram-cpu-<TAG>-summary.json (output
# tok/s on / off per concurrency, acceptance) to OUT, and prints the summary.
#   benchmarks/spec_ngram_cpu.sh                 both sides (about 5 minutes on 2 cores)
#   SIDES=off benchmarks/spec_ngram_cpu.sh       one side only (the summary needs both)
# Env: SIDES ("off on"), K (4), NUM_PROMPTS_C1 (32), NUM_PROMPTS_C8 (64), WARMUPS (2), SEED (0),
# PORT (8743), PY (.venv/bin/python, else python3), OUT (benchmarks/results), LOGS (server logs,
# /tmp/tokenmill-spec-ngram), TAG (result name part; default: the short commit),
# TOKENMILL_COMMIT (a copy of the tree without .git).
set -u
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "usage: [SIDES='off on'] [K=4] [OUT=benchmarks/results] benchmarks/spec_ngram_cpu.sh"
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "spec_ngram_cpu.sh takes no arguments (settings come from the environment; see --help), got: $*" >&2
  exit 2
fi
SIDES=${SIDES:-off on}
K=${K:-4}
NUM_PROMPTS_C1=${NUM_PROMPTS_C1:-32}
NUM_PROMPTS_C8=${NUM_PROMPTS_C8:-64}
WARMUPS=${WARMUPS:-2}
SEED=${SEED:-0}
PORT=${PORT:-8743}
OUT=${OUT:-benchmarks/results}
LOGS=${LOGS:-/tmp/tokenmill-spec-ngram}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || echo "${TOKENMILL_COMMIT:-unknown}")}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TOKENMILL=("$PY" -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')
NAME=spec-ngram-cpu-$TAG
started=$(date +%s)

server=
stop_server() {
  if [ -n "$server" ]; then
    kill -TERM "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    server=
  fi
}
trap stop_server EXIT

for side in $SIDES; do
  case $side in
    off) spec=() ;;
    on) spec=(--speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K}") ;;
    *) echo "SIDES holds off and/or on, got '$side'" >&2; exit 2 ;;
  esac
  echo "== $side: starting tokenmill serve on port $PORT (log $LOGS/server-$side.log)"
  "${TOKENMILL[@]}" serve --port "$PORT" --max-model-len 1024 "${spec[@]}" >"$LOGS/server-$side.log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || break
    sleep 1
  done
  if ! curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
    echo "the $side server did not come up; last lines of its log:" >&2
    tail -20 "$LOGS/server-$side.log" >&2
    exit 1
  fi
  for concurrency in 1 8; do
    if [ "$concurrency" = 1 ]; then prompts=$NUM_PROMPTS_C1; else prompts=$NUM_PROMPTS_C8; fi
    echo "== $side, concurrency $concurrency, $prompts prompts"
    # Warm-ups are the first prompts again (compiles, caches). Each concurrency has its own seed: the
    # c8 prompts are not the c1 ones (no prefix-cache hits carried over from the run before).
    timeout 600 "${TOKENMILL[@]}" bench serve --port "$PORT" --endpoint /v1/chat/completions \
      --dataset-name copy-heavy --num-prompts "$prompts" --max-concurrency "$concurrency" \
      --num-warmups "$WARMUPS" --seed "$((SEED + concurrency))" --temperature 0 --disable-tqdm --save-result \
      --result-dir "$OUT" --result-filename "$NAME-$side-c$concurrency" 2>&1 |
      grep -E "Successful|Failed|Output token|Mean TPOT|Mean TTFT|Draft|Accept|acceptance|failed" || true
    if [ ! -f "$OUT/$NAME-$side-c$concurrency.json" ]; then
      echo "bench serve wrote no result for $side c$concurrency; see above" >&2
      exit 1
    fi
  done
  stop_server
done

"$PY" benchmarks/spec_ngram_summary.py --result-dir "$OUT" --name "$NAME"
echo "took $(($(date +%s) - started)) s"
