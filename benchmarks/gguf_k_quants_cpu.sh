#!/usr/bin/env bash
# A Q4_K_M GGUF on the CPU, one stream: tokenmill with the K-quants requantized to Q8_0 blocks (the
# default), tokenmill on float32 copies (--no-cpu-quantized-gemv: what such a file ran before), and
# llama.cpp's llama-server reading the K-quants directly, back to back, ROUNDS times alternating.
# The file has random blocks at MODEL's shapes (benchmarks/make_dummy_gguf.py; no hub here).
#   benchmarks/gguf_k_quants_cpu.sh                     # Llama-3.2-1B shapes, results in benchmarks/results/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-benchmarks/configs/llama-3.2-1b}
RECIPE=${RECIPE:-q4_k_m}
ROUNDS=${ROUNDS:-2}
NAME=$(basename "$MODEL")-$RECIPE
GGUF=${GGUF:-/tmp/$NAME.gguf}
export TOKENMILL_COMMIT=${TOKENMILL_COMMIT:-$(git rev-parse --short HEAD)}
export PYTHONPATH=src:.
[ -f "$GGUF" ] || "$PY" benchmarks/make_dummy_gguf.py "$MODEL" "$GGUF" --recipe "$RECIPE"
TOKENIZER=$("$PY" benchmarks/make_dummy_tokenizer.py --for-model "$MODEL")
tm() { "$PY" -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())' "$@"; }
for round in $(seq 1 "$ROUNDS"); do
  for blocks in on off; do
    flag=--cpu-quantized-gemv; [ $blocks = off ] && flag=--no-cpu-quantized-gemv
    tm bench latency --model "$GGUF" --tokenizer "$TOKENIZER" --device cpu --input-len 128 --output-len 32 \
      --num-iters 2 $flag --result-name "latency-$NAME-cpu-blocks-$blocks-round$round" 2>&1 | grep "single stream"
  done
  "$PY" benchmarks/llama_cpp_single_stream.py "$GGUF" --input-len 128 --output-len 32 \
    --result-name "llama-cpp-single-stream-$NAME-cpu-round$round"
done
