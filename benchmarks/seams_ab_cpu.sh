#!/usr/bin/env bash
# Issue 13 (the seams) on the CPU: the engine before the refactor (8a66eea's src/ in .before/src)
# against this tree, alternating on one quiet machine, default model:
#   offline `bench throughput` 64 x 128/128 (before, after, before, after) and `bench serve` at
#   concurrency 32, 64 prompts of 128/128, each against its own `tokenmill serve` (before, after).
#   AFTER_COMMIT=<id> OUT=/tmp/ab-cpu benchmarks/seams_ab_cpu.sh
set -u
OUT=${OUT:-/tmp/tokenmill-ab-cpu}
mkdir -p "$OUT"
AFTER_COMMIT=${AFTER_COMMIT:-after}
BEFORE_COMMIT=8a66eea
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-throughput,serve}
has() { [[ ",$STEPS," == *",$1,"* ]]; }

# `tm LIMIT_S SIDE ARGS...`: the CLI of one side (LIMIT_S 0: no time limit).
tm() {
  local limit=$1 side=$2
  shift 2
  local src=src commit=$AFTER_COMMIT
  if [ "$side" = before ]; then src=.before/src commit=$BEFORE_COMMIT; fi
  PYTHONPATH=$src TOKENMILL_COMMIT=$commit timeout "$limit" \
    "$PY" -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())' "$@"
}

# A server of one side, in the background: `serve_side SIDE ARGS... &` (exec, so $! is the server).
serve_side() {
  local side=$1
  shift
  local src=src commit=$AFTER_COMMIT
  if [ "$side" = before ]; then src=.before/src commit=$BEFORE_COMMIT; fi
  PYTHONPATH=$src TOKENMILL_COMMIT=$commit exec "$PY" \
    -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())' serve "$@"
}

if has throughput; then
  for run in a b; do
    for side in before after; do
      echo "== throughput $side $run"
      tm 600 $side bench throughput --num-prompts 64 --input-len 128 --output-len 128 --max-model-len 512 \
        --result-dir "$OUT" --result-name "throughput-cpu-$side-$run" 2>&1 | grep -vE "it/s\]|s/it\]" | tail -3
    done
  done
fi

if has serve; then
  for side in before after; do
    echo "== serve c32 $side"
    serve_side $side --port 8741 >"$OUT/server-cpu-$side.log" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do
      curl -sf http://127.0.0.1:8741/health >/dev/null && break
      sleep 1
    done
    tm 600 after bench serve --port 8741 --dataset-name random --num-prompts 64 --random-input-len 128 \
      --random-output-len 128 --max-concurrency 32 --ignore-eos --disable-tqdm --save-result \
      --result-dir "$OUT" --result-filename "serve-cpu-c32-$side" 2>&1 |
      grep -E "TTFT|TPOT|ITL|throughput|Successful|Failed" | head -12
    kill -TERM $server
    wait $server
  done
fi
