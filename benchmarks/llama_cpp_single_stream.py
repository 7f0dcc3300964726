"""llama.cpp's llama-server on one GGUF, one stream: its own prompt and decode timings, as a result file.

Starts `llama-server` (built by benchmarks/llama_cpp_baseline.sh into its cache) on the file, sends
`--rounds` requests of `--input-len` random token ids (llama-server takes ids, so a vocabulary
without merges does, as in make_dummy_gguf.py's files) for `--output-len` tokens with EOS ignored,
and writes llama.cpp's `timings` (prompt_ms, predicted_per_second) per round and their medians.
Compare with `tokenmill bench latency` on the same file run in the same session
(benchmarks/gguf_k_quants_cpu.sh does both).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from tokenmill.bench.results import write_result

DEFAULT_BIN = Path.home() / ".cache/tokenmill/llama.cpp-0.3.36/build/bin/llama-server"


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--server-bin", type=Path, default=DEFAULT_BIN)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default=None)
    args = parser.parse_args()
    if not args.server_bin.is_file():
        raise SystemExit(f"no llama-server at {args.server_bin}; benchmarks/llama_cpp_baseline.sh builds it")
    env = dict(os.environ, LD_LIBRARY_PATH=str(args.server_bin.parent))
    command = [str(args.server_bin), "-m", str(args.gguf), "-t", str(args.threads), "-c", "2048",
               "--port", str(args.port)]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(
                        f"llama-server exited ({server.returncode}) loading {args.gguf}"
                    ) from None
                time.sleep(0.5)
        rng = random.Random(0)
        rounds = []
        for i in range(args.rounds):
            prompt = [rng.randrange(10, 1000) for _ in range(args.input_len)]
            timings = _post(args.port, {
                "prompt": prompt, "n_predict": args.output_len, "ignore_eos": True, "temperature": 0,
                "cache_prompt": False,
            })["timings"]  # fmt: skip
            rounds.append({k: timings[k] for k in ("prompt_ms", "predicted_n", "predicted_per_second")})
            print(
                f"round {i + 1}: prompt {timings['prompt_ms']:.0f} ms, decode {timings['predicted_per_second']:.2f} tok/s"
            )
    finally:
        server.terminate()
        server.wait(timeout=30)
    metrics = {
        "prompt_ms_median": statistics.median(r["prompt_ms"] for r in rounds),
        "decode_tokens_per_s_median": statistics.median(r["predicted_per_second"] for r in rounds),
        "rounds": rounds,
    }
    config = {"engine": "llama.cpp llama-server", "server_command": command, **{
        k: getattr(args, k) for k in ("threads", "input_len", "output_len", "rounds")}}  # fmt: skip
    print(write_result("llama_cpp_single_stream", config, metrics, args.result_dir, args.result_name))


if __name__ == "__main__":
    main()
