#!/usr/bin/env bash
# Disaggregated prefill/decode on ONE GPU (issue 21): a colocated engine against a producer and a
# consumer sharing the GPU (half the colocated KV pool each) behind the router in disaggregated
# mode, long prompts arriving while others decode (Poisson arrivals): ITL and TTFT percentiles and
# output throughput from `tokenmill bench serve`, both in the same call. benchmarks/kv_tier_gpu.sh
# runs it (with the host-tier benchmark) and prints the summary.
#   benchmarks/disagg_itl.sh
# Env: MODEL (benchmarks/configs/llama-3.1-8b), LOAD_FORMAT (dummy), TOKENIZER (a directory),
# INPUT_LEN (4096), OUTPUT_LEN (256), RATE (2 req/s), NUM_PROMPTS (40), OUT (/tmp/tokenmill-gpu),
# KV_BLOCKS (12288: the colocated pool; producer and consumer get half each, so both start at once
# without profiling each other's memory), SERVE_ARGS (extra flags for every server, e.g. --device cpu),
# HEALTH_TIMEOUT_S (300), BUDGET_S (no limit: seconds after which no wait or benchmark goes on; the
# servers are stopped either way).
# Writes $OUT/disagg-itl-colocated.json, $OUT/disagg-itl-disaggregated.json (benchmarks/results
# format), the servers' logs and the consumer's kv_transfer counters.
set -u
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-benchmarks/configs/llama-3.1-8b}
LOAD_FORMAT=${LOAD_FORMAT:-dummy}
if [ -z "${TOKENIZER:-}" ]; then  # dummy weights: one of the model's vocabulary; a checkpoint: its own
  if [ "$LOAD_FORMAT" = dummy ]; then TOKENIZER=$(python3 benchmarks/make_dummy_tokenizer.py --for-model "$MODEL") || exit 1
  else TOKENIZER=$MODEL; fi
fi
INPUT_LEN=${INPUT_LEN:-4096}
OUTPUT_LEN=${OUTPUT_LEN:-256}
RATE=${RATE:-2}
NUM_PROMPTS=${NUM_PROMPTS:-40}
KV_BLOCKS=${KV_BLOCKS:-12288}
SERVE_ARGS=${SERVE_ARGS:-}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-300}
PORT_BASE=${PORT_BASE:-8000}
ADDR=ipc:///tmp/tokenmill-disagg-itl-$$.sock
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')
MAX_LEN=$((INPUT_LEN + OUTPUT_LEN + 64))
BUDGET_S=${BUDGET_S:-1000000}
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT
trap 'exit 143' TERM INT
left() { echo $((BUDGET_S - SECONDS)); }

serve() {  # port, log, extra flags... (sets SERVED_PID)
  local port=$1 log=$2
  shift 2
  # shellcheck disable=SC2086
  "${TOKENMILL[@]}" serve --model "$MODEL" --load-format "$LOAD_FORMAT" --tokenizer "$TOKENIZER" \
    --max-model-len "$MAX_LEN" --port "$port" $SERVE_ARGS "$@" >"$log" 2>&1 &
  SERVED_PID=$!
  PIDS+=("$SERVED_PID")
}

wait_healthy() {  # port, pid
  local deadline=$((SECONDS + HEALTH_TIMEOUT_S))
  [ $deadline -le "$BUDGET_S" ] || deadline=$BUDGET_S
  while [ $SECONDS -lt $deadline ]; do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server on port $1 exited (see its log in $OUT)"; return 1; }
    sleep 0.5
  done
  echo "port $1 not healthy in time (HEALTH_TIMEOUT_S=$HEALTH_TIMEOUT_S, budget left $(left) s)"
  return 1
}

bench() {  # port, result name
  [ "$(left)" -gt 5 ] || { echo "no budget left for $2"; return 1; }
  timeout -k 5 "$(left)" "${TOKENMILL[@]}" bench serve --base-url "http://127.0.0.1:$1" --tokenizer "$TOKENIZER" --dataset-name random \
    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
    --request-rate "$RATE" --ignore-eos --temperature 0 --seed 0 --disable-tqdm --save-result --result-dir "$OUT" \
    --result-filename "$2" >"$OUT/$2.log" 2>&1 || { echo "bench serve failed: $OUT/$2.log"; tail -5 "$OUT/$2.log"; }
}

stop() {  # pids...
  kill "$@" 2>/dev/null
  wait "$@" 2>/dev/null
}

P_COLOC=$PORT_BASE P_CONS=$((PORT_BASE + 1)) P_PROD=$((PORT_BASE + 2)) P_ROUTER=$((PORT_BASE + 3))
echo "disagg: colocated engine ($KV_BLOCKS KV blocks), ${INPUT_LEN}-token prompts, $OUTPUT_LEN out, $RATE req/s, $NUM_PROMPTS prompts"
serve "$P_COLOC" "$OUT/disagg-itl-colocated-server.log" --num-kv-blocks "$KV_BLOCKS"
colocated=$SERVED_PID
wait_healthy "$P_COLOC" "$colocated" && bench "$P_COLOC" disagg-itl-colocated
stop "$colocated"

echo "disagg: consumer and producer ($((KV_BLOCKS / 2)) KV blocks each) behind the router"
serve "$P_CONS" "$OUT/disagg-itl-consumer.log" --num-kv-blocks $((KV_BLOCKS / 2)) --kv-role consumer --kv-transfer-address "$ADDR"
consumer=$SERVED_PID
serve "$P_PROD" "$OUT/disagg-itl-producer.log" --num-kv-blocks $((KV_BLOCKS / 2)) --kv-role producer --kv-transfer-address "$ADDR"
producer=$SERVED_PID
python3 -m tokenmill.cli router --pd-disaggregation --prefill "http://127.0.0.1:$P_PROD" \
  --decode "http://127.0.0.1:$P_CONS" --port "$P_ROUTER" >"$OUT/disagg-itl-router.log" 2>&1 &
router=$!
PIDS+=("$router")
if wait_healthy "$P_CONS" "$consumer" && wait_healthy "$P_PROD" "$producer" && wait_healthy "$P_ROUTER" "$router"; then
  bench "$P_ROUTER" disagg-itl-disaggregated
  curl -s "http://127.0.0.1:$P_CONS/metrics" | grep '^tokenmill:kv_transfer' >"$OUT/disagg-itl-consumer-counters.txt"
fi
stop "$router" "$producer" "$consumer"
grep -h "Output token throughput\|P99 ITL\|Mean ITL\|P99 TTFT" "$OUT"/disagg-itl-*.log 2>/dev/null
cat "$OUT/disagg-itl-consumer-counters.txt" 2>/dev/null
