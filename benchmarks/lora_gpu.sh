#!/usr/bin/env bash
# Multi-LoRA throughput on one GPU (issue 18, "Benchmarks"), every ratio taken within one device
# call: Llama-3.1-8B shapes, dummy bf16 weights, dummy bf16 adapters on all of q/k/v/o/gate/up/down
# (written by the bench itself, bench/lora_adapters.py), offline `bench throughput` 512 x 512/256,
# a fresh process per run:
#   off        LoRA disabled: the reference of every ratio (each call runs it first)
#   base-only  LoRA enabled (8 slots, rank 16), every request on the base model   target >= 0.97x off
#   n8-r16     8 adapters of rank 16 in 8 slots, requests round-robin             target >= 0.8x off
# and the sweeps: rank (n8-r8, n8-r16, n8-r64) and adapter count (n1-r16, n8-r16, n32-r16; 8 slots).
# Parts: main = off, base-only, n8-r16; rank; count. Each part repeats no run another part of the
# same call made. A run is a fresh engine (~45 s of start-up on an H100 before its ~15 s timed run),
# so all seven may not fit one 10-minute call: `--only main,rank` (5 runs) then `--only count` (4 runs,
# off again). No run starts after BUDGET_S seconds; the ones skipped are named.
# Result files (lora-llama-3.1-8b-<run>-<gpu>-<commit>.json, 7 at most) and the summary
# (lora-summary-<gpu>-<commit>.json) go to $OUT; logs and adapters elsewhere, so at most 8 files
# come back from $OUT.
#   OUT=$OUT TOKENMILL_COMMIT=<commit> benchmarks/lora_gpu.sh [--only main,rank,count]
set -u
usage() {
  echo "usage: [OUT=dir] [LOGS=dir] [ADAPTERS=dir] [NUM_PROMPTS=512] [RUN_TIMEOUT=240] [BUDGET_S=480]"
  echo "       [TOKENMILL_COMMIT=id] [MODEL=dir] [INPUT_LEN=512] [OUTPUT_LEN=256] [EXTRA_ARGS='bench options']"
  echo "       benchmarks/lora_gpu.sh [--only main,rank,count]"
  echo "  main: off, base-only, n8-r16; rank: n8-r8, n8-r16, n8-r64; count: n1-r16, n8-r16, n32-r16;"
  echo "  or single runs by label (base-only, nN-rR)"
  echo "  (off, LoRA disabled, always runs first: every ratio is against it, in the same call)"
}
ONLY=main,rank,count
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --only) [ $# -ge 2 ] || { echo "--only needs a value: main, rank, count or a comma list" >&2; exit 2; }
      ONLY=$2; shift 2 ;;
    --only=*) ONLY=${1#--only=}; shift ;;
    *) echo "unknown argument $1; benchmarks/lora_gpu.sh takes --only main,rank,count (or --help)" >&2; exit 2 ;;
  esac
done
for part in ${ONLY//,/ }; do
  case $part in
    main | rank | count | base-only | n[0-9]*-r[0-9]*) ;;
    *) echo "--only: unknown part '$part'; use main, rank, count or run labels (base-only, n8-r16, ...)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-/tmp/tokenmill-lora-gpu}
LOGS=${LOGS:-/tmp/tokenmill-lora-logs}
ADAPTERS=${ADAPTERS:-/tmp/tokenmill-lora-adapters}  # one directory per rank, shared by the runs
mkdir -p "$OUT" "$LOGS" "$ADAPTERS"
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-benchmarks/configs/llama-3.1-8b}
NUM_PROMPTS=${NUM_PROMPTS:-512}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
# A CPU smoke run of this script: MODEL=<tiny checkpoint> EXTRA_ARGS="--device cpu --load-format auto" ...
EXTRA_ARGS=${EXTRA_ARGS:-}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
BUDGET_S=${BUDGET_S:-480}  # no run starts after this many seconds of the script (a device call: 600 s)
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE "H100|H200|A100|L40S" | tr A-Z a-z)}
GPU=${GPU:-gpu}
export TOKENMILL_COMMIT=${TOKENMILL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
TOKENMILL=(python3 -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())')

{
  nvidia-smi -L
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1

# The bench options of each run.
run_args() {
  case $1 in
    off) ;;
    base-only) echo "--lora-adapters 8 --lora-rank 16 --lora-base-only" ;;
    n*-r*)
      local n=${1%-r*} r=${1#*-r}
      n=${n#n}
      echo "--lora-adapters $n --lora-rank $r --max-loras 8 --lora-dir $ADAPTERS/r$r" ;;
  esac
}

DONE=" "
run() {
  local label=$1 started=$SECONDS
  [[ "$DONE" == *" $label "* ]] && return
  DONE="$DONE$label "
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then  # keep the call inside its limit: the summary still runs
    echo "== $label skipped: ${SECONDS} s gone, BUDGET_S=$BUDGET_S; run its part in another call"
    return
  fi
  local log=$LOGS/$label.log
  # shellcheck disable=SC2046,SC2086
  timeout "$RUN_TIMEOUT" "${TOKENMILL[@]}" bench throughput --model "$MODEL" --load-format dummy \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --max-model-len "$MAX_MODEL_LEN" \
    --result-dir "$OUT" --result-name "lora-$(basename "$MODEL")-$label-$GPU-$TOKENMILL_COMMIT" $(run_args "$label") \
    $EXTRA_ARGS >"$log" 2>&1
  local rc=$?
  echo "== $label (exit $rc, $((SECONDS - started)) s): $(grep -E '^tokenmill:|^LoRA during' "$log" | tr '\n' ' ')"
  if [ $rc -ne 0 ]; then grep -vE "it/s\]|s/it\]" "$log" | tail -15; fi
}

run off
for part in ${ONLY//,/ }; do
  case $part in
    main) run base-only; run n8-r16 ;;
    rank) for r in 8 16 64; do run "n8-r$r"; done ;;
    count) for n in 1 8 32; do run "n$n-r16"; done ;;
    *) run "$part" ;;  # one run by its label, e.g. n32-r16
  esac
done

python3 benchmarks/lora_summary.py "$OUT" --gpu "$GPU" --commit "$TOKENMILL_COMMIT"
