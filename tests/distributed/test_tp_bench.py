"""`bench latency` and `bench throughput` at tensor_parallel_size=2 (gloo, two worker processes):
the roofline's bytes come from both ranks through the executor (describe_runners), and equal the
one-process engine's on the same checkpoint (an MHA model: no replicated KV heads; the rank-local
norms are the only bytes both ranks read)."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.distributed.conftest import SMALL_ENGINE
from tokenmill import LLM
from tokenmill.bench import latency, throughput


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


def _common(path: str, tmp_path, name: str) -> list[str]:
    return [
        "--model", path, "--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "64",
        "--tensor-parallel-size", "2", "--result-dir", str(tmp_path), "--result-name", name,
    ]  # fmt: skip


def test_latency_and_throughput_at_tp2(tp_qwen2_dir, tmp_path):
    path = str(tp_qwen2_dir)
    latency.main(
        _args(
            latency,
            [*_common(path, tmp_path, "lat"), "--input-len", "16", "--output-len", "4", "--num-iters", "1"],
        )
    )
    record = json.loads((tmp_path / "lat.json").read_text())
    metrics = record["metrics"]
    assert record["config"]["tensor_parallel_size"] == 2 and metrics["tensor_parallel_size"] == 2
    assert len(metrics["per_rank_weight_bytes"]) == 2
    assert metrics["decode_tokens_per_s"] > 0 and metrics["roofline_fraction"] > 0
    assert metrics["roofline_tokens_per_s"] == pytest.approx(
        metrics["copy_bandwidth_bytes_per_s"] / (metrics["weight_bytes"] + metrics["mean_kv_bytes_per_step"])
    )

    # The same checkpoint in one process: the ranks' shards add up to the whole model, but for the
    # norms both ranks hold (and the vocabulary's padding row on the last rank).
    one = LLM(path, **SMALL_ENGINE)
    try:
        whole_weights, whole_kv = latency.decode_bytes_per_step(one, 16, 4)
        norms = sum(
            p.numel() * p.element_size() for n, p in one.engine.runner.model.named_parameters() if "norm" in n
        )
        hidden = one.resolved.arch.hidden_size
    finally:
        one.shutdown()
    assert metrics["mean_kv_bytes_per_step"] == pytest.approx(whole_kv)
    # One fp32 lm_head padding row on rank 1 (vocab 1001 over 2 ranks), where the lm_head is a
    # parameter (the CPU's packed matmul weights are not, on one rank as on two).
    padding = 4 * hidden
    assert whole_weights + norms <= metrics["weight_bytes"] <= whole_weights + norms + padding

    throughput.main(
        _args(
            throughput,
            [
                *_common(path, tmp_path, "tput"),
                "--num-prompts",
                "4",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--no-warmup",
            ],
        )
    )
    tput = json.loads((tmp_path / "tput.json").read_text())
    assert tput["config"]["tensor_parallel_size"] == 2
    assert tput["metrics"]["output_tokens"] == 16
    assert tput["metrics"]["output_tokens_per_s_per_device"] == pytest.approx(
        tput["metrics"]["output_tokens_per_s"] / 2
    )
