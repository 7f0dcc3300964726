#!/usr/bin/env bash
# Issue 15, Gemma-2-9B shapes on one GPU (dummy bf16 weights), as for Llama-3.1-8B in gpu_suite.sh:
#   STEPS=tests,latency,throughput BASELINE_PROMPTS=512 benchmarks/gemma2_9b.sh
# tests: the Gemma GPU tests (tiny checkpoints, bf16 / fp32 oracles, the Gemma launches' rounding).
# latency: `bench latency` 512 in / 256 out, single stream, against the bandwidth roofline and
#   transformers' generate() (eager attention: transformers runs Gemma 2's soft cap only there).
# throughput: offline 512 x 512/256 against transformers' generate_batch (paged eager attention,
#   hf_baseline.py: transformers has no SDPA path for Gemma 2).
# The config is google/gemma-2-9b's (benchmarks/configs/gemma-2-9b): 42 layers, hidden 3584, 16 heads
# of 256 (8 KV), query_pre_attn_scalar 256, sliding window 4096 on every other layer, soft caps 50
# (attention) and 30 (final), tied 256K embedding. With --max-model-len 4096 (MAX_MODEL_LEN) the
# window covers every position, so those layers attend plainly; 8192 keeps it in the kernels.
# Logs and result JSON go to $OUT (default /tmp/tokenmill-gemma2).
set -u
OUT=${OUT:-/tmp/tokenmill-gemma2}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=benchmarks/configs/gemma-2-9b
STEPS=${STEPS:-tests,latency,throughput}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
BASELINE_PROMPTS=${BASELINE_PROMPTS:-512}
NUM_PROMPTS=${NUM_PROMPTS:-512}
# The result files' suffix: h100 / h200 from the GPU's name (GPU=... to set it).
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE "H100|H200" |
  tr A-Z a-z)}

TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')

has() { [[ ",$STEPS," == *",$1,"* ]]; }

{
  nvidia-smi -L
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} 2>&1

if has tests; then
  timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -rA tests/gpu/test_gemma_gpu.py 2>&1 |
    tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -20
fi

if has latency; then
  timeout "${LATENCY_TIMEOUT:-240}" "${TOKENMILL[@]}" bench latency --model "$MODEL" --load-format dummy \
    --input-len 512 --output-len 256 --max-model-len "$MAX_MODEL_LEN" --baseline hf-generate \
    --result-dir "$OUT" --result-name "latency-gemma-2-9b-$GPU" 2>&1 | tee "$OUT/latency.log" |
    grep -vE "it/s\]|s/it\]" | tail -8
fi

if has throughput; then
  timeout "${THROUGHPUT_TIMEOUT:-420}" "${TOKENMILL[@]}" bench throughput --model "$MODEL" --load-format dummy \
    --num-prompts "$NUM_PROMPTS" --input-len 512 --output-len 256 --max-model-len "$MAX_MODEL_LEN" \
    --baseline hf-generate-batch --baseline-num-prompts "$BASELINE_PROMPTS" \
    --result-dir "$OUT" --result-name "throughput-gemma-2-9b-$GPU" 2>&1 | tee "$OUT/throughput.log" |
    grep -vE "it/s\]|s/it\]" | tail -8
fi
