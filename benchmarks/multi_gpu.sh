#!/usr/bin/env bash
# Multi-GPU runs of issue 22 in one script (tensor parallelism over 2-4 GPUs of one host; data
# parallelism with the built-in router). Parts, in this order (pick with --only, comma list):
#   correctness  bf16 greedy agreement of TP=2/4 with TP=1 (first 32 tokens, ties allowed:
#                benchmarks/tp_agreement.py) on two tiny checkpoints and on Llama-3.1-8B shapes with
#                random weights written as safetensors (dummy weights differ per rank: not comparable)
#   pytest       pytest -m gpu tests/gpu, then tests/distributed (gloo; their CPU tests on this host)
#   single       Llama-3.1-8B shapes, dummy bf16: `bench latency` 512/256 at TP=1,2,4 (roofline over
#                the aggregate bandwidth: N x one GPU's copy bandwidth)
#   offline      Llama-3.1-8B shapes: `bench throughput` 512 x 512/256 at TP=1,2,4 (per GPU too)
#   70b          Llama-3.1-70B shapes at TP=2,4: single stream and offline
#   profile      the all-reduce's share of a decode step (benchmarks/profile_tp_decode.py): 8B and 70B
#                shapes at batch 1 and 64, each TP size >= 2
#   allreduce    the one-shot symmetric-memory all-reduce (--enable-custom-all-reduce) against NCCL
#                (the default): benchmarks/all_reduce_microbench.py at each TP size >= 2, then 8B and
#                70B single streams at the largest TP size with the flag (parts single / 70b give
#                the default's figures; run them in the same call)
#   dp           `serve --data-parallel-size 2` (the router's policy inside the server) against 1 on
#                8B shapes: `bench serve` at saturation (all requests at once), throughput and TTFT
# Results (JSON, benchmarks/results naming: multi-gpu-<part>-<model>-<tp|dp>N-<gpu>-<commit>.json)
# go to $OUT, logs to $LOGS; benchmarks/multi_gpu_summary.py "$OUT" prints the BENCHMARKS.md table.
# No run starts after BUDGET_S seconds (a device call: 600 s); skipped runs are named: call again
# with --only for the rest. TP sizes above the GPU count are skipped, named.
#   OUT=$OUT benchmarks/multi_gpu.sh [--only correctness,single,...] [--budget S]
#   benchmarks/multi_gpu.sh --cpu-smoke      # the plumbing on the CPU: tiny model, TP=2 over gloo
set -u
usage() {
  echo "usage: [OUT=dir] [LOGS=dir] [TOKENIZER=dir] [RUN_TIMEOUT=300] [TP_SIZES='1 2 4'] [CKPTS=dir]"
  echo "       benchmarks/multi_gpu.sh [--only correctness,pytest,single,offline,70b,profile,allreduce,dp] [--budget S] [--cpu-smoke]"
}
ONLY=correctness,pytest,single,offline,70b,profile,allreduce,dp
BUDGET_S=${BUDGET_S:-540}
CPU_SMOKE=0
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --only) [ $# -ge 2 ] || { echo "--only needs a comma list of parts" >&2; exit 2; }; ONLY=$2; shift 2 ;;
    --only=*) ONLY=${1#--only=}; shift ;;
    --budget) [ $# -ge 2 ] || { echo "--budget needs seconds" >&2; exit 2; }; BUDGET_S=$2; shift 2 ;;
    --budget=*) BUDGET_S=${1#--budget=}; shift ;;
    --cpu-smoke) CPU_SMOKE=1; shift ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for part in ${ONLY//,/ }; do
  case $part in
    correctness | pytest | single | offline | 70b | profile | allreduce | dp) ;;
    *) echo "--only: unknown part '$part'; use correctness, pytest, single, offline, 70b, profile, allreduce, dp" >&2; exit 2 ;;
  esac
done

