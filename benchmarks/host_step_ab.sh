#!/usr/bin/env bash
# A/B of the engine's per-step host time (benchmarks/host_step_profile.py) between two source trees,
# alternating runs so machine load hits both alike; each run appends a JSON line to $OUT.
#   BASE=/tmp/base/src ROUNDS=3 benchmarks/host_step_ab.sh [host_step_profile.py arguments]
# BASE: the "before" tree's src/ (e.g. `git archive <commit> src | tar -x -C /tmp/base`); the
# "after" tree is this checkout's src/. Env: ROUNDS (default 3), OUT (default
# benchmarks/results/host-step-ab.jsonl), PY (default python3). Prints one summary line per run.
set -eu
: "${BASE:?set BASE to the src directory of the before tree}"
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-benchmarks/results/host-step-ab.jsonl}
PY=${PY:-python3}
for round in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    if [ "$side" = before ]; then SRC=$BASE; else SRC=$PWD/src; fi
    PYTHONPATH="$SRC:$PWD" "$PY" benchmarks/host_step_profile.py --output "$OUT" --label "$side" "$@" 2>/dev/null \
      | "$PY" -c "
import json, sys
text = sys.stdin.read()
for mode, v in json.loads(text[text.index('{'):]).items():
    last = v['last']
    print('round $round $side', mode, 'host_ms', last['host_ms_per_step'], 'without_sampling', last['host_ms_without_sampling'], 'cpu', last['host_cpu_ms_without_sampling'], 'mixed_steps_ms', last['host_ms_mixed_steps'], 'tokens', last['tokens_sha'])"
  done
done
