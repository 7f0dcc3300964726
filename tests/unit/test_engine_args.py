"""EngineArgs is the one source of the engine's options: every field is a CLI flag with help, the
CLI, `LLM(...)` keywords and a YAML config file give the same EngineConfig, and bad names are
refused naming them. Also the TOKENMILL_* registry (envs.py)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from tokenmill import envs
from tokenmill.args import EngineArgs
from tokenmill.bench.results import engine_options, write_result
from tokenmill.cli import build_parser
from tokenmill.config import KernelConfig
from tokenmill.engine.llm import build_engine_config

COMMANDS = (["serve"], ["generate", "hi"], ["chat"], ["bench", "throughput"], ["bench", "latency"])
KERNEL_ENV = (
    "TOKENMILL_ROW_GEMV",
    "TOKENMILL_SKINNY_GEMM",
    "TOKENMILL_FUSED_DECODE_ROPE",
    "TOKENMILL_DEFERRED_NORM",
)

# The same options three ways: flags, LLM(...) keywords and a YAML file.
CLI = [
    "--model", "/models/m", "--max-num-seqs", "8", "--max-num-batched-tokens", "300",
    "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching", "--load-format", "dummy",
    "--dtype", "bfloat16", "--seed", "5", "--kv-cache-dtype", "float16", "--enforce-eager",
    "--no-cpu-weight-packing", "--kernel-config", '{"row_gemv": false, "min_kv_tokens_per_split": 64}',
    "--served-model-name", "a, b", "--scheduling-policy", "priority",
]  # fmt: skip
KWARGS = dict(
    model="/models/m", max_num_seqs=8, max_num_batched_tokens=300, kv_cache_memory=2**30,
    enable_prefix_caching=False, load_format="dummy", dtype="bfloat16", seed=5, kv_cache_dtype="float16",
    enforce_eager=True, cpu_weight_packing=False, kernel_config={"row_gemv": False, "min_kv_tokens_per_split": 64},
    served_model_name="a, b", scheduling_policy="priority",
)  # fmt: skip
YAML = """
model: /models/m
max-num-seqs: 8
max_num_batched_tokens: 300
kv-cache-memory: 1GiB
enable-prefix-caching: false
load-format: dummy
dtype: bfloat16
seed: 5
kv-cache-dtype: float16
enforce-eager: true
cpu-weight-packing: false
kernel-config: {row_gemv: false, min_kv_tokens_per_split: 64}
served-model-name: a, b
scheduling-policy: priority
"""


@pytest.fixture(autouse=True)
def no_kernel_env(monkeypatch):
    for name in KERNEL_ENV:
        monkeypatch.delenv(name, raising=False)


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


def config_from_cli(command: list[str], argv: list[str]):
    return EngineArgs.from_cli_args(parse([*command, "--device", "cpu", *argv])).create_engine_config()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_field_is_a_flag_with_help_on_every_command(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command[0]]  # type: ignore[union-attr]
    if command[0] == "bench":
        sub = sub._subparsers._group_actions[0].choices[command[1]]  # type: ignore[union-attr]
    actions = {s: a for a in sub._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineArgs):
        action = actions.get("--" + f.name.replace("_", "-"))
        assert action is not None, f"{' '.join(command)} has no flag for {f.name}"
        assert action.help and action.help.strip(), f"--{f.name} has no help"
        assert action.dest == f.name and action.default == f.default
    assert "--config" in actions
    args = parse([*command, "--device", "cpu"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(device="cpu")


def test_every_flag_of_every_command_has_help():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    bench = commands["bench"]._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    parsers = {"tokenmill": parser, **commands, "bench throughput": bench["throughput"]}
    parsers["bench latency"] = bench["latency"]
    parsers["bench serve"] = bench["serve"]
    missing = [
        f"{name} {action.option_strings[0]}"
        for name, sub in parsers.items()
        for action in sub._actions
        if action.option_strings and not (action.help or "").strip()
    ]
    assert missing == []


def test_cli_llm_kwargs_and_yaml_give_the_same_config(tmp_path):
    from_cli = config_from_cli(["generate", "hi"], CLI)
    from_kwargs = build_engine_config(device="cpu", **KWARGS)
    path = tmp_path / "engine.yaml"
    path.write_text(YAML)
    for command in COMMANDS:
        assert config_from_cli(command, ["--config", str(path)]) == from_cli, command
    assert from_cli == from_kwargs
    assert from_cli.model.served_model_name == "a"  # the server answers to both; the model's own is "a"
    assert from_cli.cache.kv_cache_dtype == "float16" and from_cli.cache.kv_cache_memory == 2**30
    assert from_cli.kernel == KernelConfig(
        row_gemv=False, skinny_gemm=False, min_kv_tokens_per_split=64, cpu_weight_packing=False
    )


def test_flags_on_the_command_line_override_the_config_file(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("max-num-seqs: 8\nenable_prefix_caching: false\nblock-size: 32\n")
    for argv in (
        ["--max-num-seqs", "3", "--config", str(path), "--enable-prefix-caching"],
        [f"--config={path}", "--max-num-seqs", "3", "--enable-prefix-caching"],
    ):
        args = parse(["serve", "--device", "cpu", *argv])
        config = EngineArgs.from_cli_args(args).create_engine_config()
        assert config.scheduler.max_num_seqs == 3 and config.cache.enable_prefix_caching
        assert config.cache.block_size == 32 and args.config == str(path)
    # A serve file may hold server flags too.
    path.write_text("port: 8123\nmax-n: 4\n")
    args = parse(["serve", "--config", str(path)])
    assert (args.port, args.max_n) == (8123, 4)


def test_an_unknown_config_file_key_is_an_error_naming_it_and_the_file(tmp_path, capsys):
    path = tmp_path / "engine.yaml"
    path.write_text("max-num-seq: 8\n")
    with pytest.raises(SystemExit) as exit_info:
        parse(["generate", "hi", "--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'max-num-seq'" in err and str(path) in err and "max-num-seqs" in err, err
    path.write_text("max-num-seqs: lots\n")  # values go through the flag's own parsing
    with pytest.raises(SystemExit):
        parse(["generate", "hi", "--config", str(path)])
    assert "--max-num-seqs" in capsys.readouterr().err


def test_an_unknown_keyword_is_an_error_naming_it_and_close_names():
    with pytest.raises(TypeError, match=r"'max_num_seq'.*did you mean max_num_seqs"):
        build_engine_config(device="cpu", max_num_seq=8)


def test_kernel_config_keys_and_values_are_checked(capsys):
    with pytest.raises(ValueError, match=r"unknown kernel_config key 'row_gemm'.*row_gemv.*valid keys"):
        build_engine_config(device="cpu", kernel_config={"row_gemm": False})
    with pytest.raises(
        ValueError, match=r"'cpu_weight_packing' has an option of its own: --cpu-weight-packing"
    ):
        build_engine_config(device="cpu", kernel_config={"cpu_weight_packing": False})
    with pytest.raises(ValueError, match=r"'row_gemv' must be a bool, got 0"):
        build_engine_config(device="cpu", kernel_config={"row_gemv": 0})
    with pytest.raises(SystemExit):
        parse(["generate", "hi", "--kernel-config", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_cpu_activation_bits_are_0_8_or_16():
    assert build_engine_config(device="cpu").kernel.cpu_activation_bits == 16
    assert build_engine_config(device="cpu", kernel_config={"cpu_activation_bits": 8}).kernel.cpu_activation_bits == 8
    with pytest.raises(ValueError, match=r"'cpu_activation_bits' must be 0 \(float32\), 8 or 16, got 4"):
        build_engine_config(device="cpu", kernel_config={"cpu_activation_bits": 4})


def test_fp8_kv_cache_is_parsed_and_e5m2_refused_naming_the_supported_values():
    for value in ("fp8", "fp8_e4m3"):
        args = parse(["generate", "hi", "--device", "cpu", "--kv-cache-dtype", value])
        assert EngineArgs.from_cli_args(args).create_engine_config().cache.kv_cache_dtype == value
    args = parse(["generate", "hi", "--device", "cpu", "--kv-cache-dtype", "fp8_e5m2"])
    with pytest.raises(ValueError, match=r"'fp8_e5m2' is not supported .*use fp8 \(e4m3\) or one of auto, float32"):
        EngineArgs.from_cli_args(args).create_engine_config()
    assert build_engine_config(device="cpu").cache.kv_cache_dtype == "auto"


def test_kernel_env_variables_are_the_kernel_config_defaults(monkeypatch):
    assert build_engine_config(device="cpu").kernel == KernelConfig()
    monkeypatch.setenv("TOKENMILL_DEFERRED_NORM", "0")
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE_ROPE", "false")
    kernel = build_engine_config(device="cpu").kernel
    assert not kernel.deferred_norm and not kernel.fused_decode_rope and kernel.row_gemv
    # --kernel-config wins over the environment.
    assert build_engine_config(device="cpu", kernel_config={"deferred_norm": True}).kernel.deferred_norm
    # No row GEMV: skinny GEMM is off too (it needs row GEMV's out-major weights).
    monkeypatch.setenv("TOKENMILL_ROW_GEMV", "0")
    kernel = build_engine_config(device="cpu").kernel
    assert not kernel.row_gemv and not kernel.skinny_gemm
    monkeypatch.setenv("TOKENMILL_ROW_GEMV", "maybe")
    with pytest.raises(ValueError, match="TOKENMILL_ROW_GEMV='maybe' is not a valid bool"):
        build_engine_config(device="cpu")


def test_env_registry_types_defaults_and_description(monkeypatch):
    assert set(KERNEL_ENV) | {"TOKENMILL_CACHE", "TOKENMILL_API_KEY", "TOKENMILL_COMMIT"} <= set(
        envs.REGISTRY
    )
    for name in ("TOKENMILL_CACHE", "TOKENMILL_API_KEY", "TOKENMILL_COMMIT", "TOKENMILL_FUZZ_EXAMPLES"):
        monkeypatch.delenv(name, raising=False)
        assert envs.REGISTRY[name].get() is None
    for raw, value in (("1", True), ("0", False), ("true", True), ("False", False), ("", None)):
        monkeypatch.setenv("TOKENMILL_ROW_GEMV", raw)
        assert envs.TOKENMILL_ROW_GEMV.get() is value  # read at use time, not at import
    monkeypatch.setenv("TOKENMILL_FUZZ_EXAMPLES", "12")
    assert envs.TOKENMILL_FUZZ_EXAMPLES.get() == 12
    monkeypatch.setenv("TOKENMILL_FUZZ_EXAMPLES", "many")
    with pytest.raises(ValueError, match="TOKENMILL_FUZZ_EXAMPLES='many' is not a valid int"):
        envs.TOKENMILL_FUZZ_EXAMPLES.get()
    monkeypatch.setenv("TOKENMILL_CACHE", "/tmp/tm")
    assert envs.TOKENMILL_CACHE.get() == "/tmp/tm"
    description = envs.describe().splitlines()
    assert len(description) == len(envs.REGISTRY)
    assert any(line.startswith("* TOKENMILL_CACHE (string") for line in description)


def test_step_budget_default_depends_on_the_device(monkeypatch):
    import tokenmill.device as device

    config = build_engine_config(device="cpu")
    assert config.scheduler.max_num_batched_tokens == 512 and config.async_scheduling is False
    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cuda"))
    config = build_engine_config(device="cuda")
    assert config.device == "cuda" and config.scheduler.max_num_batched_tokens == 8192
    assert config.async_scheduling is True  # on for CUDA unless asked otherwise
    assert build_engine_config(device="cuda", async_scheduling=False).async_scheduling is False
    assert (
        build_engine_config(device="cuda", max_num_batched_tokens=100).scheduler.max_num_batched_tokens == 100
    )


def test_start_up_log_lists_every_non_default_option_and_the_kernel_paths(caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.args"):
        build_engine_config(device="cpu", max_num_seqs=8, enable_prefix_caching=False)
    (record,) = [r for r in caplog.records if r.name == "tokenmill.args"]
    message = record.getMessage()
    assert record.levelno == logging.INFO
    assert "max_num_seqs=8" in message and "enable_prefix_caching=False" in message
    assert "device='cpu'" in message and "block_size" not in message.split(";")[0]  # defaults left out
    assert "max_num_batched_tokens=512, async_scheduling=False" in message  # the resolved defaults
    assert "row_gemv=True" in message and "cpu_quantized_gemv=True" in message


def test_a_benchmark_result_records_the_engine_config_and_its_kernel_paths(tmp_path):
    args = parse(["bench", "throughput", "--device", "cpu", "--kernel-config", '{"deferred_norm": false}'])
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    path = write_result("throughput", {"num_prompts": 1, **engine_options(engine_args, config)}, {}, tmp_path)
    recorded = json.loads(path.read_text())["config"]
    assert recorded["max_num_seqs"] == 256 and "model" not in recorded  # the options, flat, as before
    kernel = recorded["engine_config"]["kernel"]
    assert kernel == dataclasses.asdict(config.kernel) and kernel["deferred_norm"] is False
    assert set(kernel) == {f.name for f in dataclasses.fields(KernelConfig)}
    assert recorded["engine_config"]["scheduler"]["max_num_batched_tokens"] == 512


def test_tokenmill_variables_are_read_only_through_the_registry():
    import re
    from pathlib import Path

    import tokenmill

    root = Path(tokenmill.__file__).parent
    direct = re.compile(r"""(environ\.get|environ\[|getenv)\(?\s*["']TOKENMILL_""")
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "envs.py" and direct.search(path.read_text())
    ]
    assert offenders == []
    named = set(re.findall(r"TOKENMILL_[A-Z_]+[A-Z]", "".join(p.read_text() for p in root.rglob("*.py"))))
    assert named <= set(envs.REGISTRY), named - set(envs.REGISTRY)


def test_bench_throughput_from_a_config_file_writes_the_engine_config(tiny_llama_dir, tmp_path):
    from tokenmill.bench import throughput

    path = tmp_path / "bench.yaml"
    path.write_text(
        f"model: {tiny_llama_dir}\ndevice: cpu\nattention-backend: torch\nmax-model-len: 64\n"
        "num-prompts: 2\ninput-len: 4\noutput-len: 2\nwarmup: false\n"
        'kernel-config: {"fused_decode_rope": false}\n'
    )
    args = parse(["bench", "throughput", "--config", str(path), "--result-dir", str(tmp_path / "out")])
    throughput.main(args)
    (result,) = (tmp_path / "out").glob("throughput-*.json")
    config = json.loads(result.read_text())["config"]
    assert config["model"] == str(tiny_llama_dir) and config["num_prompts"] == 2
    assert config["engine_config"]["kernel"]["fused_decode_rope"] is False
    assert config["engine_config"]["model"]["max_model_len"] == 64
