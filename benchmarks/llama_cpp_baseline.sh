#!/usr/bin/env bash
# Issue 23: `tokenmill serve` against llama.cpp's `llama-server` on the same GGUF (the default model,
# SmolLM2-135M-Instruct Q4_1), driven by the same `tokenmill bench serve` command, back to back at
# each concurrency (1, 8, 32; 128-token prompts, 128-token answers, EOS ignored). Ratios are taken
# within one run: the CPU machines are shared and noisy.
#
# llama-server is built from the llama.cpp sources bundled in the llama-cpp-python sdist (CMake,
# Release, -march=native), once, into $LLAMA_CACHE (outside the repo). Nothing of llama.cpp goes
# into the package or the tests.
#
#   benchmarks/llama_cpp_baseline.sh                   # results in benchmarks/results/
#   CONCURRENCIES="32" ROUNDS=2 benchmarks/llama_cpp_baseline.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LLAMA_CACHE=${LLAMA_CACHE:-$HOME/.cache/tokenmill/llama.cpp-$VERSION}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
CONCURRENCIES=${CONCURRENCIES:-1 8 32}
ROUNDS=${ROUNDS:-1}  # >1: repeat the llama / tokenmill pairs, alternating, to see the spread
LLAMA_PORT=${LLAMA_PORT:-8791}
TM_PORT=${TM_PORT:-8792}
# llama-server's threads. Its default (all cores) collapsed under other jobs' load on this 2-core
# machine: 3.9 output tok/s at c=1 with -t 2 against 39 with -t 1, same minute. So 1, its faster
# setting here; LLAMA_THREADS=2 to compare on a quiet machine.
LLAMA_THREADS=${LLAMA_THREADS:-1}
TM_SERVE_ARGS=${TM_SERVE_ARGS:-}  # e.g. --kernel-config '{"cpu_quantized_gemm_rows": 0}'
TM_ENV=${TM_ENV:-}                # e.g. OMP_NUM_THREADS=1 (the engine's torch threads)
LOG_DIR=${LOG_DIR:-/tmp/tokenmill-llama-cpp-baseline}
# The CPU's instruction sets. Not GGML_NATIVE: -march=native turns on AMX on Sapphire Rapids, and
# on this project's VM the first AMX tile instruction dies with SIGILL (the guest may not use AMX
# state), so llama-server crashed loading the model. The same AVX-512 / VNNI / BF16 sets, spelled out
# where the CPU has them; AVX2 / FMA / F16C alone elsewhere (the AMD Zen 3 machine: no AVX-512).
AVX2_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
if grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null; then
  DEFAULT_FLAGS="$AVX2_FLAGS -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
else
  DEFAULT_FLAGS=$AVX2_FLAGS
fi
# AVX-VNNI (the VEX-encoded 256-bit form) is a flag of its own: AMD Zen 4 has AVX-512 VNNI without
# it, and a build with it died there with SIGILL on the first such instruction.
# (OFF spelled out: CMake keeps a cached ON from an earlier configure of the same build directory.)
if grep -qw avx_vnni /proc/cpuinfo 2>/dev/null; then
  DEFAULT_FLAGS="$DEFAULT_FLAGS -DGGML_AVX_VNNI=ON"
else
  DEFAULT_FLAGS="$DEFAULT_FLAGS -DGGML_AVX_VNNI=OFF"
fi
LLAMA_CMAKE_FLAGS=${LLAMA_CMAKE_FLAGS:-$DEFAULT_FLAGS}
COMMIT=${TOKENMILL_COMMIT:-$(git rev-parse --short HEAD)}
TAG=${TAG:-$COMMIT}
export TOKENMILL_COMMIT=$COMMIT

tm() { PYTHONPATH=src "$PY" -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())' "$@"; }

