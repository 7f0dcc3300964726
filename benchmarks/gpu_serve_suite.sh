#!/usr/bin/env bash
# Online serving on the GPU (issue 4): `tokenmill serve` with Llama-3.1-8B shapes and dummy bf16
# weights, driven by `tokenmill bench serve` at several request rates up to saturation.
#   RATES="4 8 16 inf" benchmarks/gpu_serve_suite.sh
# The 8B config ships no tokenizer: unset, TOKENIZER is one of its 128,256 ids
# (make_dummy_tokenizer.py --for-model; the runs before 2026-12-05 used SmolLM2's 49,152, which left
# most sampled ids without text). Results go to $OUT.
set -u
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/llama-3.1-8b
TOKENIZER=${TOKENIZER:-$(python3 benchmarks/make_dummy_tokenizer.py --for-model "$MODEL")} || exit 1
RATES=${RATES:-4 8 16 inf}
PROMPTS_PER_SECOND_OF_LOAD=${PROMPTS_PER_SECOND_OF_LOAD:-20}
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')

"${TOKENMILL[@]}" serve --model "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" --max-model-len 4096 \
  --port 8000 >"$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 240); do
  curl -sf http://127.0.0.1:8000/health >/dev/null && break
  sleep 1
done
curl -sf http://127.0.0.1:8000/health >/dev/null || { echo "server not healthy"; tail -40 "$OUT/server.log"; kill $SERVER; exit 1; }

for rate in $RATES; do
  if [ "$rate" = inf ]; then n=512; else n=$(python3 -c "print(max(64, int($rate * $PROMPTS_PER_SECOND_OF_LOAD)))"); fi
  timeout 240 "${TOKENMILL[@]}" bench serve --dataset-name random --random-input-len 512 --random-output-len 256 \
    --num-prompts "$n" --request-rate "$rate" --ignore-eos --num-warmups 4 --disable-tqdm \
    --save-result --result-dir "$OUT" --result-filename "serve-llama-3.1-8b-h200-rate-$rate" 2>&1 |
    tee "$OUT/serve-rate-$rate.log" | tail -22
done
kill -TERM $SERVER
wait $SERVER
echo "server exit code $?"
