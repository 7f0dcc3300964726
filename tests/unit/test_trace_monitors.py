"""The step trace's monitors: GC pauses (gc.callbacks) and Triton JIT compiles (Triton's hooks)."""

from __future__ import annotations

import gc
import logging

import pytest

from tokenmill.engine.gc_pauses import GcPauses


def test_gc_pauses_records_a_full_collection():
    pauses = GcPauses()
    try:
        gc.collect()
        recorded = pauses.drain()
        assert any(generation == 2 and seconds >= 0 for _, seconds, generation in recorded)
        assert pauses.drain() == []  # drained
    finally:
        pauses.close()
    gc.collect()
    assert pauses.drain() == []  # closed: no longer a callback


def test_jit_compiles_records_what_triton_reports_and_never_skips_a_compile(caplog):
    knobs = pytest.importorskip("triton").knobs
    from tokenmill.kernels.jit_compiles import JitCompiles

    class Fn:  # what Triton passes as `fn` (its JitFunctionInfo has `.name`)
        name = "_some_kernel"

    compiles = JitCompiles()
    try:
        assert compiles.installed
        # As Triton calls them around a compile (keyword arguments); a true return from the first
        # would make Triton skip the compile.
        hook_args = {"key": ("sig", 16), "repr": "_some_kernel[...]", "fn": Fn(), "is_manual_warmup": False,
                     "already_compiled": False}  # fmt: skip
        assert knobs.runtime.jit_cache_hook(**hook_args, compile={}) is None
        with caplog.at_level(logging.DEBUG, logger="tokenmill.kernels.jit_compiles"):
            knobs.runtime.jit_post_compile_hook(**hook_args, compile={"specialization_data": "{...}"})
            (name, _, seconds), = compiles.drain()
            assert name == "_some_kernel" and seconds >= 0
            # Start-up compiles (warm-up, graph capture) are expected: no warning for them ...
            assert [r.levelno for r in caplog.records] == [logging.DEBUG]
            caplog.clear()
            compiles.start_serving()
            knobs.runtime.jit_cache_hook(**hook_args, compile={})
            knobs.runtime.jit_post_compile_hook(**hook_args, compile={"specialization_data": "{...}"})
            # ... one while serving stalls a step: the operator sees it.
            assert [r.levelno for r in caplog.records] == [logging.WARNING]
            assert "while serving" in caplog.records[0].getMessage()
            assert len(compiles.drain()) == 1
        assert JitCompiles().installed  # a second one takes over the first one's hooks
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
