"""The multi-LoRA benchmark's pieces on the CPU: dummy adapters (valid PEFT files that the engine
and peft load alike), `bench throughput --lora-adapters` end to end on a tiny model, its option
checks, and benchmarks/lora_gpu.sh's argument handling."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import tokenmill
from tests.lora_adapters import greedy_tokens, merged_model
from tokenmill.bench import lora_workload
from tokenmill.bench.lora_adapters import (
    ALL_TARGETS,
    adapter_num_params,
    arch_of_model_dir,
    write_dummy_adapter,
    write_dummy_adapters,
)
from tokenmill.cli import build_parser
from tokenmill.lora.adapter_files import WEIGHTS_FILE, read_adapter

ROOT = Path(tokenmill.__file__).parents[2]


def test_dummy_adapters_pass_read_adapter_and_are_reused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    arch = arch_of_model_dir(tiny_llama_dir)
    paths = write_dummy_adapters(tmp_path, arch, 3, 4, targets=("q_proj", "down_proj"), progress=False)
    assert [p.name for p in paths] == ["lora-000", "lora-001", "lora-002"]
    for path in paths:
        spec = read_adapter(path, arch, max_rank=4)
        assert spec.rank == 4 and spec.target_modules == ("down_proj", "q_proj")
        assert len(spec.modules) == 2 * arch.num_layers
    from safetensors import safe_open

    with safe_open(str(paths[0] / WEIGHTS_FILE), framework="numpy") as f:
        names = list(f.keys())  # noqa: SIM118 - safe_open is not iterable
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
        elems = sum(int(f.get_slice(n).get_shape()[0]) * int(f.get_slice(n).get_shape()[1]) for n in names)
    assert elems == adapter_num_params(arch, 4, ("q_proj", "down_proj"))
    first, second = (safe_open(str(p / WEIGHTS_FILE), framework="pt") for p in paths[:2])
    with first, second:
        assert not first.get_tensor(names[0]).equal(second.get_tensor(names[0]))  # each adapter its own seed

    stamps = [(p / WEIGHTS_FILE).stat().st_mtime_ns for p in paths]
    again = write_dummy_adapters(tmp_path, arch, 4, 4, targets=("q_proj", "down_proj"), progress=False)
    assert [(p / WEIGHTS_FILE).stat().st_mtime_ns for p in again[:3]] == stamps  # kept, not rewritten
    read_adapter(again[3], arch, max_rank=4)
    other_rank = write_dummy_adapters(tmp_path, arch, 1, 8, targets=("q_proj", "down_proj"), progress=False)
    assert read_adapter(other_rank[0], arch, max_rank=8).rank == 8  # another rank: written anew


def test_dummy_adapter_options_are_checked(tiny_llama_dir: Path, tmp_path: Path) -> None:
    arch = arch_of_model_dir(tiny_llama_dir)
    with pytest.raises(ValueError, match="lm_head"):
        write_dummy_adapter(tmp_path / "a", arch, 4, targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="float8"):
        write_dummy_adapter(tmp_path / "a", arch, 4, dtype="float8")
    with pytest.raises(ValueError, match="layers"):
        write_dummy_adapter(tmp_path / "a", arch, 4, layers=[arch.num_layers])
    assert not (tmp_path / "a").exists()


def test_a_dummy_adapter_runs_in_the_engine_as_peft_merges_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """fp32 greedy tokens with the adapter equal transformers with it merged by peft, and differ
    from the base model's: the file is a real PEFT adapter that the engine applies."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    arch = arch_of_model_dir(tiny_llama_dir)
    path = write_dummy_adapter(tmp_path / "ad", arch, 8, dtype="float32", seed=3, b_scale=0.5, lora_alpha=16)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = ["The quick brown fox jumps over", "Once upon a time in a land far away"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=LoRARequest("ad", 1, str(path)))
    tokenizer = llm.get_tokenizer()
    oracle, base = merged_model(tiny_llama_dir, path), merged_model(tiny_llama_dir, None)
    differs = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt).input_ids
        expected = greedy_tokens(oracle, ids, 10)
        assert list(out.outputs[0].token_ids) == expected, prompt
        differs += expected != greedy_tokens(base, ids, 10)
    assert differs >= 1


