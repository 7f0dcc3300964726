"""Start-up warm-up against Triton compiles while serving, on a freshly started engine.

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/warmup_compiles.py

Starts an engine (Llama-3.1-8B shapes with dummy weights by default), then drives it by hand
through `tokenmill.bench.mixed_workload` (the workload tests/gpu/test_kernel_warmup_gpu.py runs). Prints the start-up log lines (memory profile, graph capture, warm-up), every Triton compile
after start-up (kernel, seconds) and the slowest steps' wall times (a compile stalls its step).
Point TRITON_CACHE_DIR at an empty folder to see a cold start, as on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import time


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--decodes", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args()

    import torch

    from tokenmill import LLM
    from tokenmill.bench.mixed_workload import run_mixed_workload
    from tokenmill.kernels.jit_compiles import JitCompiles

    lines = _Lines()
    logging.getLogger("tokenmill").addHandler(lines)
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    started = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len)
    start_up = time.perf_counter() - started
    compiles = JitCompiles()
    engine = llm.engine
    step_times: list[float] = []

    def step() -> list:
        t = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - t)
        return outputs

    run_mixed_workload(llm, num_decodes=args.decodes, seed=args.seed, step=step)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    found = compiles.drain()
    compiles.close()
    slowest = sorted(step_times, reverse=True)
    summary = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "start_up_s": round(start_up, 1),
        "start_up_log": [
            line for line in lines.lines if any(w in line for w in ("warmed up", "captured", "profil", "KV cache"))
        ],
        "compiles_while_serving": len(found),
        "compile_seconds_while_serving": round(sum(s for _, _, s in found), 2),
        "compiles": [[name, round(s, 3)] for name, _, s in found],
        "compile_specializations": [line[:800] for line in lines.lines if "compiled a variant" in line],
        "steps": len(step_times),
        "slowest_steps_ms": [round(1000 * s, 1) for s in slowest[:8]],
        "median_step_ms": round(1000 * slowest[len(slowest) // 2], 1),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
