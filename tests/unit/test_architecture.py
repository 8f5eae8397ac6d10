"""The dependency rules of docs/extending.md ("Dependency rules"), enforced by parsing every
import (ast), function-level imports included: which package may import which, and no import
circles anywhere."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = "megatron_lite"
# package -> packages (second name component under megatron_lite) it must never import
FORBIDDEN = {
    "kernels": "*",  # leaf code: nothing of ours but itself
    "parallel": ("models", "training", "config", "validation", "plan"),
    "pipeline": ("training", "models", "plan"),
    "moe": ("config", "validation", "training", "plan"),
    "context": ("config", "validation", "training", "plan"),
    "models": ("training", "plan"),
    "data": ("models", "plan"),
    # checkpoints are built from config, mesh, chunks, DP wrapper and RNG: no Trainer
    "checkpoint": ("training", "plan"),
    # the planner is a top-level consumer (like train.py): nothing below it imports it
    "training": ("plan",),
    "validation": ("plan",),
}


def module_name(path: str) -> str:
    """Repository path -> import name (`kernels/` is installed as megatron_lite.kernels)."""
    parts = os.path.splitext(path)[0].split("/")
    if parts[0] == "kernels":
        parts = [PKG, *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: str, source: str, modules: set[str]) -> list[tuple[str, int]]:
    """(imported module of ours, line) for every import in `source`, at any nesting depth. For
    `from a import b` the target is a.b when that is a module, else a."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        out += [(t, node.lineno) for t in targets if t == PKG or t.startswith(PKG + ".")]
    return out


def component(module: str) -> str:
    """megatron_lite.parallel.layers -> parallel; megatron_lite.config -> config."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken rule in a tree {repository path: source}, as 'file:line: message'."""
    modules = {module_name(p) for p in sources}
    edges: dict[str, list[tuple[str, str, int]]] = {m: [] for m in modules}
    found = []
    for path, source in sorted(sources.items()):
        src = module_name(path)
        for target, line in imports(path, source, modules):
            if target in modules and target != src:
                edges[src].append((target, path, line))
            rule = FORBIDDEN.get(component(src))
            dst = component(target)
            if rule == "*" and dst != "kernels" or rule != "*" and dst in (rule or ()):
                found.append(f"{path}:{line}: {component(src)}/ must not import {target}")
    return found + [_describe(c) for c in _cycles(edges)]


def _cycles(edges: dict[str, list[tuple[str, str, int]]]) -> list[list[tuple[str, str, int]]]:
    """One cycle (as its edges) for each strongly connected component with more than one module
    (Tarjan's algorithm, iterative enough for a small package)."""
    index, low, stack, on_stack, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_one_cycle(edges, comp) for comp in comps]


def _one_cycle(edges, comp: set[str]) -> list[tuple[str, str, int]]:
    """A path inside `comp` from its first module back to itself."""
    start = min(comp)
    paths = {start: []}
    frontier = [start]
    while frontier:
        v = frontier.pop(0)
        for w, path, line in edges[v]:
            if w == start:
                return [*paths[v], (w, path, line)]
            if w in comp and w not in paths:
                paths[w] = [*paths[v], (w, path, line)]
                frontier.append(w)
    raise AssertionError("a strongly connected component always has a cycle")


def _describe(cycle: list[tuple[str, str, int]]) -> str:
    steps = " -> ".join(f"{target} ({path}:{line})" for target, path, line in cycle)
    return f"import circle: {steps}"


