#!/usr/bin/env bash
# Issue 16, quantized Llama-3.1-8B shapes on one GPU, every format in the same call as bf16:
#   STEPS=tests,latency,throughput QUANTS="none fp8 awq" benchmarks/quantization.sh
# tests: the GPU tests of the quantized paths (kernels at real shapes, engine greedy agreement;
#   TESTS=... to pick files).
# latency: `bench latency` 512 in / 256 out, single stream, per --quantization (dummy bf16 weights
#   quantized at load: fp8 = per-channel FP8 W8A8, awq = 4-bit groups of 128 with zero points); the
#   roofline counts the bytes each format reads.
# throughput: offline 512 x 512/256 per --quantization.
# A QUANTS entry METHOD+VARIANT also turns on an experimental kernel variant (KernelConfig, off by
# default): fp8+tc16 (fp8_tensor_core_gemv), awq+xsum (int4_zero_by_xsum); its files are named
# METHOD_VARIANT, e.g. QUANTS="none fp8 fp8+tc16 awq awq+xsum".
# The ratios against bf16 (none) are printed at the end and written to quantization-summary.json.
set -u
OUT=${OUT:-/tmp/tokenmill-quant}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/llama-3.1-8b
STEPS=${STEPS:-tests,latency,throughput}
QUANTS=${QUANTS:-none fp8 awq}
NUM_PROMPTS=${NUM_PROMPTS:-512}
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE "H100|H200" |
  tr A-Z a-z)}

TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')

has() { [[ ",$STEPS," == *",$1,"* ]]; }
# The engine options of a QUANTS entry, in ARGS.
engine_args() {
  local method=${1%%+*} variant=""
  [[ "$1" == *+* ]] && variant=${1#*+}
  ARGS=()
  [[ "$method" == none ]] || ARGS+=(--quantization "$method")
  case "$variant" in
    "") ;;
    tc16) ARGS+=(--kernel-config '{"fp8_tensor_core_gemv": true}') ;;
    xsum) ARGS+=(--kernel-config '{"int4_zero_by_xsum": true}') ;;
    *) echo "unknown kernel variant '$variant' in QUANTS entry '$1' (tc16, xsum)" >&2; exit 2 ;;
  esac
}

{
  nvidia-smi -L
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1

if has tests; then
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -q -rA -m gpu \
    ${TESTS:-tests/gpu/test_quantized_gpu.py tests/gpu/test_fp8_kernels_gpu.py tests/gpu/test_int4_kernels_gpu.py} 2>&1 |
    tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -30
fi

for entry in $QUANTS; do
  engine_args "$entry"
  q=${entry/+/_}
  if has latency; then
    timeout "${LATENCY_TIMEOUT:-180}" "${TOKENMILL[@]}" bench latency --model "$MODEL" --load-format dummy \
      "${ARGS[@]}" --input-len 512 --output-len 256 --max-model-len 4096 \
      --result-dir "$OUT" --result-name "latency-llama-3.1-8b-$q-$GPU" 2>&1 | tee "$OUT/latency-$q.log" |
      grep -vE "it/s\]|s/it\]" | tail -4
  fi
  if has throughput; then
    timeout "${THROUGHPUT_TIMEOUT:-240}" "${TOKENMILL[@]}" bench throughput --model "$MODEL" --load-format dummy \
      "${ARGS[@]}" --num-prompts "$NUM_PROMPTS" --input-len 512 --output-len 256 --max-model-len 4096 \
      --result-dir "$OUT" --result-name "throughput-llama-3.1-8b-$q-$GPU" 2>&1 | tee "$OUT/throughput-$q.log" |
      grep -vE "it/s\]|s/it\]" | tail -4
  fi
done

python3 benchmarks/quantization_summary.py "$OUT" "$GPU"
