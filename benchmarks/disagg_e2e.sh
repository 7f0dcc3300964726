#!/bin/bash
# Disaggregated prefill/decode smoke run with real servers: a consumer and a producer
# (`tokenmill serve --kv-role ...`) and the router in disaggregated mode (tokenmill router --prefill --decode); one
# completion through the router, one streamed, then the consumer's kv_transfer_* counters.
# Usage: benchmarks/disagg_e2e.sh MODEL [extra serve flags, e.g. --device cpu]
set -u
MODEL=${1:?usage: $0 MODEL [serve flags]}
shift
ADDR=${KV_ADDRESS:-ipc:///tmp/tokenmill-disagg-e2e.sock}
PC=${CONSUMER_PORT:-8711} PP=${PRODUCER_PORT:-8712} PX=${PROXY_PORT:-8713}
tokenmill serve "$MODEL" --port "$PC" --kv-role consumer --kv-transfer-address "$ADDR" "$@" > /tmp/disagg-consumer.log 2>&1 &
C=$!
tokenmill serve "$MODEL" --port "$PP" --kv-role producer --kv-transfer-address "$ADDR" "$@" > /tmp/disagg-producer.log 2>&1 &
P=$!
python -m tokenmill.cli router --pd-disaggregation --prefill "http://127.0.0.1:$PP" --decode "http://127.0.0.1:$PC" --port "$PX" > /tmp/disagg-router.log 2>&1 &
X=$!
trap 'kill $X $P $C 2>/dev/null; wait' EXIT
for _ in $(seq 1 600); do
  curl -sf "localhost:$PC/health" > /dev/null && curl -sf "localhost:$PP/health" > /dev/null && curl -sf "localhost:$PX/health" > /dev/null && break
  sleep 1
done
PROMPT="The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again and again and again."
echo "through the router:"
curl -s "localhost:$PX/v1/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"$PROMPT\", \"max_tokens\": 16, \"temperature\": 0}"
echo
echo "streamed through the router:"
curl -s "localhost:$PX/v1/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"Once more: $PROMPT\", \"max_tokens\": 4, \"temperature\": 0, \"stream\": true}" | head -c 800
echo
echo "consumer counters:"
curl -s "localhost:$PC/metrics" | grep '^tokenmill:kv_transfer'
echo "producer counters:"
curl -s "localhost:$PP/metrics" | grep '^tokenmill:kv_transfer'
