"""PyTorch `.bin` checkpoints: loaded only through torch.load(weights_only=True), safetensors
preferred when both are there, and anything holding more than tensors refused naming the file.

transformers 5 writes only safetensors (`save_pretrained` lost `safe_serialization=False`), so the
.bin files here are written as transformers 4 wrote them: `torch.save` of the state dict, one
`pytorch_model.bin`, or shards `pytorch_model-0000i-of-0000n.bin` with `pytorch_model.bin.index.json`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import ModelConfig
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.loader.pt_loader import load_tensor_file
from tokenmill.model.registry import load_model, resolve_model


def save_as_pytorch_bin(source: Path, target: Path, *, shards: int = 1, keep_safetensors: bool = False) -> Path:
    """`source` (an HF directory with model.safetensors) with its weights as .bin file(s)."""
    shutil.copytree(source, target, ignore=None if keep_safetensors else shutil.ignore_patterns("*.safetensors"))
    state = load_file(str(source / "model.safetensors"))
    if shards == 1:
        torch.save(state, target / "pytorch_model.bin")
        return target
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {name: state[name] for name in names[i::shards]}
        torch.save(part, target / file)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return target


def _load(model_dir: Path, **config):
    model_config = ModelConfig(model=str(model_dir), **config)
    resolved = resolve_model(model_config)
    arch = resolved.arch
    backend = TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5, 16)
    return resolved, load_model(model_config, arch, "cpu", torch.float32, backend, resolved=resolved)


def test_a_sharded_bin_checkpoint_loads_exactly_like_its_safetensors(tmp_path, tiny_qwen3_dir):
    bin_dir = save_as_pytorch_bin(tiny_qwen3_dir, tmp_path / "bin", shards=3)
    assert len(list(bin_dir.glob("pytorch_model-*-of-00003.bin"))) == 3
    resolved, from_bin = _load(bin_dir)
    assert resolved.format == "pt"
    _, from_safetensors = _load(tiny_qwen3_dir)
    theirs = dict(from_safetensors.named_parameters())
    for name, param in from_bin.named_parameters():
        torch.testing.assert_close(param, theirs[name], atol=0, rtol=0, msg=name)


def test_a_bin_checkpoint_generates_what_transformers_does(tmp_path, tiny_llama_dir):
    bin_dir = save_as_pytorch_bin(tiny_llama_dir, tmp_path / "bin")
    llm = LLM(str(bin_dir), device="cpu", max_model_len=64, num_kv_blocks=16)
    prompt = [5, 17, 99, 3, 250, 41]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(str(tiny_llama_dir), prompt, 8)[0]


def test_safetensors_win_when_both_are_there_and_load_format_pt_picks_the_bin(tmp_path, tiny_llama_dir):
    both = save_as_pytorch_bin(tiny_llama_dir, tmp_path / "both", keep_safetensors=True)
    assert resolve_model(ModelConfig(model=str(both))).format == "safetensors"
    assert resolve_model(ModelConfig(model=str(both), load_format="pt")).format == "pt"
    with pytest.raises(FileNotFoundError, match=r"no pytorch_model\*.bin weights in"):
        resolve_model(ModelConfig(model=str(tiny_llama_dir), load_format="pt"))


def test_the_legacy_non_zip_format_loads_too(tmp_path):
    file = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.arange(6.0)}, file, _use_new_zipfile_serialization=False)
    torch.testing.assert_close(load_tensor_file(file)["w"], torch.arange(6.0))


class _RunsCodeWhenUnpickled:
    """What a malicious checkpoint carries: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_bin_holding_a_pickled_object_is_refused_and_nothing_runs(tmp_path, tiny_llama_dir):
    bin_dir = save_as_pytorch_bin(tiny_llama_dir, tmp_path / "bin")
    marker = tmp_path / "code-ran"
    state = torch.load(bin_dir / "pytorch_model.bin", weights_only=True)
    state["payload"] = _RunsCodeWhenUnpickled(marker)
    torch.save(state, bin_dir / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError) as err:
        _load(bin_dir)
    message = str(err.value)
    assert f"refused to load {bin_dir / 'pytorch_model.bin'}" in message
    assert "loads only tensor checkpoints" in message and "posix.mkdir" in message, message
    assert "weights_only=False" not in message  # torch's advice to load it unsafely is not passed on
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({"w": torch.zeros(2), "step": 7}, "its entry 'step' is a int, not a tensor"),
        ([torch.zeros(2)], "it holds a list, not a state dict"),
    ],
)
def test_a_bin_holding_more_than_named_tensors_is_refused(tmp_path, content, expected):
    file = tmp_path / "pytorch_model.bin"
    torch.save(content, file)
    with pytest.raises(UnsupportedModelError, match=expected):
        load_tensor_file(file)
