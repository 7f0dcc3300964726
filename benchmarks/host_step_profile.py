"""Per-step host time of a busy engine core, split by phase, with and without JSON-schema constraints.

  PYTHONPATH=src:. python benchmarks/host_step_profile.py --modes plain,constrained --steps 200
  (--tokenizer .gputok --vocab-size 128256: SmolLM2's tokenizer on Llama-3's vocabulary width, the
   GPU benchmark's grammar and bitmask sizes; --profile 25: cProfile's top functions of the last mode)

A tiny random Llama (hidden 64, 2 layers; tests/conftest.py's checkpoint writer) keeps the forward
cheap, so a step is mostly the host work a GPU step also does before and after its launch. The
engine core is stepped by hand with async scheduling (the CUDA default): `--requests` requests run
at once; each ends after its own max_tokens (or its grammar's end) and a new one joins with a
`--prompt-len` prompt, whose prefill is chunked under `--max-num-batched-tokens`, so most steps
carry prefill chunks next to ~`--requests` decodes (the steps issues 14 and 24 are about).

Each phase's time is its own (nested phases are subtracted): wrappers around the scheduler, the
runner's input preparation, sampling, the grammar manager and the core's output path, plus what
the core process does per step besides `step()` (get_stats, msgpack of the outputs) and the API
side's output processing (detokenization, reported apart: another process in `serve`). `forward`,
`logits` and `mask_apply` are device work on a GPU: host ms per step leaves them out.
`host_cpu_ms_without_sampling` is that total in the main thread's CPU time (immune to other
processes on a shared machine; waits for the fill thread or the GIL are not in it).
`sample` / `masked_sample` hold some host work but mostly, on this CPU, tensor math over the
logits that a GPU runs as kernels: `host_ms_without_sampling` leaves them out too (a lower bound).
The grammar fill runs on the manager's thread: where it holds the GIL it shows up in the main
thread's phases (the ZMQ send and poll give it the GIL), and `mask_wait+sample_filled` is what
the next step waited for it.

Modes alternate round by round in one process (`--rounds`), each with fresh requests from the same
seed; `tokens_sha` is a digest of every request's tokens, equal across code versions when greedy
output is unchanged.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import hashlib
import io
import json
import pstats
import random
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# Device work on a GPU (on this CPU it runs inline): not host time.
DEVICE_PHASES = ("forward", "logits", "mask_apply")
# Sampling: some host work, but on this CPU mostly tensor math over [rows, vocab] (argmax, the
# non-finite check) that a GPU runs as kernels: `host_ms_without_sampling` leaves them out too.
SAMPLING_PHASES = ("sample", "masked_sample")


class PhaseTimer:
    """Exclusive time per phase of the main thread (a phase called inside another is taken out of
    the outer one's time), as wall time and as the thread's CPU time (`cpu`: what other processes
    on a shared machine cannot inflate, and without waits); other threads (the grammar fill) pass
    through untimed."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # [start, cpu start, nested wall, nested cpu]
        self._main = threading.get_ident()

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._main:
                return inner(*args, **kwargs)
            frame = [time.perf_counter(), time.thread_time(), 0.0, 0.0]
            self._stack.append(frame)
            try:
                return inner(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[0]
                cpu = time.thread_time() - frame[1]
                self.totals[phase] += elapsed - frame[2]
                self.cpu[phase] += cpu - frame[3]
                if self._stack:
                    self._stack[-1][2] += elapsed
                    self._stack[-1][3] += cpu

        setattr(owner, attr, timed)

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        cpu, self.cpu = dict(self.cpu), defaultdict(float)
        return totals, cpu


def build_model(tokenizer_path: str | None, vocab_size: int | None, out: Path) -> Path:
    from tests.conftest import build_tiny_tokenizer, write_tiny_checkpoint
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else build_tiny_tokenizer()
    if tokenizer.eos_token_id is None:
        tokenizer.eos_token = tokenizer.pad_token or tokenizer.convert_ids_to_tokens(0)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    overrides: dict[str, Any] = {"max_position_embeddings": 4096, "tie_word_embeddings": True, "head_dim": 16}
    if vocab_size:
        overrides["vocab_size"] = max(vocab_size, len(tokenizer))
    return write_tiny_checkpoint(out, "llama", tokenizer, seed=1, **overrides)


def instrument(llm: Any, timer: PhaseTimer) -> None:
    from tokenmill.worker import model_runner

    core = llm.engine
    runner = core.runner
    wraps = [
        (core.scheduler, "schedule", "schedule"),
        (core.scheduler, "update_from_output", "update"),
        (core.scheduler, "launched", "sched_launched"),
        (runner.requests, "update", "runner_states"),
        (model_runner, "build_host_batch", "host_batch"),
        (runner, "build_metadata", "metadata"),
        (runner, "_sample", "sample"),
        (runner, "sample_tokens", "masked_sample"),
        (runner.model, "forward", "forward"),
        (runner.model, "compute_logits", "logits"),
        (runner.grammar_masker, "apply", "mask_apply"),
        (model_runner.PendingStep, "result", "result"),
        (core.structured_output, "prepare_fill", "grammar_prepare"),
        (core.structured_output, "grammar_output_async", "grammar_dispatch"),
        (core.structured_output, "grammar_output", "grammar_fill_sync"),
        (core, "_sample_filled", "mask_wait+sample_filled"),
        (core.timelines, "scheduled", "timelines"),
        (core.timelines, "outputs", "timelines"),
        (core, "get_stats", "stats"),
        (llm.output_processor, "process_outputs", "api_output_processing"),
    ]
    for owner, attr, phase in wraps:
        timer.wrap(owner, attr, phase)


def compile_grammars(llm: Any) -> None:
    """Every schema's grammar compiled (the manager caches them by spec) before anything is timed:
    a constrained request then joins the batch at the next schedule, not when its compile thread
    happens to finish, so runs schedule alike and their tokens can be compared."""
    from tokenmill.bench.json_schemas import SCHEMAS
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

    params = [
        SamplingParams(
            temperature=0.0, max_tokens=1,
            structured_outputs=StructuredOutputsParams(json=case.schema, disable_any_whitespace=True),
        )
        for case in SCHEMAS
    ]  # fmt: skip
    llm.generate([[5, 6, 7]] * len(params), params)


class Channel:
    """The core process's sockets (an idle inbox it polls, the outbox it sends its outputs on) and
    the API server's end of the outbox, in-process."""

    def __init__(self) -> None:
        import zmq

        context = zmq.Context.instance()
        address = f"inproc://host-step-{id(self)}"
        self.api_inbox = context.socket(zmq.PULL)
        self.api_inbox.bind(address)
        self.outbox = context.socket(zmq.PUSH)
        self.outbox.connect(address)
        self.inbox = context.socket(zmq.PULL)
        self.inbox.bind(f"inproc://host-step-in-{id(self)}")
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)

    def close(self) -> None:
        for socket in (self.outbox, self.api_inbox, self.inbox):
            socket.close(linger=0)


def run_mode(
    llm: Any,
    args: argparse.Namespace,
    constrained: bool,
    timer: PhaseTimer,
    profiler: cProfile.Profile | None,
) -> dict:
    import msgspec
    import zmq

    from tokenmill.bench.json_schemas import SCHEMAS
    from tokenmill.engine.messages import EngineCoreRequest, StepOutputs
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

    core = llm.engine
    rng = random.Random(args.seed)
    vocab = len(llm.tokenizer)
    eos = list(core.resolved.arch.eos_token_ids)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(StepOutputs)
    channel = Channel()
    ids = iter(range(10**9))
    tokens: dict[str, list[int]] = {}

    def add() -> None:
        rid = f"r{next(ids)}"
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        max_tokens = rng.randint(args.output_len // 2, args.output_len * 3 // 2)
        if constrained:
            schema = SCHEMAS[rng.randrange(len(SCHEMAS))].schema
            so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.output_processor.add_request(rid, rid, 0, None, prompt, params, stream=True)
        core.add_request(EngineCoreRequest(rid, prompt, params, max_tokens=max_tokens, eos_token_ids=eos))
        tokens[rid] = []

    live = 0
    for _ in range(args.requests):
        add()
        live += 1
    from tokenmill.engine.gc_pauses import GcPauses

    pauses = GcPauses()
    gc_seconds = 0.0
    gc_counts = [0, 0, 0]
    records: list[tuple[float, float, bool, float]] = []  # (host s, device s, mixed, sampling s)
    cpu_records: list[float] = []  # the main thread's CPU seconds, device and sampling phases out
    cpu_phases: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    shapes: list[tuple[int, int]] = []
    total_steps = args.warmup_steps + args.steps
    for step in range(total_steps):
        measuring = step >= args.warmup_steps
        if measuring and profiler is not None:
            profiler.enable()
        timer.take()
        started = time.perf_counter()
        started_cpu = time.thread_time()
        # The core process's loop: poll its inbox, step, send the outputs (the poll and the send
        # give up the GIL, which is when the grammar fill thread gets to run Python).
        channel.poller.poll(0)
        outputs = core.step()
        stepped = time.perf_counter()
        if outputs:
            channel.outbox.send(
                encoder.encode(StepOutputs(outputs=outputs, stats=core.get_stats())), zmq.NOBLOCK
            )
        engine_s = time.perf_counter() - started
        engine_cpu = time.thread_time() - started_cpu
        if outputs:  # the API server's side, another process in `serve`
            decoded = decoder.decode(channel.api_inbox.recv())
            if args.detokenize:
                llm.output_processor.process_outputs(decoded.outputs)
        if measuring and profiler is not None:
            profiler.disable()
        step_phases, step_cpu = timer.take()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                live -= 1
        while live < args.requests:
            add()
            live += 1
        step_pauses = pauses.drain()
        if not measuring:
            continue
        for _, seconds, generation in step_pauses:  # inside whichever phase it interrupted
            gc_seconds += seconds
            gc_counts[generation] += 1
        device_s = sum(step_phases.get(p, 0.0) for p in DEVICE_PHASES)
        in_step = sum(step_phases.values()) - step_phases.get("api_output_processing", 0.0)
        step_phases["serialize"] = engine_s - (stepped - started) - step_phases.get("stats", 0.0)
        step_phases["other"] = engine_s - in_step - step_phases["serialize"]
        for name, seconds in step_phases.items():
            phases[name] += seconds
        sched = core._in_flight[0] if core._in_flight else (core._filling[0] if core._filling else None)
        mixed = sched is not None and any(n > 1 for n in sched.num_scheduled_tokens.values())
        if sched is not None:
            shapes.append((len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens))
        sampling_s = sum(step_phases.get(p, 0.0) for p in SAMPLING_PHASES)
        records.append((engine_s - device_s, device_s, mixed, sampling_s))
        excluded = DEVICE_PHASES + SAMPLING_PHASES
        cpu_records.append(engine_cpu - sum(step_cpu.get(p, 0.0) for p in excluded))
        for name, seconds in step_cpu.items():
            cpu_phases[name] += seconds
    # Drain: every request to its end, for the digest.
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    channel.close()
    pauses.close()
    digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]
    host = [h for h, _, _, _ in records]
    mixed_host = [h for h, _, m, _ in records if m]
    n = len(records)
    return {
        "host_ms_per_step": round(1000 * statistics.fmean(host), 3),
        "host_ms_without_sampling": round(1000 * statistics.fmean(h - s for h, _, _, s in records), 3),
        "host_cpu_ms_without_sampling": round(1000 * statistics.fmean(cpu_records), 3),
        "host_ms_p50": round(1000 * statistics.median(host), 3),
        "host_ms_mixed_steps": round(1000 * statistics.fmean(mixed_host), 3) if mixed_host else None,
        "mixed_steps": len(mixed_host),
        "device_ms_per_step": round(1000 * statistics.fmean(d for _, d, _, _ in records), 3),
        "avg_reqs": round(statistics.fmean(r for r, _ in shapes), 1) if shapes else 0,
        "avg_tokens": round(statistics.fmean(t for _, t in shapes), 1) if shapes else 0,
        "gc_ms_per_step": round(1000 * gc_seconds / n, 3),
        "gc_collections_by_generation": gc_counts,
        "phases_ms_per_step": {
            k: round(1000 * v / n, 3) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])
        },
        "cpu_phases_ms_per_step": {
            k: round(1000 * v / n, 3) for k, v in sorted(cpu_phases.items(), key=lambda kv: -kv[1])
        },
        "tokens_sha": digest,
        "requests_done": len(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="plain,constrained", help="comma-separated: plain, constrained")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the modes")
    parser.add_argument("--requests", type=int, default=64, help="requests running at once")
    parser.add_argument("--prompt-len", type=int, default=320)
    parser.add_argument("--output-len", type=int, default=48, help="mean max_tokens (uniform in [L/2, 3L/2])")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="measured steps per mode and round")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument(
        "--tokenizer", default=None, help="an HF tokenizer directory (default: the tests' tiny BPE)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="the model's vocabulary (>= the tokenizer's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--detokenize", action="store_true", help="also run the API side's output processing (timed apart)"
    )
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions (last mode)")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key")
    parser.add_argument("--output", default=None, help="append every run's results here (a JSON line)")
    parser.add_argument("--label", default="", help="stored with --output (e.g. the code version)")
    args = parser.parse_args()

    from tokenmill import LLM

    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="host-step-") as tmp:
        model = build_model(args.tokenizer, args.vocab_size, Path(tmp))
        llm = LLM(
            str(model),
            device="cpu",
            async_scheduling=True,
            max_model_len=4096,
            max_num_seqs=max(args.requests, 8),
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=256 << 20,
        )
        if "constrained" in modes:
            compile_grammars(llm)
        # As the core process does once it is up: start-up's objects out of the collector's walks.
        gc.collect()
        gc.freeze()
        timer = PhaseTimer()
        instrument(llm, timer)
        results: dict[str, list[dict]] = defaultdict(list)
        for r in range(args.rounds):
            for i, mode in enumerate(modes):
                last = r == args.rounds - 1 and i == len(modes) - 1
                profiler = cProfile.Profile() if args.profile and last else None
                results[mode].append(run_mode(llm, args, mode == "constrained", timer, profiler))
                if profiler is not None:
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.profile)
                    print(text.getvalue())
        summary = {
            mode: {
                "host_ms_per_step": [r["host_ms_per_step"] for r in runs],
                "host_ms_mixed_steps": [r["host_ms_mixed_steps"] for r in runs],
                "last": runs[-1],
            }
            for mode, runs in results.items()
        }
        print(json.dumps(summary, indent=1))
        if args.output:
            import tokenmill

            record = {
                "src": str(Path(tokenmill.__file__).parents[1]),
                "label": args.label,
                "args": vars(args),
            }
            with open(args.output, "a") as f:
                f.write(json.dumps(record | {"results": results}) + "\n")
        llm.close()


if __name__ == "__main__":
    main()
