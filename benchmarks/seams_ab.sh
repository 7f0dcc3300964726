#!/usr/bin/env bash
# Issue 13 (the seams): the engine before the refactor against the engine after it, in ONE device call
# on one machine, alternating, so the ratio is not a difference between machines.
#   "before": a checkout of 8a66eea's src/ in .before/src (git archive 8a66eea src | tar -x -C .before)
#   (BEFORE_COMMIT=<id> labels another before, e.g. the engine before issue 15 at ebdb7e7)
#   "after":  this tree's src/
#   AFTER_COMMIT=<id> STEPS=latency,throughput,serve benchmarks/seams_ab.sh
# Llama-3.1-8B shapes, dummy bf16 weights: `bench latency` 512 in / 256 out (before, after, before,
# after), offline `bench throughput` 512 x 512/256 (before, after), and `bench serve` at 8 req/s
# against each engine's own `tokenmill serve` (TOKENIZER: any tokenizer whose ids fit the vocabulary).
# Logs and result JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/tokenmill-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/llama-3.1-8b
STEPS=${STEPS:-latency,throughput,serve}
AFTER_COMMIT=${AFTER_COMMIT:-after}
BEFORE_COMMIT=${BEFORE_COMMIT:-8a66eea}  # another "before": BEFORE_COMMIT=<id> with its src in .before
TOKENIZER=${TOKENIZER:-.gputok}
SERVE_PROMPTS=${SERVE_PROMPTS:-160}
SERVE_ORDER=${SERVE_ORDER:-before after}  # "after before" repeats the A/B in the other order
has() { [[ ",$STEPS," == *",$1,"* ]]; }

# The CLI of one side under a time limit: PYTHONPATH picks the tree, TOKENMILL_COMMIT labels its
# result files. `tm LIMIT_S SIDE ARGS...` (LIMIT_S 0: none).
tm() {
  local limit=$1 side=$2
  shift 2
  local src=src commit=$AFTER_COMMIT
  if [ "$side" = before ]; then src=.before/src commit=$BEFORE_COMMIT; fi
  PYTHONPATH=/tmp/site:$src TOKENMILL_COMMIT=$commit timeout "$limit" \
    python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())' "$@"
}

nvidia-smi -L

# A server of one side, in the background: `serve_side SIDE ARGS... &` (exec, so $! is the server).
serve_side() {
  local side=$1
  shift
  local src=src commit=$AFTER_COMMIT
  if [ "$side" = before ]; then src=.before/src commit=$BEFORE_COMMIT; fi
  PYTHONPATH=/tmp/site:$src TOKENMILL_COMMIT=$commit exec python3 \
    -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())' serve "$@"
}

if has latency; then
  for run in a b; do
    for side in before after; do
      echo "== latency $side $run"
      tm 200 $side bench latency --model "$MODEL" --load-format dummy --input-len 512 --output-len 256 \
        --max-model-len 4096 --result-dir "$OUT" --result-name "latency-$side-$run" 2>&1 |
        tee "$OUT/latency-$side-$run.log" | grep -E "decode|roofline|tok/s" | tail -4
    done
  done
fi

if has throughput; then
  for side in before after; do
    echo "== throughput $side"
    tm 240 $side bench throughput --model "$MODEL" --load-format dummy --num-prompts 512 --input-len 512 \
      --output-len 256 --max-model-len 4096 --result-dir "$OUT" --result-name "throughput-$side" 2>&1 |
      tee "$OUT/throughput-$side.log" | grep -vE "it/s\]|s/it\]" | tail -4
  done
fi

if has serve; then
  for side in $SERVE_ORDER; do
    echo "== serve rate 8 $side"
    serve_side $side --model "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" --max-model-len 4096 --port 8000 \
      >"$OUT/server-$side.log" 2>&1 &
    server=$!
    for _ in $(seq 1 240); do
      curl -sf http://127.0.0.1:8000/health >/dev/null && break
      sleep 1
    done
    if curl -sf http://127.0.0.1:8000/health >/dev/null; then
      tm 200 after bench serve --dataset-name random --random-input-len 512 --random-output-len 256 \
        --num-prompts "$SERVE_PROMPTS" --request-rate 8 --ignore-eos --num-warmups 16 --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "serve-rate-8-$side${SERVE_TAG:-}" 2>&1 |
        tee "$OUT/serve-$side.log" | grep -E "TTFT|TPOT|ITL|throughput|Successful|Failed" | head -20
    else
      echo "server ($side) not healthy"
      tail -30 "$OUT/server-$side.log"
    fi
    kill -TERM $server
    wait $server
  done
fi
