"""FP8 weights and an FP8 KV cache on a GPU older than compute capability 8.9 are refused at load,
naming the GPU and what would run (gpu_capability.py, through select_linear_method and the model
runner's KV dtype check); 4-bit weights and the auto cache are not. The CUDA
queries are stubbed: the check runs before anything touches the device."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import KernelConfig
from tokenmill.model.layers.linear_select import select_linear_method
from tokenmill.model.loader.quant_config import resolve_quantization


@pytest.fixture
def gpu_of_capability(monkeypatch):
    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")

    return set_capability


def _select(method: str):
    spec = resolve_quantization({"architectures": ["LlamaForCausalLM"]}, method, "m")
    return select_linear_method("cuda", torch.bfloat16, KernelConfig(), spec)


def test_fp8_weights_are_refused_below_compute_capability_8_9(gpu_of_capability):
    gpu_of_capability(8, 0)
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer.*Test GPU\) is 8\.0.*4-bit"):
        _select("fp8")


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_weights_pass_the_check_from_8_9(gpu_of_capability, capability):
    from tokenmill.model.layers.fp8_linear import Fp8LinearMethod

    gpu_of_capability(*capability)
    assert isinstance(_select("fp8"), Fp8LinearMethod)


def test_4bit_weights_run_on_an_older_gpu(gpu_of_capability):
    from tokenmill.model.layers.int4_linear import Int4LinearMethod

    gpu_of_capability(8, 0)
    assert isinstance(_select("awq"), Int4LinearMethod)


def test_an_fp8_kv_cache_is_refused_below_8_9_and_auto_is_not(gpu_of_capability):
    from tokenmill.kernels.kv_fp8 import FP8_KV_DTYPE
    from tokenmill.worker.kv_cache import check_kv_cache_dtype_on_device, resolve_kv_cache_dtype

    gpu_of_capability(8, 6)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8: .*Test GPU\) is 8\.6.*auto"):
        check_kv_cache_dtype_on_device(resolve_kv_cache_dtype("fp8", torch.bfloat16), cuda)
    check_kv_cache_dtype_on_device(resolve_kv_cache_dtype("auto", torch.bfloat16), cuda)
    gpu_of_capability(9, 0)
    check_kv_cache_dtype_on_device(FP8_KV_DTYPE, cuda)
    check_kv_cache_dtype_on_device(FP8_KV_DTYPE, torch.device("cpu"))  # not CUDA: nothing to check