# NVLink multicast stays off (the device's KINDS.md), in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/tokenmill-multi-gpu}
LOGS=${LOGS:-/tmp/tokenmill-multi-gpu-logs}
CKPTS=${CKPTS:-/tmp/tokenmill-multi-gpu-ckpts}  # written checkpoints (8B: 16 GB)
mkdir -p "$OUT" "$LOGS" "$CKPTS"
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
export TOKENMILL_COMMIT=${TOKENMILL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')
PY=${PY:-python3}

if [ "$CPU_SMOKE" = 1 ]; then
  # Toy scale: one tiny llama (4 query / 2 KV heads, with a tokenizer) stands for every model.
  GPU=cpu NUM_GPUS=2 TP_SIZES=${TP_SIZES:-"1 2"}
  TINY=$CKPTS/tiny-llama
  [ -f "$TINY/config.json" ] || $PY -c "
from pathlib import Path
from tests.conftest import build_tiny_tokenizer, write_tiny_checkpoint
write_tiny_checkpoint(Path('$TINY'), 'llama', build_tiny_tokenizer(), seed=3)" || exit 1
  ln -sfn "$TINY" "$CKPTS/tiny-llama-as-70b"  # its own name in the result files
  MODEL_8B=$TINY MODEL_70B=$CKPTS/tiny-llama-as-70b TOKENIZER=$TINY LOAD=auto
  ENGINE=(--device cpu --max-model-len 256 --num-kv-blocks 128)
  SERVE_ENGINE=(--device cpu --max-model-len 256 --num-kv-blocks 128)
  LAT=(--input-len 16 --output-len 8 --num-iters 1) TPUT=(--num-prompts 8 --input-len 16 --output-len 8)
  SERVE_LOAD=(--num-prompts 16 --random-input-len 16 --random-output-len 8)
  AGREE=(--device cpu --dtype float32 --max-tokens 8 --num-prompts 2 --prompt-len 12)
  AGREE_MODELS="$TINY"
  PROFILE=(--device cpu --dtype float32 --context 32 --max-model-len 256 --steps 3 --profile-steps 2) PROFILE_BATCHES="1"
else
  GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE "H100|H200|A100|L40S" | tr A-Z a-z)}
  GPU=${GPU:-gpu}
  NUM_GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
  TP_SIZES=${TP_SIZES:-"1 2 4"}
  MODEL_8B=benchmarks/configs/llama-3.1-8b MODEL_70B=benchmarks/configs/llama-3.1-70b
  TOKENIZER=${TOKENIZER:-$(python3 benchmarks/make_dummy_tokenizer.py --for-model "$MODEL_8B")} LOAD=dummy
  ENGINE=(--max-model-len 4096) SERVE_ENGINE=(--max-model-len 4096 --tokenizer "$TOKENIZER")
  LAT=(--input-len 512 --output-len 256 --num-iters 2) TPUT=(--num-prompts 512 --input-len 512 --output-len 256)
  SERVE_LOAD=(--num-prompts 1000 --random-input-len 512 --random-output-len 256)
  AGREE=(--dtype bfloat16 --max-tokens 32 --num-prompts 4 --prompt-len 24)
  AGREE_MODELS=""  # filled by the correctness part (tiny checkpoints and the 8B-shape one)
  PROFILE=(--context 512 --max-model-len 4096) PROFILE_BATCHES=${PROFILE_BATCHES:-"1 64"}
  {
    nvidia-smi -L
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  } 2>&1
fi
echo "== multi_gpu.sh: parts $ONLY on $NUM_GPUS x $GPU, TP sizes $TP_SIZES, budget ${BUDGET_S} s, commit $TOKENMILL_COMMIT"

