#!/usr/bin/env bash
# Speculative decoding on one GPU (issue 17), Llama-3.1-8B shapes with dummy bf16 weights:
#   1. single stream (`bench latency`, 128 in / 256 out): speculation off, ngram at k = 2..4, and the
#      target as its own draft model (acceptance 1.0);
#   2. the serve sweep (`bench serve`, random 512 / 256, ignore_eos) at concurrency 1, 8, 32, 128 and
#      512 with speculation off and with ngram k = 3, a fresh server per side: the no-slowdown rule.
# Dummy weights give no real acceptance: what ngram gets is whatever the random model repeats,
# reported with each result (spec_decode: acceptance rate, mean acceptance length).
#   OUT=/tmp/spec benchmarks/spec_gpu.sh
set -u
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  echo "usage: [OUT=dir] [TOKENIZER=dir] [PARTS='latency serve'] [CONCURRENCY='1 8 32 128 512'] benchmarks/spec_gpu.sh"
  exit 0
fi
OUT=${OUT:-/tmp/tokenmill-spec-gpu}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/llama-3.1-8b
TOKENIZER=${TOKENIZER:-$(python3 benchmarks/make_dummy_tokenizer.py --for-model "$MODEL")} || exit 1
PARTS=${PARTS:-latency serve}
CONCURRENCY=${CONCURRENCY:-1 8 32 128 512}
K=${K:-3}
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')
ngram() { echo "{\"method\": \"ngram\", \"num_speculative_tokens\": $1}"; }

if [[ " $PARTS " == *" latency "* ]]; then
  latency() {
    local name=$1; shift
    timeout 200 "${TOKENMILL[@]}" bench latency --model "$MODEL" --load-format dummy --input-len 128 --output-len 256 \
      --num-iters 3 --result-dir "$OUT" --result-name "spec-latency-$name" "$@" >"$OUT/latency-$name.log" 2>&1
    echo "$name: $(grep -E 'single stream|spec|Error' "$OUT/latency-$name.log" | tail -2 | tr '\n' ' ')"
  }
  latency off
  for k in 2 3 4; do latency "ngram$k" --speculative-config "$(ngram $k)"; done
  latency draft-self3 --speculative-config "{\"method\": \"draft_model\", \"model\": \"$MODEL\", \"num_speculative_tokens\": 3}"
fi

if [[ " $PARTS " == *" serve "* ]]; then
  for side in off ngram$K; do
    spec=()
    [ "$side" = off ] || spec=(--speculative-config "$(ngram "$K")")
    "${TOKENMILL[@]}" serve --model "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" --max-model-len 4096 \
      --port 8000 "${spec[@]}" >"$OUT/server-$side.log" 2>&1 &
    server=$!
    for _ in $(seq 1 240); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
    curl -sf http://127.0.0.1:8000/health >/dev/null || { echo "server $side not healthy"; tail -30 "$OUT/server-$side.log"; kill $server; exit 1; }
    for c in $CONCURRENCY; do
      n=$(( c < 16 ? 32 : (c < 128 ? 4 * c : 2 * c) ))
      timeout 300 "${TOKENMILL[@]}" bench serve --dataset-name random --random-input-len 512 --random-output-len 256 \
        --num-prompts "$n" --max-concurrency "$c" --ignore-eos --num-warmups 4 --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "spec-serve-$side-c$c" >"$OUT/serve-$side-c$c.log" 2>&1
      echo "$side c=$c: $(grep -E 'Output token throughput|Mean TPOT|Mean TTFT|acceptance' "$OUT/serve-$side-c$c.log" | tr -s ' ' | tr '\n' ';')"
    done
    kill -TERM $server; wait $server
  done
fi
