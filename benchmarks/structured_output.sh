#!/usr/bin/env bash
# Structured output's serving cost: `tokenmill bench serve --dataset-name json-schema` sends the same
# prompts to one `tokenmill serve`, plain then constrained by their JSON schemas, back to back, and
# reports output tok/s, TPOT / TTFT p50 and p99 of each, their ratio, the schema-valid share and the
# server's grammar compile / mask times (from /metrics when exported).
#   CPU (default model, concurrency 8):   benchmarks/structured_output.sh
#   GPU (8B shapes, dummy weights, c=64): TARGET=gpu TOKENIZER=.gputok benchmarks/structured_output.sh
# Dummy weights have no tokenizer and structured output needs one in the engine: TOKENIZER is any
# tokenizer whose ids fit the model's vocabulary (the GPU runs use SmolLM2's, ids < 49152).
# Env: TARGET cpu|gpu, CONCURRENCY, NUM_PROMPTS, OUTPUT_LEN (max_tokens of both phases), INPUT_LEN
# (0: text prompts; N: N token ids), FIELD structured_outputs|response_format, PORT, PY, OUT (result
# JSON; default benchmarks/results), LOGS (server and bench logs), NAME (result file name),
# TOKENMILL_COMMIT (a copy of the tree without .git), SERVER_EXTRA_ARGS (appended to the server's
# arguments, e.g. "--gpu-memory-utilization 0.8"), TRACE=1 (the server writes its trace to
# $LOGS/$NAME-trace and each phase's result gets its TTFT split by stage: api_in, to_engine, queued,
# prefill, engine_to_api, api_to_client).
set -u
TARGET=${TARGET:-cpu}
OUT=${OUT:-benchmarks/results}
LOGS=${LOGS:-/tmp/tokenmill-structured}
PORT=${PORT:-8742}
PY=${PY:-python3}
INPUT_LEN=${INPUT_LEN:-0}
OUTPUT_LEN=${OUTPUT_LEN:-512}
FIELD=${FIELD:-structured_outputs}
mkdir -p "$OUT" "$LOGS"
# On the GPU machine the packages its image lacks (jsonschema, xgrammar, ...) are installed in /tmp/site.
if [ "$TARGET" = gpu ]; then SITE=/tmp/site:; else SITE=; fi
export PYTHONPATH=${PYTHONPATH:-${SITE}src} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TOKENMILL=("$PY" -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')

if [ "$TARGET" = gpu ]; then
  nvidia-smi -L
  CONCURRENCY=${CONCURRENCY:-64}
  NUM_PROMPTS=${NUM_PROMPTS:-512}
  NAME=${NAME:-serve-json-schema-llama-3.1-8b-c$CONCURRENCY}
  SERVER_ARGS=(--model benchmarks/configs/llama-3.1-8b --load-format dummy --tokenizer "${TOKENIZER:-.gputok}"
    --max-model-len 4096)
  LIMIT_S=480
else
  CONCURRENCY=${CONCURRENCY:-8}
  NUM_PROMPTS=${NUM_PROMPTS:-56}  # 4 of each of the 14 schemas
  NAME=${NAME:-serve-json-schema-cpu-c$CONCURRENCY}
  SERVER_ARGS=(--max-model-len 2048)
  LIMIT_S=1800
fi

TRACE_ARGS=() BENCH_TRACE_ARGS=()
if [ "${TRACE:-0}" = 1 ]; then
  rm -rf "$LOGS/$NAME-trace"
  TRACE_ARGS=(--trace-dir "$LOGS/$NAME-trace") BENCH_TRACE_ARGS=(--server-trace-dir "$LOGS/$NAME-trace")
fi

# shellcheck disable=SC2206 # SERVER_EXTRA_ARGS is split into words on purpose
EXTRA_ARGS=(${SERVER_EXTRA_ARGS:-})
"${TOKENMILL[@]}" serve "${SERVER_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} ${TRACE_ARGS[@]+"${TRACE_ARGS[@]}"} --port "$PORT" >"$LOGS/$NAME-server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || {
  echo "server not healthy"; tail -40 "$LOGS/$NAME-server.log"; kill $SERVER; exit 1
}

timeout "$LIMIT_S" "${TOKENMILL[@]}" bench serve --port "$PORT" --dataset-name json-schema \
  --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" --structured-output-len "$OUTPUT_LEN" \
  --structured-input-len "$INPUT_LEN" --structured-output-field "$FIELD" --num-warmups 4 --disable-tqdm \
  ${BENCH_TRACE_ARGS[@]+"${BENCH_TRACE_ARGS[@]}"} --save-result --result-dir "$OUT" --result-filename "$NAME" 2>&1 \
  | tee "$LOGS/$NAME.log" | grep -E "^(constrained|unconstrained):|duration|Median (TTFT|TPOT|ITL|E2EL)|P99 TTFT|^TTFT "
status=${PIPESTATUS[0]}
tail -24 "$LOGS/$NAME.log"
kill -TERM $SERVER
wait $SERVER
echo "bench exit code $status"
exit "$status"