FAILED=""
SKIPPED=""
# run LABEL CMD...: one step inside the budget, logged to $LOGS/LABEL.log, its last lines shown.
run() {
  local label=$1 started=$SECONDS
  shift
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then
    echo "== $label skipped: ${SECONDS} s gone of BUDGET_S=$BUDGET_S"
    SKIPPED="$SKIPPED $label"
    return 1
  fi
  local log=$LOGS/$label.log
  timeout "$RUN_TIMEOUT" "$@" >"$log" 2>&1
  local rc=$?
  echo "== $label (exit $rc, $((SECONDS - started)) s)"
  grep -E "^(single stream|tokenmill:|TP=|AGREE|DISAGREE|wrote|=+ .*(passed|failed))" "$log" | tail -12
  if [ $rc -ne 0 ]; then
    FAILED="$FAILED $label"
    grep -vE "it/s\]|s/it\]" "$log" | tail -15
  fi
  return $rc
}
fits() {  # fits N: N GPUs are there (else the run is named as skipped)
  if [ "$1" -gt "$NUM_GPUS" ]; then SKIPPED="$SKIPPED $2(needs $1 GPUs)"; echo "== $2 skipped: $1 GPUs needed, $NUM_GPUS here"; return 1; fi
}
name() { echo "multi-gpu-$1-$(basename "$2")-$3-$GPU-$TOKENMILL_COMMIT"; }
sizes_csv() {  # the TP sizes that fit, comma-separated
  local out="" n
  for n in $TP_SIZES; do [ "$n" -le "$NUM_GPUS" ] && out="$out${out:+,}$n"; done
  echo "$out"
}

