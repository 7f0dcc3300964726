#!/usr/bin/env bash
# Disaggregated prefill/decode on ONE GPU (issue 21): a colocated engine against a producer and a
# consumer sharing the GPU (about half its memory each) behind the proxy, long prompts arriving
# while others decode (Poisson arrivals): ITL p99 and output throughput from `tokenmill bench
# serve`, both in the same call. Not run yet (written without device time).
#   TOKENIZER=.gputok benchmarks/disagg_itl.sh
# Env: MODEL (benchmarks/configs/llama-3.1-8b, dummy weights), INPUT_LEN (4096), OUTPUT_LEN (256),
# RATE (2 req/s), NUM_PROMPTS (64), SERVE_ARGS, OUT (/tmp/tokenmill-gpu).
# Memory: an engine sizes its pool from gpu_memory_utilization x total minus what is already used
# (other processes included), so the consumer starts first at 0.45 and the producer after it at 0.9.
set -u
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-benchmarks/configs/llama-3.1-8b}
TOKENIZER=${TOKENIZER:-.gputok}
INPUT_LEN=${INPUT_LEN:-4096}
OUTPUT_LEN=${OUTPUT_LEN:-256}
RATE=${RATE:-2}
NUM_PROMPTS=${NUM_PROMPTS:-64}
SERVE_ARGS=${SERVE_ARGS:-}
ADDR=ipc:///tmp/tokenmill-disagg-itl.sock
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')
MAX_LEN=$((INPUT_LEN + OUTPUT_LEN + 64))

serve() {  # port, log, extra flags...
  local port=$1 log=$2
  shift 2
  # shellcheck disable=SC2086
  "${TOKENMILL[@]}" serve --model "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" --max-model-len "$MAX_LEN" \
    --port "$port" $SERVE_ARGS "$@" >"$log" 2>&1 &
  echo $!
}

wait_healthy() {  # port
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    sleep 0.5
  done
  echo "port $1 not healthy"; return 1
}

bench() {  # port, result name
  "${TOKENMILL[@]}" bench serve --base-url "http://127.0.0.1:$1" --tokenizer "$TOKENIZER" --dataset-name random \
    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
    --request-rate "$RATE" --ignore-eos --temperature 0 --save-result --result-dir "$OUT" --result-filename "$2" \
    >"$OUT/$2.log" 2>&1
}

colocated=$(serve 8000 "$OUT/disagg-itl-colocated.log" --gpu-memory-utilization 0.9)
wait_healthy 8000 && bench 8000 disagg-itl-colocated.json
kill "$colocated"; wait "$colocated" 2>/dev/null

consumer=$(serve 8001 "$OUT/disagg-itl-consumer.log" --gpu-memory-utilization 0.45 --kv-role consumer --kv-transfer-address $ADDR)
wait_healthy 8001
producer=$(serve 8002 "$OUT/disagg-itl-producer.log" --gpu-memory-utilization 0.9 --kv-role producer --kv-transfer-address $ADDR)
wait_healthy 8002
python3 -m tokenmill.cli router --pd-disaggregation --prefill http://127.0.0.1:8002 --decode http://127.0.0.1:8001 --port 8003 \
  >"$OUT/disagg-itl-proxy.log" 2>&1 &
proxy=$!
wait_healthy 8003 && bench 8003 disagg-itl-disaggregated.json
curl -s http://127.0.0.1:8001/metrics | grep '^tokenmill:kv_transfer' >"$OUT/disagg-itl-consumer-counters.txt"
kill "$proxy" "$producer" "$consumer"; wait 2>/dev/null
grep -h "Output token throughput\|P99 ITL\|Mean ITL" "$OUT"/disagg-itl-*.json.log
cat "$OUT/disagg-itl-consumer-counters.txt"