def repository_sources() -> dict[str, str]:
    out = {}
    for top in (PKG, "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    full = os.path.join(dirpath, f)
                    with open(full, encoding="utf-8") as fh:
                        out[os.path.relpath(full, ROOT)] = fh.read()
    return out


def test_dependency_rules_hold():
    broken = violations(repository_sources())
    assert not broken, "dependency rules broken:\n" + "\n".join(broken)


# The rules the checker must catch: each tree reproduces one break we once had.
BROKEN_TREES = {
    "parallel imports models": (
        {
            "megatron_lite/parallel/layers.py": (
                "def _gemm():\n    from megatron_lite.models.backends import TELinearGemm\n"
            ),
            "megatron_lite/models/backends.py": "",
        },
        "megatron_lite/parallel/layers.py:2: parallel/ must not import megatron_lite.models",
    ),
    "kernels import parallel": (
        {
            "kernels/cross_entropy.py": "from megatron_lite.parallel.mappings import all_reduce\n",
            "megatron_lite/parallel/mappings.py": "",
        },
        "kernels/cross_entropy.py:1: kernels/ must not import megatron_lite.parallel.mappings",
    ),
    "pipeline imports training (an import circle too)": (
        {
            "megatron_lite/pipeline/engine.py": (
                "def f():\n    from megatron_lite.training.trainer import autocast\n"
            ),
            "megatron_lite/training/trainer.py": "from megatron_lite.pipeline import engine\n",
            "megatron_lite/pipeline/__init__.py": "",
        },
        "megatron_lite/pipeline/engine.py:2: pipeline/ must not import "
        "megatron_lite.training.trainer",
    ),
    "moe imports config and validation": (
        {
            "megatron_lite/moe/layer.py": (
                "from megatron_lite.config import Config\n"
                "from megatron_lite.validation import num_microbatches\n"
            ),
            "megatron_lite/config.py": "",
            "megatron_lite/validation/__init__.py": "",
        },
        "megatron_lite/moe/layer.py:2: moe/ must not import megatron_lite.validation",
    ),
    "context imports training": (
        {"megatron_lite/context/ulysses.py": "import megatron_lite.training.trainer as t\n"},
        "megatron_lite/context/ulysses.py:1: context/ must not import",
    ),
    "models import training": (
        {"megatron_lite/models/chunk.py": "from ..training import lm_step\n"},
        "megatron_lite/models/chunk.py:1: models/ must not import megatron_lite.training",
    ),
    "data imports models": (
        {"megatron_lite/data/x.py": "from megatron_lite.models import build_model\n"},
        "megatron_lite/data/x.py:1: data/ must not import megatron_lite.models",
    ),
    "checkpoint imports training": (
        {
            "megatron_lite/checkpoint/checkpointer.py": (
                "from megatron_lite.training.trainer import Trainer\n"
            ),
            "megatron_lite/training/trainer.py": "",
        },
        "megatron_lite/checkpoint/checkpointer.py:1: checkpoint/ must not import "
        "megatron_lite.training.trainer",
    ),
    "an import circle": (
        {
            "megatron_lite/a.py": "import megatron_lite.b\n",
            "megatron_lite/b.py": "def f():\n    from megatron_lite import a\n",
        },
        "import circle: megatron_lite.b (megatron_lite/a.py:1) -> megatron_lite.a "
        "(megatron_lite/b.py:2)",
    ),
}


@pytest.mark.parametrize("case", BROKEN_TREES)
def test_checker_catches(case):
    tree, needle = BROKEN_TREES[case]
    found = violations(tree)
    assert any(needle in v for v in found), f"{case}: {needle!r} not in {found}"


def test_pipeline_circle_is_reported_as_a_circle():
    tree, _ = BROKEN_TREES["pipeline imports training (an import circle too)"]
    assert any(v.startswith("import circle:") for v in violations(tree))


def test_config_validation_does_not_load_the_data_parallel_wrappers():
    """Every CLI process validates its config; the data-parallel argument rules it shares with
    build_data_parallel must not pull in the wrappers (FSDP2, DTensor: ~0.7 s a process)."""
    import subprocess
    import sys

    code = (
        "import sys, megatron_lite.validation\n"
        "loaded = [m for m in ('megatron_lite.parallel.data_parallel.ddp',\n"
        "          'megatron_lite.parallel.data_parallel.fsdp', 'torch.distributed.tensor')\n"
        "          if m in sys.modules]\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"validation loaded {out.stdout.strip()}"
