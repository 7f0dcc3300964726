"""PyTorch pickle checkpoints (`pytorch_model.bin`, or shards listed by `pytorch_model.bin.index.json`),
for models published without safetensors. Safetensors win when a directory has both (resolve.py).

A .bin file is a pickle, and unpickling runs whatever the file says. So these files are read only
with `torch.load(weights_only=True)`, whose unpickler builds tensors, dicts and plain values and
refuses everything else; nothing in them is ever unpickled any other way, and a file that holds more
than tensors is refused naming it. Files in the zip format (every `torch.save` since PyTorch 1.6)
are memory-mapped rather than read whole.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

# The weights-only unpickler's refusal (pickle.UnpicklingError itself, reached without importing
# pickle here: the package imports pickle nowhere, tests/reliability/test_security.py).
from torch._weights_only_unpickler import UnpicklingError

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.loader.hf_config import pytorch_bin_files


def iter_pt_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the directory's pytorch_model*.bin files, on the CPU
    (the model's loader copies each into its parameter, on the model's device)."""
    files = pytorch_bin_files(model_dir)
    if not files:
        raise FileNotFoundError(
            f"no pytorch_model*.bin files in {model_dir}; pass load_format='dummy' to run with random weights"
        )
    for file in files:
        state = load_tensor_file(file)
        yield from state.items()
        del state  # one shard in memory at a time


def load_tensor_file(file: Path) -> dict[str, torch.Tensor]:
    """The {name: tensor} of one .bin file, unpickled only by torch's weights-only unpickler."""
    try:
        state = torch.load(
            str(file), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file)
        )
    except UnpicklingError as exc:
        raise UnsupportedModelError(
            f"refused to load {file}: it holds more than tensors, and tokenmill loads only tensor "
            f"checkpoints from .bin files (torch.load(weights_only=True) refused it: "
            f"{_why_refused(exc)}). Nothing else in it was unpickled; use the model's safetensors "
            "weights, or a pytorch_model.bin holding only its state dict",
            param="model",
        ) from exc
    if not isinstance(state, Mapping):
        raise UnsupportedModelError(
            f"refused to load {file}: it holds a {type(state).__name__}, not a state dict of "
            "{name: tensor}; tokenmill loads only tensor checkpoints from .bin files",
            param="model",
        )
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise UnsupportedModelError(
                f"refused to load {file}: its entry {name!r} is a {type(value).__name__}, not a tensor; "
                "tokenmill loads only tensor checkpoints ({name: tensor}) from .bin files",
                param="model",
            )
    return dict(state)


def _why_refused(exc: BaseException) -> str:
    """The line of torch's message naming what was refused (its first lines are advice to load the
    file unsafely, which is not ours to give)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    naming = [line for line in lines if "global" in line.lower() or "unsupported" in line.lower()]
    return (naming or lines or [type(exc).__name__])[0]
