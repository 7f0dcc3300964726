#!/usr/bin/env bash
# The GPU checks and benchmarks of issue 4 in one command, as run on the device tool's H200:
#   STEPS=tests,gemv,latency,profile,throughput BASELINE_PROMPTS=512 benchmarks/gpu_suite.sh
# Logs and result JSON go to $OUT (default /tmp/tokenmill-gpu); each step has its own time limit
# so one that hangs leaves time for the rest.
set -u
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/llama-3.1-8b
STEPS=${STEPS:-tests,gemv,latency,profile,throughput}
BASELINE_PROMPTS=${BASELINE_PROMPTS:-512}
NUM_PROMPTS=${NUM_PROMPTS:-512}

# The CLI without an installed entry point (results still record "tokenmill bench ...").
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')

has() { [[ ",$STEPS," == *",$1,"* ]]; }

{
  nvidia-smi -L
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} 2>&1

if has tests; then
  timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -p no:cacheprovider -q -rA tests/gpu/test_engine_gpu.py 2>&1 |
    tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -40
fi

if has gemv; then
  # cuBLAS against the row GEMV per batch-1 shape, then a whole step's projections (the last lines)
  timeout "${GEMV_TIMEOUT:-300}" python3 benchmarks/row_gemv_microbench.py 2>&1 | tee "$OUT/gemv.log" | tail -3
fi

if has latency; then
  timeout "${LATENCY_TIMEOUT:-150}" "${TOKENMILL[@]}" bench latency --model "$MODEL" --load-format dummy \
    --input-len 512 --output-len 256 --max-model-len 4096 --baseline hf-generate \
    --result-dir "$OUT" --result-name latency-llama-3.1-8b-h200 2>&1 | tee "$OUT/latency.log" | grep -vE "it/s\]|s/it\]" | tail -8
fi

if has profile; then
  timeout "${PROFILE_TIMEOUT:-120}" python3 benchmarks/profile_decode.py --model "$MODEL" --result-dir "$OUT" 2>&1 |
    tee "$OUT/profile.log" | grep -vE "it/s\]|s/it\]" | tail -10
fi

if has throughput; then
  timeout "${THROUGHPUT_TIMEOUT:-240}" "${TOKENMILL[@]}" bench throughput --model "$MODEL" --load-format dummy \
    --num-prompts "$NUM_PROMPTS" --input-len 512 --output-len 256 --max-model-len 4096 \
    --baseline hf-generate-batch --baseline-num-prompts "$BASELINE_PROMPTS" \
    --result-dir "$OUT" --result-name throughput-llama-3.1-8b-h200 2>&1 | tee "$OUT/throughput.log" |
    grep -vE "it/s\]|s/it\]" | tail -8
fi
