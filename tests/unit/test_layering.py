"""The package order holds: no module imports a package above its own, and core/ stays torch-free.

Low to high (issue 13, "Layout"; README.md): the small top-level modules < core < kernels <
attention < model < sample < worker < engine < server, bench < cli. Every import counts, at module
level or inside a function or an `if TYPE_CHECKING:` block: a lazy import still ties the lower
package to the higher one. The scan reads the source (AST), so it needs neither torch nor triton.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tokenmill

SRC = Path(tokenmill.__file__).parent

# One set of top-level names (a package or a module of src/tokenmill) per tier, low to high.
# Imports within a tier or downward are fine.
TIERS: list[set[str]] = [
    # Options, user-facing params and results, and small helpers that depend on nothing of ours
    # above them. `tokenmill` is the root package (its lazy `tokenmill.LLM` is allowed below).
    # args / arg_parser / envs arrive with the engine-options change of issue 13.
    {
        "tokenmill",
        "errors",
        "config",
        "args",
        "arg_parser",
        "envs",
        "sampling_params",
        "outputs",
        "device",
        "gpu_capability",  # what the GPU can run (torch's CUDA queries), checked at load
        "paths",
        "cpu_cores",
        "chat_template",
        "metrics",
        "metrics_multiprocess",
        "metrics_info",
        "shared_histogram",
        "stats_histogram",
        "slo",  # latency targets: the arguments, the scheduler's slo policy and the server read them
        "slo_metrics",
        # Speculative decoding's torch-free parts (its config, the n-gram proposer, the draft
        # policy, its counters): the scheduler in core/ and the arguments use them.
        "spec_decode",
        # Multi-LoRA's torch-free parts (LoRARequest, which requests and the step contract carry, and
        # the adapter-file checks the API server runs).
        "lora",
    },
    {"core"},
    # The dashboard (torch-free, FastAPI): the server and the router mount it.
    {"dashboard"},
    # The router (torch-free, nothing of the engine): data parallelism (engine/) reuses its policy.
    {"router"},
    # torch.distributed's group and collectives: the sharded layers (model) and the workers use them.
    {"kernels", "distributed"},
    {"attention"},
    {"model"},
    {"sample"},
    {"worker"},
    {"engine"},
    {"server", "bench", "quality", "plan"},
    {"cli"},  # the entry point: dispatches to the server and the benchmarks
]

# Upward imports that stay for now, each with why. Keys are "importing module -> imported module".
ALLOWED_UPWARD: dict[str, str] = {
    # The public facade: `tokenmill.LLM` is resolved lazily (module __getattr__), so that importing
    # tokenmill imports no torch.
    "tokenmill -> tokenmill.engine.llm": "lazy public facade",
}

TIER_OF = {name: rank for rank, names in enumerate(TIERS) for name in names}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. tokenmill.model.registry
    target: str  # the imported module, e.g. tokenmill.device
    line: int


def module_name(path: Path, root: Path = SRC) -> str:
    """src/tokenmill/model/registry.py -> tokenmill.model.registry (root: the tokenmill directory)."""
    parts = ["tokenmill", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = SRC) -> list[Import]:
    """Every import statement in the file, relative ones resolved to absolute names."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                target = ".".join(
                    parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
                )
            else:
                target = node.module or ""
            if target == "tokenmill":  # `from tokenmill import engine`: the names say which package
                found += [Import(module, f"tokenmill.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append(Import(module, target, node.lineno))
    return found


def all_imports() -> list[Import]:
    return [imp for path in sorted(SRC.rglob("*.py")) for imp in imports_of(path)]


def top_level(module: str) -> str:
    """tokenmill.model.layers.linear -> model; tokenmill -> tokenmill."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def is_ours(module: str) -> bool:
    return module == "tokenmill" or module.startswith("tokenmill.")


def test_every_top_level_package_and_module_has_a_tier() -> None:
    names = {top_level(module_name(path)) for path in SRC.rglob("*.py")}
    unranked = sorted(names - TIER_OF.keys())
    assert not unranked, f"place these in TIERS (tests/unit/test_layering.py): {unranked}"


def test_no_import_goes_up_the_package_order() -> None:
    offenders = []
    for imp in all_imports():
        if not is_ours(imp.target):
            continue
        source, target = top_level(imp.module), top_level(imp.target)
        if TIER_OF.get(target, -1) > TIER_OF.get(source, -1):
            edge = f"{imp.module} -> {imp.target}"
            if edge not in ALLOWED_UPWARD:
                offenders.append(f"{edge}  (line {imp.line})")
    assert not offenders, "imports going up the package order:\n" + "\n".join(sorted(offenders))


def test_the_scan_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The scanner itself: function-level and TYPE_CHECKING imports count, relative ones resolve."""
    root = tmp_path / "tokenmill"
    (root / "model").mkdir(parents=True)
    source = root / "model" / "thing.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import arch\n"
        "from ..engine import llm\n"
        "from tokenmill import worker\n"
        "if TYPE_CHECKING:\n    from tokenmill.engine.llm import LLM\n"
        "def f():\n    import tokenmill.worker.device\n"
    )
    assert [imp.target for imp in imports_of(source, root)] == [
        "typing",
        "tokenmill.model",
        "tokenmill.engine",
        "tokenmill.worker",
        "tokenmill.engine.llm",
        "tokenmill.worker.device",
    ]


def test_core_imports_no_torch() -> None:
    offenders = [
        f"{imp.module} -> {imp.target}  (line {imp.line})"
        for path in sorted((SRC / "core").rglob("*.py"))
        for imp in imports_of(path)
        if imp.target.split(".")[0] in ("torch", "triton")
    ]
    assert not offenders, "core/ must stay pure Python:\n" + "\n".join(offenders)


def test_importing_core_loads_no_torch() -> None:
    """The transitive check: what core imports (config, sampling_params, ...) must not pull torch in."""
    modules = sorted(module_name(path) for path in (SRC / "core").rglob("*.py"))
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n    importlib.import_module(name)\n"
        "loaded = sorted(m for m in ('torch', 'triton') if m in sys.modules)\n"
        "assert not loaded, f'importing core loaded {loaded}'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