part_correctness() {
  local models=$AGREE_MODELS sizes
  sizes=$(sizes_csv)
  if [ "$CPU_SMOKE" = 0 ]; then
    run write-tiny-checkpoints $PY -c "
from pathlib import Path
from tests.conftest import build_tiny_tokenizer, write_tiny_checkpoint
tok = build_tiny_tokenizer()
shapes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, head_dim=32, num_hidden_layers=2)
write_tiny_checkpoint(Path('$CKPTS/tiny-llama-gqa'), 'llama', tok, seed=3, num_key_value_heads=4, **shapes)
write_tiny_checkpoint(Path('$CKPTS/tiny-qwen2-mha'), 'qwen2', tok, seed=4, num_key_value_heads=8, **shapes)" &&
      models="$CKPTS/tiny-llama-gqa $CKPTS/tiny-qwen2-mha"
    if [ -f "$CKPTS/llama-3.1-8b-random/model.safetensors.index.json" ] ||
      run write-8b-checkpoint $PY benchmarks/tp_agreement.py --write-random-checkpoint "$CKPTS/llama-3.1-8b-random" \
        --config benchmarks/configs/llama-3.1-8b $([ -d "$TOKENIZER" ] && echo "--tokenizer $TOKENIZER"); then
      models="$models $CKPTS/llama-3.1-8b-random"
    fi
  fi
  for model in $models; do
    run "agreement-$(basename "$model")" $PY benchmarks/tp_agreement.py --model "$model" --sizes "$sizes" "${AGREE[@]}" \
      --result-dir "$OUT" --name "$(basename "$model")-$GPU-$TOKENMILL_COMMIT"
  done
}
part_pytest() {
  if [ "$CPU_SMOKE" = 1 ]; then echo "== pytest: GPU tests, not in the CPU smoke run"; return; fi
  run pytest-gpu $PY -m pytest -m gpu -q tests/gpu
  run pytest-distributed $PY -m pytest -q tests/distributed
}
latency() {  # latency MODEL TP
  fits "$2" "latency-$(basename "$1")-tp$2" || return
  run "latency-$(basename "$1")-tp$2" "${TOKENMILL[@]}" bench latency --model "$1" --load-format "$LOAD" \
    --tensor-parallel-size "$2" "${ENGINE[@]}" "${LAT[@]}" --result-dir "$OUT" --result-name "$(name single "$1" "tp$2")"
}
offline() {  # offline MODEL TP
  fits "$2" "offline-$(basename "$1")-tp$2" || return
  run "offline-$(basename "$1")-tp$2" "${TOKENMILL[@]}" bench throughput --model "$1" --load-format "$LOAD" \
    --tensor-parallel-size "$2" "${ENGINE[@]}" "${TPUT[@]}" --result-dir "$OUT" --result-name "$(name offline "$1" "tp$2")"
}
part_single() { for n in $TP_SIZES; do latency "$MODEL_8B" "$n"; done; }
part_offline() { for n in $TP_SIZES; do offline "$MODEL_8B" "$n"; done; }
part_70b() {
  for n in $TP_SIZES; do
    [ "$n" -ge 2 ] || continue  # 140 GB of bf16 weights: not one GPU
    latency "$MODEL_70B" "$n"
    offline "$MODEL_70B" "$n"
  done
}
serve_dp() {  # serve_dp DP: a fresh server, `bench serve` at saturation through it, the server stopped
  local dp=$1 port=$((8100 + $1)) label="dp$1"
  fits "$dp" "serve-$label" || return
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then echo "== serve-$label skipped: budget"; SKIPPED="$SKIPPED serve-$label"; return; fi
  "${TOKENMILL[@]}" serve --model "$MODEL_8B" --load-format "$LOAD" --port "$port" --data-parallel-size "$dp" \
    "${SERVE_ENGINE[@]}" >"$LOGS/server-$label.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 0.5
  done
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    run "serve-$label" "${TOKENMILL[@]}" bench serve --port "$port" --dataset-name random --tokenizer "$TOKENIZER" \
      "${SERVE_LOAD[@]}" --request-rate inf --ignore-eos --disable-tqdm --save-result --result-dir "$OUT" \
      --result-filename "$(name dp "$MODEL_8B" "$label")"
  else
    echo "== serve-$label: server not healthy"; tail -30 "$LOGS/server-$label.log"; FAILED="$FAILED serve-$label"
  fi
  kill -TERM $server 2>/dev/null
  wait $server
}
part_profile() {
  local model n b label
  for model in "$MODEL_8B" "$MODEL_70B"; do
    for n in $TP_SIZES; do
      [ "$n" -ge 2 ] || continue
      for b in $PROFILE_BATCHES; do
        label="profile-$(basename "$model")-tp$n-b$b"
        fits "$n" "$label" || continue
        run "$label" $PY benchmarks/profile_tp_decode.py --model "$model" --load-format "$LOAD" --tp "$n" \
          --batch "$b" "${PROFILE[@]}" --result-dir "$OUT" --result-name "$(name profile "$model" "tp$n-b$b")"
      done
    done
  done
}
part_allreduce() {
  if [ "$CPU_SMOKE" = 1 ]; then echo "== allreduce: CUDA only, not in the CPU smoke run"; return; fi
  local n largest=0
  for n in $TP_SIZES; do
    [ "$n" -ge 2 ] || continue
    fits "$n" "allreduce-microbench-tp$n" || continue
    largest=$n
    run "allreduce-microbench-tp$n" $PY benchmarks/all_reduce_microbench.py --tp "$n" --result-dir "$OUT" \
      --result-name "all-reduce-microbench-tp$n-$GPU-$TOKENMILL_COMMIT"
  done
  [ "$largest" -ge 2 ] || return
  local model
  for model in "$MODEL_8B" "$MODEL_70B"; do
    run "latency-$(basename "$model")-tp$largest-oneshot" "${TOKENMILL[@]}" bench latency --model "$model" --load-format "$LOAD" \
      --tensor-parallel-size "$largest" --enable-custom-all-reduce "${ENGINE[@]}" "${LAT[@]}" --result-dir "$OUT" \
      --result-name "$(name single "$model" "tp$largest-oneshot")"
  done
}
part_dp() { serve_dp 1; serve_dp 2; }

for part in ${ONLY//,/ }; do
  "part_$part"
done
$PY benchmarks/multi_gpu_summary.py "$OUT" || FAILED="$FAILED summary"
echo "== skipped:${SKIPPED:- none}"
echo "== failed:${FAILED:- none}"
[ -z "$FAILED" ]
