#!/usr/bin/env bash
# Issue 21's GPU benchmarks in one device call (one H100 or H200, <= 540 s), Llama-3.1-8B shapes with
# dummy bf16 weights (--load-format dummy) and the tokenizer of a directory you pass in:
#   copies  benchmarks/kv_offload.py --copies-only: the host tier's raw copies on 8B-shaped pools
#           (no engine, ~10 s): a 4k- and a 16k-token load, save, save+load and scattered load,
#           GB/s and copy calls
#   tests   pytest tests/gpu/test_kv_offload_gpu.py (the tier on CUDA: output equal with it on and
#           off, loads waited for per layer, eagerly and through piecewise graphs; tiny checkpoint)
#   tier    benchmarks/kv_offload.py: multi-turn re-hits of 4k / 8k / 16k-token prefixes that no
#           longer fit in the device pool (3,072 blocks = 48k tokens against 84k of first turns),
#           TTFT from the host tier against recomputing the same length (target >= 3x), once with
#           per-layer overlap and once with every layer's copies waited for first (same engine)
#   disagg  benchmarks/disagg_itl.sh: a colocated engine against a producer and a consumer sharing
#           the GPU behind the router, 4k-token prompts arriving during decode: ITL / TTFT p99 and
#           output throughput
# then benchmarks/kv_tier_summary.py "$OUT" prints the summary. No part starts after BUDGET_S
# seconds (skipped parts are named: call again with --only); each is cut at the budget's end.
#   TOKENIZER=/path/to/tokenizer_dir OUT=/tmp/kvtier benchmarks/kv_tier_gpu.sh [--only copies,tests,tier,disagg] [--budget S]
# OVERLAP_AB=0 skips the tier's second (wait-all) pass.
#   benchmarks/kv_tier_gpu.sh --cpu-smoke     # the plumbing on the CPU with a tiny checkpoint
set -u
ONLY=copies,tests,tier,disagg
BUDGET_S=${BUDGET_S:-540}
CPU_SMOKE=0
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
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
    copies | tests | tier | disagg) ;;
    *) echo "--only: unknown part '$part'; use copies, tests, tier, disagg" >&2; exit 2 ;;
  esac
done
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/tokenmill-kv-tier}
mkdir -p "$OUT"
PY=${PY:-python3}

if [ "$CPU_SMOKE" = 1 ]; then
  # Toy scale: a tiny llama with its tokenizer stands for the 8B model; the same commands.
  TINY=${TINY:-/tmp/tokenmill-kv-tier-tiny}
  [ -f "$TINY/config.json" ] || $PY -c "
from pathlib import Path
from tests.conftest import build_tiny_tokenizer, write_tiny_checkpoint
write_tiny_checkpoint(Path('$TINY'), 'llama', build_tiny_tokenizer(), seed=3)" || exit 1
  export MODEL=$TINY TOKENIZER=$TINY LOAD_FORMAT=auto
  TIER_ARGS="--device cpu --contexts 128,256 --conversations 6 --num-kv-blocks 40 --kv-offload-gb 0.01 --output-len 4 --turn-tokens 16"
  COPIES_TOKENS="256" COPIES_ARGS="--device cpu"
  export INPUT_LEN=128 OUTPUT_LEN=16 NUM_PROMPTS=8 RATE=4 KV_BLOCKS=256 SERVE_ARGS="--device cpu" PORT_BASE=8760
else
  export MODEL=${MODEL:-benchmarks/configs/llama-3.1-8b} LOAD_FORMAT=${LOAD_FORMAT:-dummy}
  export TOKENIZER=${TOKENIZER:?set TOKENIZER to a tokenizer directory (e.g. Llama-3.1-8B-Instruct\'s)}
  COPIES_TOKENS=${COPIES_TOKENS:-"4096 16384"} COPIES_ARGS=${COPIES_ARGS:-}
  TIER_ARGS=${TIER_ARGS:-"--contexts 4096,8192,16384 --conversations 9 --num-kv-blocks 3072 --kv-offload-gb 24 --output-len 4 --turn-tokens 64"}
fi
[ -d "$TOKENIZER" ] || { echo "TOKENIZER=$TOKENIZER is not a directory" >&2; exit 2; }

AB=--overlap-ab
[ "${OVERLAP_AB:-1}" = 0 ] && AB=
remaining() { echo $((BUDGET_S - SECONDS)); }
skipped=()
for part in ${ONLY//,/ }; do
  left=$(remaining)
  if [ "$left" -lt 30 ]; then
    skipped+=("$part")
    continue
  fi
  echo "== $part (budget left ${left} s)"
  case $part in
    copies)
      for tokens in $COPIES_TOKENS; do
        timeout -k 5 "$left" $PY benchmarks/kv_offload.py --copies-only --bandwidth-tokens $tokens $COPIES_ARGS \
          --result-dir "$OUT" --result-name "kv-tier-copies-$tokens" 2>&1 | tee -a "$OUT/kv-tier-copies.log" | grep -v "^wrote"
      done ;;
    tests)
      timeout -k 5 "$left" $PY -m pytest -p no:cacheprovider -q -rA tests/gpu/test_kv_offload_gpu.py \
        >"$OUT/kv-tier-tests.log" 2>&1
      echo "tests exit $? (log $OUT/kv-tier-tests.log)"
      grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/kv-tier-tests.log" | tail -6 ;;
    tier)
      # shellcheck disable=SC2086
      timeout -k 5 "$left" $PY benchmarks/kv_offload.py --model "$MODEL" --tokenizer "$TOKENIZER" \
        --load-format "$LOAD_FORMAT" $TIER_ARGS $AB --result-dir "$OUT" --result-name kv-tier-offload \
        >"$OUT/kv-tier-offload.log" 2>&1
      echo "tier exit $? (log $OUT/kv-tier-offload.log)" ;;
    disagg)
      # The script stops its servers itself once its budget is spent (a timeout could orphan them).
      BUDGET_S=$left OUT=$OUT bash benchmarks/disagg_itl.sh >"$OUT/disagg-itl.log" 2>&1
      echo "disagg exit $? (log $OUT/disagg-itl.log)" ;;
  esac
done
[ ${#skipped[@]} -eq 0 ] || echo "skipped (budget spent): ${skipped[*]}; run again with --only $(IFS=,; echo "${skipped[*]}")"
$PY benchmarks/kv_tier_summary.py "$OUT"