def _bench(tiny_llama_dir: Path, out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[dict, list]:
    """Run `bench throughput` on the tiny model; its result record and each generate call's adapters."""
    from tokenmill.bench import throughput
    from tokenmill.engine.llm import LLM

    calls: list = []
    generate = LLM.generate

    def spy(self, prompts, params=None, **kwargs):  # noqa: ANN001, ANN202
        calls.append(kwargs.get("lora_request"))
        return generate(self, prompts, params, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    argv = ["bench", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu", "--max-model-len", "64",
            "--num-prompts", "7", "--input-len", "4", "--output-len", "5", "--result-dir", str(out),
            "--result-name", "run", *extra]  # fmt: skip
    args = build_parser().parse_args(argv)
    metrics = throughput.main(args)
    record = json.loads((out / "run.json").read_text())
    assert record["metrics"]["output_tokens"] == metrics["output_tokens"] == 7 * 5
    return record, calls


def test_bench_throughput_spreads_prompts_over_the_adapters(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lora_dir = tmp_path / "adapters"
    record, calls = _bench(
        tiny_llama_dir, tmp_path, monkeypatch, "--lora-adapters", "3", "--lora-rank", "4", "--max-loras", "2",
        "--lora-targets", "q_proj,v_proj,down_proj", "--lora-dir", str(lora_dir),
    )  # fmt: skip
    config = record["config"]
    assert config["lora"] == {
        "adapters": 3, "rank": 4, "targets": ["q_proj", "v_proj", "down_proj"], "slots": 2, "host_adapters": 3,
        "base_only": False, "dtype": "bfloat16", "spread": "round-robin",
    }  # fmt: skip
    assert config["engine_config"]["lora"] == {"max_loras": 2, "max_lora_rank": 4, "max_cpu_loras": 3}
    assert config["enable_lora"] is True
    warmup, timed = calls
    assert [r.lora_name for r in timed] == ["lora-000", "lora-001", "lora-002"] * 2 + ["lora-000"]
    assert [r.lora_int_id for r in timed[:3]] == [1, 2, 3]
    assert len(warmup) == 7  # every adapter met before the timing
    # all three in host memory before the timed run; two slots for three adapters: swaps
    assert record["metrics"]["lora"]["host_loads"] == 0
    assert record["metrics"]["lora"]["slot_loads"] >= 1
    assert sorted(p.name for p in lora_dir.iterdir()) == ["lora-000", "lora-001", "lora-002"]  # --lora-dir kept


def test_bench_throughput_base_only_and_off(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record, calls = _bench(tiny_llama_dir, tmp_path, monkeypatch, "--lora-adapters", "2", "--lora-base-only")
    assert record["config"]["lora"]["base_only"] is True and record["config"]["lora"]["slots"] == 2
    assert record["config"]["engine_config"]["lora"]["max_loras"] == 2
    assert calls == [None, None]  # every request on the base model
    assert record["metrics"]["lora"] == {"host_loads": 0, "slot_loads": 0}

    record, calls = _bench(tiny_llama_dir, tmp_path, monkeypatch)
    assert "lora" not in record["config"] and "lora" not in record["metrics"]
    assert record["config"]["engine_config"]["lora"] is None and calls == [None, None]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora-base-only"], "needs --lora-adapters"),
        (["--lora-adapters", "2", "--lora-rank", "32", "--max-lora-rank", "16"], "below --lora-rank"),
        (["--lora-adapters", "4", "--max-cpu-loras", "2"], "--max-cpu-loras 2 < --lora-adapters 4"),
        (["--lora-adapters", "2", "--baseline", "hf-generate"], "without --lora-adapters"),
        (["--lora-adapters", "-1"], ">= 0"),
    ],
)
def test_contradictory_lora_options_are_refused(extra: list[str], message: str) -> None:
    args = build_parser().parse_args(["bench", "throughput", *extra])
    with pytest.raises(ValueError, match=message):
        lora_workload.resolve(args)


def test_lora_options_fill_the_engine_options() -> None:
    args = build_parser().parse_args(["bench", "throughput", "--lora-adapters", "32", "--lora-rank", "64"])
    workload = lora_workload.resolve(args)
    assert workload is not None and workload.targets == ALL_TARGETS
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 8, 64, 32)
    off = build_parser().parse_args(["bench", "throughput"])
    assert lora_workload.resolve(off) is None
    assert (off.enable_lora, off.max_loras, off.max_lora_rank, off.max_cpu_loras) == (False, 1, 16, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--lora-targets", "q_proj,embed_tokens"])


@pytest.mark.parametrize(
    ("extra", "slots", "max_rank"),
    [
        (["--lora-adapters", "4", "--lora-rank", "8"], 4, 8),  # slots min(N, 8); slot width = the rank
        (["--lora-adapters", "4", "--max-loras", "1"], 1, 16),  # an explicit 1 is not the default 1
        (["--lora-adapters", "4", "--lora-rank", "8", "--max-lora-rank", "16"], 4, 16),  # rank 8 in rank-16 slots
    ],
)
def test_explicit_engine_lora_options_win_over_the_workload_defaults(extra: list[str], slots: int, max_rank: int) -> None:
    args = build_parser().parse_args(["bench", "throughput", *extra])
    workload = lora_workload.resolve(args)
    assert workload is not None and workload.slots == slots
    assert (args.max_loras, args.max_lora_rank) == (slots, max_rank)
    assert type(args.max_loras) is int and type(args.max_lora_rank) is int


def test_lora_gpu_script_answers_help_and_refuses_unknown_arguments() -> None:
    script = ROOT / "benchmarks" / "lora_gpu.sh"
    done = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stdout + done.stderr
    assert "--only main,rank,count" in done.stdout
    for wrong, message in ((["--only", "ranks"], "unknown part 'ranks'"), (["--port"], "unknown argument --port")):
        bad = subprocess.run(["bash", str(script), *wrong], capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
