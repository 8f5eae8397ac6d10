"""Every entry point on every shipped config: the planner (plain and --chart) and the
launcher's --check on each configs/*.yaml, the planner's --search on one config of each kind,
and --help of every tool and module entry point, exit as documented with no traceback.

One child process runs them all in a row (runpy, as `python -m` / `python tools/x.py` would),
so torch is imported once instead of once per command: the whole set takes seconds. Running
this file as a script is that child: it reads the commands as JSON and writes the results.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import json
import os
import runpy
import subprocess
import sys
import time
import traceback
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs/*.yaml")))
SEARCH_WORLD = "8"  # one node: every layout of it is searched in well under a second or two
# --search on one config of each kind (dense, MoE, fine-grained MoE, ring CP, too big for a
# node): the search walks the same code for every config, and on the MoE configs it takes
# 7-16 s each here since the planner measures the real modules (one fake forward per layout
# kind); deepseek_v3_like is the fine-grained MoE one (the plain plan of every config covers
# what is config-specific)
SEARCHED = {
    "configs/smoke.yaml",
    "configs/quickstart.yaml",
    "configs/moe.yaml",
    "configs/long_context_ring.yaml",
    "configs/llama3_70b.yaml",
    "configs/deepseek_v3_like.yaml",
}
# nothing of these models fits one node's 8 GPUs: the search says so and exits 1 (README)
TOO_BIG_FOR_ONE_NODE = {
    "configs/deepseek_v3_like.yaml",
    "configs/llama3_405b.yaml",
    "configs/llama3_70b.yaml",
    "configs/mixtral_8x7b.yaml",
}


def entry_modules() -> list[str]:
    """Every `python -m` entry point of the package: modules with a `__main__` guard and
    packages with a `__main__.py`."""
    found = []
    for path in sorted(
        glob.glob(os.path.join(ROOT, "megatron_lite", "**", "*.py"), recursive=True)
    ):
        rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
        if rel.endswith(".__main__"):
            found.append(rel[: -len(".__main__")])
        elif _has_main_guard(path):
            found.append(rel)
    return found


def _has_main_guard(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return any(
        isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
        for node in tree.body
    )


def commands(tmp: str) -> dict[str, tuple[str, str, list[str], int]]:
    """{test id: (kind "module" | "script", target, argv, expected exit code)}."""
    out = {}
    for cfg in CONFIGS:
        name = os.path.basename(cfg)[: -len(".yaml")]
        search_rc = 1 if cfg in TOO_BIG_FOR_ONE_NODE else 0
        search = ["--search", "--world", SEARCH_WORLD, "--top", "2"]
        chart = ["--chart", os.path.join(tmp, f"{name}.png")]
        plan, launch = "megatron_lite.plan", "megatron_lite.launch"
        out[f"plan {name}"] = ("module", plan, ["--config", cfg], 0)
        if cfg in SEARCHED:
            out[f"plan --search {name}"] = ("module", plan, ["--config", cfg, *search], search_rc)
        out[f"plan --chart {name}"] = ("module", plan, ["--config", cfg, *chart], 0)
        out[f"launch --check {name}"] = ("module", launch, ["--check", "--config", cfg], 0)
    bad = ["--check", "--config", "configs/smoke.yaml", "parallel.tp=3"]  # one paragraph
    out["launch --check (an invalid layout)"] = ("module", "megatron_lite.launch", bad, 2)
    for module in entry_modules():
        out[f"{module} --help"] = ("module", module, ["--help"], 0)
    for tool in sorted(glob.glob(os.path.join(ROOT, "tools", "*.py"))):  # last: some set env vars
        out[f"{os.path.relpath(tool, ROOT)} --help"] = ("script", tool, ["--help"], 0)
    return out


# ------------------------------------------------------------------ the child process
def _run_one(kind: str, target: str, argv: list[str]) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, seconds) of one command, as the interpreter would end it."""
    environ, path, out = dict(os.environ), list(sys.path), io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if kind == "module":
                sys.argv = [target, *argv]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, *argv]
                # as `python tools/x.py` has it: its folder first, the checkout's root absent
                # (this checkout's megatron_lite is imported already)
                sys.path[:] = [os.path.dirname(target), *(p for p in path if p != ROOT)]
                runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            out.write(e.code + "\n")
    except BaseException:  # what Python would print before exiting 1
        out.write(traceback.format_exc())
        code = 1
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        for name in [m for m in sys.modules if m == "tools" or m.startswith("tools.")]:
            del sys.modules[name]  # a tool that imports `tools` must do so itself
    return code, out.getvalue(), time.perf_counter() - start


def _child(spec_path: str, result_path: str) -> None:
    sys.path.insert(0, ROOT)  # this checkout's package, as `python -m` from ROOT imports it
    # runpy warns when an entry module was imported already (the launcher imports train)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
    with open(spec_path) as f:
        spec = json.load(f)
    results = {}
    for name, (kind, target, argv, _) in spec.items():
        results[name] = _run_one(kind, target, argv)
    with open(result_path, "w") as f:
        json.dump(results, f)


# ------------------------------------------------------------------ the tests
# ids only (the chart folder is per session): the spec is rebuilt with the real folder below
CASES = commands("<tmp>")


def run_child(script: str, payload, tmp) -> dict:
    """Run `script` (a test file that is also the child, as this one) on `payload` written
    as JSON into `tmp`; its JSON results."""
    spec, result = tmp / "spec.json", tmp / "results.json"
    spec.write_text(json.dumps(payload))
    env = dict(os.environ, MEGATRON_LITE_QUIET="1")
    run = subprocess.run(
        [sys.executable, os.path.abspath(script), str(spec), str(result)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0 and result.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("every_cli")
    return tmp, run_child(__file__, commands(str(tmp)), tmp)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_entry_point(name, results):
    tmp, got = results
    kind, target, argv, expected = CASES[name]
    code, output, seconds = got[name]
    assert "Traceback" not in output, f"{name}:\n{output}"
    assert code == expected, f"{name}: exit {code}, expected {expected}:\n{output[-3000:]}"
    if "--chart" in argv:
        chart = tmp / os.path.basename(argv[argv.index("--chart") + 1])
        assert chart.stat().st_size > 0, f"{name}: no chart written"
    if "--help" in argv:
        assert "usage" in output.lower() or kind == "script", f"{name} printed no usage"


def test_every_entry_point_is_found():
    """The discovery above sees the entry points the README documents, and every searched
    config is shipped."""
    assert SEARCHED <= set(CONFIGS), SEARCHED - set(CONFIGS)
    modules = entry_modules()
    for module in ("megatron_lite.train", "megatron_lite.launch", "megatron_lite.plan"):
        assert module in modules, modules


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
