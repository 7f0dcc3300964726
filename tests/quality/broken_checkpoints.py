"""Deliberately broken copies of checkpoints, for the quality gate to catch.

- `write_wrong_scale_gguf`: a copy of a GGUF file whose Q4_1 blocks of the named tensors have their
  scale `d` multiplied by a factor, as a quantizer that wrote the wrong scales would leave them (the
  engine reads them both through the dequantized float weights and, for small batches, straight
  from the blocks).
- `write_noisy_copy`: a copy of a tiny HF checkpoint with Gaussian noise added to its matmul
  weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenmill.model.loader.gguf_file import GGUFFile

# Q4_1 block: float16 scale d, float16 minimum m, 16 bytes of 4-bit values (32 weights).
_Q4_1_BLOCK_BYTES = 20


def write_wrong_scale_gguf(source: Path, target: Path, tensor_suffix: str, factor: float) -> Path:
    """Copy `source` to `target`, scaling d in every Q4_1 tensor whose name ends with
    `tensor_suffix` (e.g. "ffn_down.weight") by `factor`. Returns `target`."""
    shutil.copyfile(source, target)
    tensors = [t for t in GGUFFile(target).tensors if t.name.endswith(tensor_suffix)]
    if not tensors:
        raise ValueError(f"no tensor of {source} ends with {tensor_suffix!r}")
    data = np.memmap(target, dtype=np.uint8, mode="r+")
    for tensor in tensors:
        if tensor.ggml_type != GGMLQuantizationType.Q4_1:
            raise ValueError(f"{tensor.name} is {GGMLQuantizationType(tensor.ggml_type).name}, not Q4_1")
        blocks = data[tensor.offset : tensor.offset + tensor.num_bytes].reshape(-1, _Q4_1_BLOCK_BYTES)
        scales = blocks[:, :2].copy().view(np.float16)
        blocks[:, :2] = (scales * np.float16(factor)).view(np.uint8)
    data.flush()
    return target


def write_noisy_copy(source: Path, target: Path, relative_noise: float, seed: int = 0) -> Path:
    """Copy the HF checkpoint `source` to `target` with noise of `relative_noise` times each 2-D
    matmul weight's standard deviation added (embeddings and lm_head kept)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    gen = torch.Generator().manual_seed(seed)
    for path in sorted(target.glob("*.safetensors")):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.dim() == 2 and "embed" not in name and "lm_head" not in name:
                noise = torch.randn(tensor.shape, generator=gen) * tensor.float().std() * relative_noise
                tensors[name] = (tensor.float() + noise).to(tensor.dtype).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    return target
