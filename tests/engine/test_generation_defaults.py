"""--generation-config: the model's sampling defaults (auto), ignored (vllm), or from a directory;
used by LLM when no SamplingParams are given and by the generate / chat CLI for flags left out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenmill.args import EngineArgs
from tokenmill.cli import _sampling_params
from tokenmill.config import ModelConfig
from tokenmill.engine.llm import LLM
from tokenmill.model.generation_defaults import generation_defaults
from tokenmill.model.loader.default_model import DEFAULT_MODEL_FILE
from tokenmill.model.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "max_tokens": 7}


def _write_generation_config(directory: Path, **fields) -> None:
    path = directory / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(fields)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a generation_config.json that recommends sampling."""
    directory = tmp_path_factory.mktemp("with_gen_config") / "model"
    shutil.copytree(tiny_llama_dir, directory)
    _write_generation_config(directory, temperature=0.6, top_p=0.8, top_k=20, max_new_tokens=7, do_sample=True)
    return directory


def defaults_of(model: Path, generation_config: str = "auto") -> dict:
    config = EngineArgs(model=str(model), generation_config=generation_config).create_engine_config(
        resolve_device=False
    )
    return generation_defaults(config.model, resolve_model(config.model))


def test_auto_reads_the_models_generation_config_and_logs_it(model_with_defaults, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.model.generation_defaults"):
        assert defaults_of(model_with_defaults) == MODEL_DEFAULTS
    assert "generation_config.json" in caplog.text and "--generation-config vllm" in caplog.text


def test_a_generation_config_without_sampling_fields_gives_no_defaults(tiny_llama_dir):
    assert defaults_of(tiny_llama_dir) == {}  # save_pretrained's file: token ids only


def test_vllm_ignores_the_models_generation_config(model_with_defaults):
    assert defaults_of(model_with_defaults, "vllm") == {}


def test_a_directory_is_read_instead_of_the_models(tiny_llama_dir, tmp_path):
    _write_generation_config(tmp_path, top_p=0.5, repetition_penalty=1.1, min_p=0.05, top_k=None)
    assert defaults_of(tiny_llama_dir, str(tmp_path)) == {"top_p": 0.5, "repetition_penalty": 1.1, "min_p": 0.05}


def test_a_directory_without_generation_config_is_a_clear_error(tiny_llama_dir, tmp_path):
    for bad in (tmp_path, tmp_path / "missing"):
        with pytest.raises(ValueError, match="generation_config"):
            defaults_of(tiny_llama_dir, str(bad))
    config = ModelConfig(model=str(tiny_llama_dir), generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(config, resolve_model(ModelConfig(model=str(tiny_llama_dir))))


def test_out_of_range_values_are_dropped(tiny_llama_dir, tmp_path):
    _write_generation_config(tmp_path, temperature=0.7, top_p=0.0, max_new_tokens=0)
    assert defaults_of(tiny_llama_dir, str(tmp_path)) == {"temperature": 0.7}


def test_the_default_model_recommends_its_model_cards_sampling(tiny_llama_dir, tmp_path):
    # The default model's GGUF, faked by name: only its file name tells it apart.
    resolved = resolve_model(ModelConfig(model=str(tiny_llama_dir)))
    fake = dataclasses.replace(
        resolved, path=str(tmp_path / DEFAULT_MODEL_FILE), format="gguf", tokenizer_path=str(tmp_path / DEFAULT_MODEL_FILE)
    )
    assert generation_defaults(ModelConfig(), fake) == {"temperature": 0.2, "top_p": 0.9}
    assert generation_defaults(ModelConfig(generation_config="vllm"), fake) == {}


def test_llm_uses_the_defaults_when_given_no_sampling_params(model_with_defaults):
    llm = LLM(str(model_with_defaults), device="cpu", max_model_len=128)
    assert llm.get_default_sampling_params() == SamplingParams(**MODEL_DEFAULTS)
    prompt = {"prompt_token_ids": [5, 17, 33, 8]}
    [out] = llm.generate(prompt)
    assert 1 <= len(out.outputs[0].token_ids) <= 7
    # Given params are used as they are.
    [out] = llm.generate(prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 9


def test_llm_with_generation_config_vllm_keeps_tokenmills_defaults(model_with_defaults):
    llm = LLM(str(model_with_defaults), device="cpu", max_model_len=128, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()


def _cli_args(**flags) -> argparse.Namespace:
    values = {"max_tokens": None, "temperature": None, "top_p": None, "top_k": None, "sampling_seed": None}
    return argparse.Namespace(**{**values, **flags})


def test_cli_flags_left_out_take_the_models_defaults_then_the_cli_fallbacks():
    model = SimpleNamespace(default_sampling_fields={"temperature": 0.2, "top_p": 0.9})
    params = _sampling_params(_cli_args(), model)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.9, 0, 256)
    params = _sampling_params(_cli_args(temperature=0.0, max_tokens=5, sampling_seed=3), model)
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (0.0, 0.9, 5, 3)
    params = _sampling_params(_cli_args(), SimpleNamespace(default_sampling_fields={}))
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 1.0, 256)


def test_the_module_is_torch_free_for_the_api_server():
    import subprocess
    import sys

    code = "import sys, tokenmill.model.generation_defaults; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
