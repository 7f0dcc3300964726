#!/usr/bin/env bash
# Issue 16, FP8 KV cache on one GPU, Llama-3.1-8B shapes (dummy bf16 weights), 16-bit vs FP8 KV in
# the same call:
#   STEPS=tests,kernel,engine benchmarks/fp8_kv.sh
# tests: tests/gpu/test_fp8_kv_gpu.py (kernels at contexts up to 32K against fp32 references, the
#   engine in bf16 with FP8 KV against bf16 KV, CUDA-graph decode against eager).
# kernel: the decode attention launch alone over bf16 and FP8 caches at 8K / 16K / 32K, batch 1 and 8.
# tiles: (not run by default) the decode launch over an FP8 cache with each tile shape, at batch 1 / 8.
# engine: one engine per KV dtype at the same --gpu-memory-utilization: the pool's blocks and tokens
#   (EngineInfo), single-stream decode tok/s at 8K, 16K and 32K-token contexts, and 8 streams of 16K.
# Logs and result JSON go to $OUT (default /tmp/tokenmill-fp8kv).
set -u
OUT=${OUT:-/tmp/tokenmill-fp8kv}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/llama-3.1-8b
STEPS=${STEPS:-tests,kernel,engine}
CONTEXTS=${CONTEXTS:-8192,16384,32768}
# The result files' suffix: h100 / h200 from the GPU's name (GPU=... to set it).
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE "H100|H200" |
  tr A-Z a-z)}

has() { [[ ",$STEPS," == *",$1,"* ]]; }

{
  nvidia-smi -L
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1

if has tests; then
  timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -rA -s tests/gpu/test_fp8_kv_gpu.py 2>&1 |
    tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|context|agreed" | tail -40
fi

if has kernel; then
  timeout "${KERNEL_TIMEOUT:-120}" python3 benchmarks/fp8_kv_bench.py --part kernel --contexts "$CONTEXTS" \
    --result-dir "$OUT" --result-name "fp8-kv-llama-3.1-8b-$GPU" 2>&1 | tee "$OUT/kernel.log" | tail -8
fi

if has tiles; then
  timeout "${TILES_TIMEOUT:-240}" python3 benchmarks/fp8_kv_bench.py --part tiles --contexts "$CONTEXTS" \
    --result-dir "$OUT" --result-name "fp8-kv-llama-3.1-8b-$GPU" 2>&1 | tee "$OUT/tiles.log" | tail -3
fi

if has engine; then
  timeout "${ENGINE_TIMEOUT:-420}" python3 benchmarks/fp8_kv_bench.py --part engine --model "$MODEL" \
    --contexts "$CONTEXTS" --result-dir "$OUT" --result-name "fp8-kv-llama-3.1-8b-$GPU" 2>&1 |
    tee "$OUT/engine.log" | grep -vE "it/s\]|s/it\]" | grep -E "blocks|tok/s|fp8 /|wrote|Error|error" | tail -20
fi