# 1. llama-server, built once.
SERVER_BIN=$LLAMA_CACHE/build/bin/llama-server
if [ ! -x "$SERVER_BIN" ]; then
  mkdir -p "$LLAMA_CACHE"
  if [ ! -d "$LLAMA_CACHE/llama_cpp_python-$VERSION" ]; then
    echo "== downloading the llama-cpp-python $VERSION sdist"
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$LLAMA_CACHE"
    tar -xzf "$LLAMA_CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$LLAMA_CACHE"
  fi
  echo "== building llama-server (a few minutes on 2 cores; log in $LLAMA_CACHE/build.log)"
  # shellcheck disable=SC2086
  cmake -S "$LLAMA_CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$LLAMA_CACHE/build" \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $LLAMA_CMAKE_FLAGS >"$LLAMA_CACHE/cmake.log"
  cmake --build "$LLAMA_CACHE/build" --target llama-server -j "$(nproc)" >"$LLAMA_CACHE/build.log"
fi

# 2. The same GGUF tokenmill serves by default, and its tokenizer (the same prompts to both).
GGUF=$(PYTHONPATH=src "$PY" -c 'from tokenmill.model.loader.default_model import default_model_path; print(default_model_path())')
TOKENIZER=$LLAMA_CACHE/tokenizer
if [ ! -f "$TOKENIZER/tokenizer.json" ]; then
  "$PY" -c 'import sys, pathlib; from transformers import AutoTokenizer; p = pathlib.Path(sys.argv[1]); AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(sys.argv[2])' "$GGUF" "$TOKENIZER"
fi
echo "== model $GGUF"

wait_health() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    sleep 1
  done
  echo "server on port $1 never became healthy" >&2
  return 1
}

mkdir -p "$LOG_DIR" "$OUT"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# 3. Both servers up; 32 slots (one per client at c=32) of 512 tokens, continuous batching.
"$SERVER_BIN" -m "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" -np 32 -cb -c $((32 * 512)) \
  -t "$LLAMA_THREADS" --no-webui >"$LOG_DIR/llama-server.log" 2>&1 &
pids+=($!)
# shellcheck disable=SC2086
env $TM_ENV PYTHONPATH=src "$PY" -c 'import sys; sys.argv[0] = "tokenmill"; from tokenmill.cli import main; sys.exit(main())' \
  serve --port "$TM_PORT" $TM_SERVE_ARGS >"$LOG_DIR/tokenmill-serve.log" 2>&1 &
pids+=($!)
wait_health "$LLAMA_PORT"
wait_health "$TM_PORT"
grep -h "engine on CPU" "$LOG_DIR/tokenmill-serve.log" || true

# 4. The same client against each, back to back at each concurrency.
for round in $(seq 1 "$ROUNDS"); do
  for c in $CONCURRENCIES; do
    prompts=$((c * 2 < 8 ? 8 : c * 2))
    # Fresh prompts in every run: under one seed c=8's 16 prompts are c=32's first 16, and a later
    # round repeats the earlier one's, so both servers answered those from their prefix / prompt
    # caches (a c=32 run after c=8 started 16 of its first 32 prompts at once, from the cache).
    # Round 1 of c=32 keeps seed 0, the prompts of the earlier c=32 figures. SAME_PROMPTS=1: seed 0
    # everywhere, as before 2026-12-02.
    seed=$(( (round - 1) * 1000 + (c == 32 ? 0 : c) ))
    [ "${SAME_PROMPTS:-0}" = 1 ] && seed=0
    for side in llama-server tokenmill; do
      port=$LLAMA_PORT
      [ "$side" = tokenmill ] && port=$TM_PORT
      echo "== round $round, c=$c, $side ($prompts prompts)"
      tm bench serve --port "$port" --tokenizer "$TOKENIZER" --dataset-name random --num-prompts "$prompts" \
        --random-input-len 128 --random-output-len 128 --max-concurrency "$c" --ignore-eos --disable-tqdm --seed "$seed" \
        --num-warmups 1 --save-result --result-dir "$OUT" \
        --result-filename "llama-cpp-baseline-$TAG-$side-r$round-c$c" 2>&1 |
        grep -E "throughput|TTFT|ITL|Successful|Failed|failed:" | head -12
    done
  done
done

# 5. Ratios (tokenmill / llama-server) into one result file, and a table for BENCHMARKS.md.
PYTHONPATH=src "$PY" benchmarks/llama_cpp_baseline_summary.py --result-dir "$OUT" --tag "$TAG"
