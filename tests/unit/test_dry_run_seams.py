"""The dry run's seams stay where parallel/dry_run_seams.py lists them: every call of
host.read, fake.is_fake, fake.active, fake.real_tensors, every fake-group check in the package
and kernels/, and every call of the kernels' own dispatch.is_fake is a listed call site, every
listed one still exists, and only parallel/fake.py (and kernels/dispatch.py) import torch's
private fake-tensor API."""

import ast
import collections
import os

from megatron_lite.parallel.dry_run_seams import CALL_SITES, SEAMS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST, FAKE = "megatron_lite.parallel.host", "megatron_lite.parallel.fake"
FUNCTIONS = {HOST: ("read",), FAKE: ("is_fake", "active", "real_tensors")}
PRIVATE = "torch._subclasses"  # FakeTensor, FakeTensorMode
PRIVATE_OK = {"megatron_lite/parallel/fake.py", "kernels/dispatch.py"}


def _aliases(tree: ast.AST) -> tuple[dict, dict]:
    """{local name: seam module} and {local name: "host.read"-style seam} from the imports."""
    modules, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in FUNCTIONS and a.asname:
                    modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in FUNCTIONS:
                    modules[a.asname or a.name] = full
                elif a.name in FUNCTIONS.get(node.module, ()):
                    names[a.asname or a.name] = f"{node.module.rsplit('.', 1)[1]}.{a.name}"
    return modules, names


def _is_fake_group_check(node: ast.AST) -> bool:
    """`dist.get_backend(...) == "fake"` (or !=, either side)."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    fake = any(isinstance(s, ast.Constant) and s.value == "fake" for s in sides)
    backend = any(
        isinstance(s, ast.Call)
        and getattr(s.func, "attr", getattr(s.func, "id", None)) == "get_backend"
        for s in sides
    )
    return fake and backend


def _is_kernels_fake_check(node: ast.AST) -> bool:
    """A call of the kernels' own `dispatch.is_fake` (bare inside dispatch.py)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    bare = isinstance(f, ast.Name) and f.id == "is_fake"
    return bare or (isinstance(f, ast.Attribute) and f.attr == "is_fake"
                    and isinstance(f.value, ast.Name) and f.value.id == "dispatch")  # fmt: skip


def seam_calls(source: str, kernels: bool = False) -> list[tuple[str, str, int]]:
    """(seam, enclosing "Class.function" or "<module>", line) of every seam use in `source`
    (kernels: a file of kernels/, whose own seam is dispatch.is_fake)."""
    tree = ast.parse(source)
    modules, names = _aliases(tree)
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = f"{scope}.{child.name}" if scope else child.name
            seam = None
            if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name):
                module = modules.get(child.value.id)
                if module and child.attr in FUNCTIONS[module]:
                    seam = f"{module.rsplit('.', 1)[1]}.{child.attr}"
            elif isinstance(child, ast.Name) and child.id in names:
                seam = names[child.id]
            elif _is_fake_group_check(child):
                seam = "fake group"
            elif kernels and _is_kernels_fake_check(child):
                seam = "dispatch.is_fake"
            if seam is not None:
                found.append((seam, scope or "<module>", child.lineno))
            visit(child, inner)

    visit(tree, "")
    return found


def _sources():
    for top in ("megatron_lite", "kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, ROOT).replace(os.sep, "/"), f.read()


def test_the_scanner_finds_every_form_of_a_seam_call():
    source = (
        "from megatron_lite.parallel import host as h, fake\n"
        "from megatron_lite.parallel.fake import active as on\n"
        "import torch.distributed as dist\n"
        "x = h.read(t, 0)\n"
        "class A:\n"
        "    def f(self, g):\n"
        "        if on() or fake.is_fake(t) or dist.get_backend(g) != 'fake':\n"
        "            with fake.real_tensors():\n"
        "                pass\n"
        "def read(t):\n"
        "    return t.read()  # not the seam\n"
    )
    assert seam_calls(source) == [
        ("host.read", "<module>", 4),
        ("fake.active", "A.f", 7),
        ("fake.is_fake", "A.f", 7),
        ("fake group", "A.f", 7),
        ("fake.real_tensors", "A.f", 8),
    ]
    kernel = (
        "from . import dispatch\nif dispatch.is_fake(x) or is_fake(y) or t.is_fake():\n    pass\n"
    )
    assert seam_calls(kernel, kernels=True) == [("dispatch.is_fake", "<module>", 2)] * 2
    assert seam_calls(kernel) == [], "another module's is_fake is not the kernels' seam"


def test_every_seam_call_is_listed_and_every_listed_one_exists():
    listed = collections.Counter((s.seam, s.path, s.function) for s in CALL_SITES)
    assert {s.seam for s in CALL_SITES} <= set(SEAMS)
    assert all(s.why for s in CALL_SITES), "every call site says why it is there"
    found = collections.defaultdict(list)
    for path, source in _sources():
        for seam, function, line in seam_calls(source, kernels=path.startswith("kernels/")):
            found[(seam, path, function)].append(line)
    new = [
        f"{path}:{lines[listed[(seam, path, function)]]} calls {seam} in {function}"
        for (seam, path, function), lines in sorted(found.items())
        if len(lines) > listed[(seam, path, function)]
    ]
    assert not new, (
        "dry-run seam calls not listed in megatron_lite/parallel/dry_run_seams.py "
        "(CALL_SITES): add each with why it is needed, or pass a value in instead: "
        + "; ".join(new)
    )
    gone = [
        f"{seam} in {path} {function} (listed {n}, found {len(found[key])})"
        for key, n in sorted(listed.items())
        for seam, path, function in [key]
        if len(found[key]) < n
    ]
    assert not gone, (
        "CALL_SITES in megatron_lite/parallel/dry_run_seams.py lists seam calls that are gone "
        "(remove or update the entries): " + "; ".join(gone)
    )


def test_only_the_fake_module_imports_torchs_private_fake_tensors():
    offenders = []
    for path, source in _sources():
        for node in ast.walk(ast.parse(source)):
            module = None
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
            elif isinstance(node, ast.Import):
                module = " ".join(a.name for a in node.names)
            if module and PRIVATE in module and path not in PRIVATE_OK:
                offenders.append(f"{path}:{node.lineno}")
    assert not offenders, (
        f"{PRIVATE} imported outside {sorted(PRIVATE_OK)}: use megatron_lite.parallel.fake "
        f"(is_fake, active, real_tensors, FakeTensorMode) at {', '.join(offenders)}"
    )
