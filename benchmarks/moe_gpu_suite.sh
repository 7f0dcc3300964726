#!/usr/bin/env bash
# The mixture-of-experts GPU work of issue 15 in one command, as run on the device tool's H100:
#   STEPS=tune,tests,microbench benchmarks/moe_gpu_suite.sh
#   STEPS=latency,throughput benchmarks/moe_gpu_suite.sh
#   STEPS=latency,latency-fp8 benchmarks/moe_gpu_suite.sh   (FP8 experts against bf16, same call)
# tune: benchmarks/tune_fused_moe.py for Mixtral-8x7B and Qwen3-30B-A3B expert shapes (writes the
# repo's kernels/triton/moe_configs; a tar of them goes to $OUT); tests: tests/gpu/test_moe_gpu.py;
# microbench: benchmarks/moe_microbench.py; profile: benchmarks/profile_decode.py (where a decode
# step's time goes); latency / throughput: `tokenmill bench` with dummy (throughput against
# transformers' generate_batch on BASELINE_PROMPTS of the same prompts, in the same run)
# weights at Qwen3-30B-A3B shapes (benchmarks/configs/qwen3-30b-a3b). Logs and JSON go to $OUT.
# Packages the GPU image lacks (msgspec, ...) are expected installed in /tmp/site, as gpu_suite.sh does.
set -u
OUT=${OUT:-/tmp/tokenmill-moe-gpu}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/qwen3-30b-a3b
STEPS=${STEPS:-tune,tests,microbench}
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')
has() { [[ ",$STEPS," == *",$1,"* ]]; }

{
  nvidia-smi -L
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} 2>&1

if has tune; then
  timeout "${TUNE_TIMEOUT:-240}" python3 benchmarks/tune_fused_moe.py 2>&1 | tee "$OUT/tune.log" | grep -v "^  "
  tar cf "$OUT/moe_configs.tar" -C src/tokenmill/kernels/triton moe_configs
fi

if has tests; then
  timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -rA tests/gpu/test_moe_gpu.py 2>&1 |
    tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | tail -40
fi

if has microbench; then
  timeout "${MICROBENCH_TIMEOUT:-100}" python3 benchmarks/moe_microbench.py --result-dir "$OUT" \
    --result-name moe-microbench-qwen3-30b-a3b 2>&1 | tee "$OUT/microbench.log"
fi

if has profile; then
  timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/profile_decode.py --model "$MODEL" --batch-sizes 1,64 \
    --result-dir "$OUT" 2>&1 | tee "$OUT/profile.log" | grep -vE "it/s\]|s/it\]|graph/s\]" | tail -40
fi

if has latency; then
  timeout "${LATENCY_TIMEOUT:-200}" "${TOKENMILL[@]}" bench latency --model "$MODEL" --load-format dummy \
    --input-len 512 --output-len 256 --max-model-len 4096 --max-num-seqs 8 --num-iters 2 \
    --result-dir "$OUT" --result-name latency-qwen3-30b-a3b 2>&1 | tee "$OUT/latency.log" | grep -vE "it/s\]|s/it\]" | tail -8
fi

# FP8 routed experts (W8A16, quantized at load with per-channel scales; attention W8A8), the same
# command as `latency`: run both steps in one call for the ratio (STEPS=latency,latency-fp8).
if has latency-fp8; then
  timeout "${LATENCY_TIMEOUT:-200}" "${TOKENMILL[@]}" bench latency --model "$MODEL" --load-format dummy \
    --quantization fp8 --input-len 512 --output-len 256 --max-model-len 4096 --max-num-seqs 8 --num-iters 2 \
    --result-dir "$OUT" --result-name latency-qwen3-30b-a3b-fp8 2>&1 | tee "$OUT/latency-fp8.log" |
    grep -vE "it/s\]|s/it\]" | tail -8
fi

# 4-bit routed experts (W4A16, AWQ-style groups of 128 rounded at load), the same command
# (STEPS=latency-awq,latency for the ratio).
if has latency-awq; then
  timeout "${LATENCY_TIMEOUT:-200}" "${TOKENMILL[@]}" bench latency --model "$MODEL" --load-format dummy \
    --quantization awq --input-len 512 --output-len 256 --max-model-len 4096 --max-num-seqs 8 --num-iters 2 \
    --result-dir "$OUT" --result-name latency-qwen3-30b-a3b-awq 2>&1 | tee "$OUT/latency-awq.log" |
    grep -vE "it/s\]|s/it\]" | tail -8
fi

if has throughput; then
  timeout "${THROUGHPUT_TIMEOUT:-240}" "${TOKENMILL[@]}" bench throughput --model "$MODEL" --load-format dummy \
    --num-prompts "${NUM_PROMPTS:-512}" --input-len 512 --output-len 256 --max-model-len 4096 \
    --baseline hf-generate-batch --baseline-num-prompts "${BASELINE_PROMPTS:-64}" \
    --result-dir "$OUT" --result-name throughput-qwen3-30b-a3b 2>&1 | tee "$OUT/throughput.log" |
    grep -vE "it/s\]|s/it\]" | tail -8
fi
