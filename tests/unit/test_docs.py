"""The README and docs/*.md say what the code does.

- Every fenced shell command that calls the project's CLIs parses with that CLI: `train`,
  `launch`, `torchrun ... -m megatron_lite.train`, `bash quickstart.sh`, `launch/local.sh` and
  `launch/slurm/submit.sh` run `python -m megatron_lite.launch --check` with the same config and
  overrides (and, where the command fixes it, the same number of ranks); `plan` runs when it is
  a plain plan (seconds) and is parsed otherwise (`--search`, `--dry-run`, `--measure` and the
  flags that write files); tools and the other modules are parsed by their own argparse parser
  without running (their `parse_args` parses, then stops the command). All of them run in one
  child process (runpy, as `tests/unit/test_every_cli.py` does), so torch is imported once.
- Every config key the docs name (`section.key`) exists, and every field of the config
  dataclasses has a row in docs/configuration.md's "Every key" table.
- The building-block table of docs/own_model.md lists every argument of each callable, in order.
- Every relative link and `#anchor` resolves (GitHub's heading slugs).

Conventions the docs follow for this test:
- Shell commands are in ```bash (or sh/shell) blocks, one command per line (a trailing `\\`
  continues it, `#` starts a comment), or in ```console blocks as `$ command` lines followed by
  their output.
- A block whose commands hold placeholders the user fills in (a path they choose, `<run dir>`)
  is preceded by the line `<!-- docs-test: skip (why) -->`; keep that rare.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib
import inspect
import json
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
SKIP_MARK = re.compile(r"<!-- docs-test: skip \((.+)\) -->")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SECTIONS = ("model", "parallel", "data", "train", "log")
# plan flags that search, dry-run, fork ranks or write files: parsed, not run
PLAN_PARSE_ONLY = {"--search", "--dry-run", "--measure", "--verify", "--chart", "--json"}
PARSED = "[docs-test] argv parsed"  # what a parse-only command prints when its parser is done
# torchrun's options that take a value
TORCHRUN_VALUED = {"--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                   "--max-restarts", "--master-addr", "--master-port", "--node-rank"}  # fmt: skip


# ------------------------------------------------------------------ reading markdown
@dataclasses.dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    lines: list[str]
    skip: str | None  # the reason of a docs-test skip mark before it


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def blocks(page: str) -> list[Block]:
    out, current, previous = [], None, ""
    for number, line in enumerate(read(page).split("\n"), 1):
        if current is None and line.startswith("```"):
            mark = SKIP_MARK.fullmatch(previous.strip())
            current = Block(page, number, line[3:].strip(), [], mark and mark.group(1))
        elif current is not None and line.startswith("```"):
            out.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
        if line.strip():
            previous = line
    return out


def prose(page: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced blocks."""
    out, fenced = [], False
    for number, line in enumerate(read(page).split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def shell_commands(block: Block) -> list[tuple[int, str]]:
    """(line, command) of a shell block: $-lines of a console block, every line of a bash one,
    `\\`-continuations joined."""
    out, pending, start = [], "", 0
    for offset, line in enumerate(block.lines, 1):
        if block.lang == "console" and not pending:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if not pending:
            start = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command, pending = pending + line, ""
        if command.strip() and not command.lstrip().startswith("#"):
            out.append((start, command))
    return out


# ------------------------------------------------------------------ commands -> checks
# a check: (kind "module" | "script", target, argv, mode, ranks): mode "run" (exit 0) or
# "parse" (argparse accepts argv); ranks: the world size the launcher must report, or None
def _after_flags(argv: list[str], with_value: set[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's own options (as --name: value) and what follows them."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        name, _, value = argv[i].partition("=")
        name = name.replace("_", "-")
        if not value and name in with_value:
            i += 1
            value = argv[i]
        opts[name] = value
        i += 1
    return opts, argv[i:]


def _launch_check(args: list[str], ranks: int | None):
    argv = [a for a in args if a != "--check"]
    return ("module", "megatron_lite.launch", ["--check", *argv], "run", ranks)


def check_for(command: str):
    """The check of one shell command, or None when it calls none of the project's CLIs."""
    argv = shlex.split(command, comments=True)
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv = argv[1:]  # VAR=value before the command
    if not argv:
        return None
    head, rest = argv[0], argv[1:]
    if head in ("python", "python3") and rest[:1] == ["-m"] and len(rest) > 1:
        module, args = rest[1], rest[2:]
        if not module.startswith("megatron_lite"):
            return None
        if module == "megatron_lite.train":
            return _launch_check(args, 1)  # one process, no torchrun
        if module == "megatron_lite.launch":
            return _launch_check(args, None)
        if module == "megatron_lite.plan" and not PLAN_PARSE_ONLY & {a.split("=")[0] for a in args}:
            return ("module", module, args, "run", None)
        return ("module", module, args, "parse", None)
    if head in ("python", "python3") and rest and rest[0].startswith("tools/"):
        return ("script", os.path.join(ROOT, rest[0]), rest[1:], "parse", None)
    if head == "megatron-lite-train":
        return _launch_check(rest, None)
    if head == "bash" and rest[:1] == ["quickstart.sh"]:
        return _launch_check(["--config", "configs/quickstart.yaml", *rest[1:]], None)
    if head == "bash" and rest[:1] == ["tools/gpu_check.sh"]:  # installs, then gpu_check.py "$@"
        return ("script", os.path.join(ROOT, "tools/gpu_check.py"), rest[1:], "parse", None)
    if head == "launch/local.sh":  # exec python -m megatron_lite.launch "$@"
        return _launch_check(rest, None)
    if head == "launch/slurm/submit.sh":  # NODES GPUS_PER_NODE CONFIG [overrides]
        nodes, gpus, config, *overrides = rest
        return _launch_check(["--config", config, *overrides], int(nodes) * int(gpus))
    if head == "torchrun":
        opts, tail = _after_flags(rest, TORCHRUN_VALUED)
        assert tail[:2] == ["-m", "megatron_lite.train"], f"torchrun of what? {command}"
        ranks = int(opts.get("--nproc-per-node", 1)) * int(opts.get("--nnodes", 1))
        return _launch_check(tail[2:], ranks)
    return None


def command_cases() -> dict[str, tuple]:
    """{"page:line": (check, command)} of every checked command in README and docs."""
    out = {}
    for page in PAGES:
        for block in blocks(page):
            if block.lang not in SHELL_LANGS or block.skip:
                continue
            for line, command in shell_commands(block):
                check = check_for(command)
                if check is not None:
                    out[f"{page}:{line}"] = (check, command)
    return out


# ------------------------------------------------------------------ the child process
class ArgvParsed(SystemExit):
    """Raised by a patched `parse_args` once argparse accepted the argv: the command stops."""


def _patch_argparse() -> contextlib.AbstractContextManager:
    """parse_args (and a direct parse_known_args) parse as usual, then raise ArgvParsed."""
    parse_args, parse_known = (
        argparse.ArgumentParser.parse_args,
        argparse.ArgumentParser.parse_known_args,
    )
    depth = [0]

    def patched_parse_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            parse_args(self, args, namespace)  # argparse's own errors exit 2 here
        finally:
            depth[0] -= 1
        print(PARSED)
        raise ArgvParsed(0)

    def patched_parse_known(self, args=None, namespace=None):
        result = parse_known(self, args, namespace)
        if depth[0]:
            return result  # inside parse_args, or a subparser
        print(PARSED)
        raise ArgvParsed(0)

    stack = contextlib.ExitStack()
    for name, value in (
        ("parse_args", patched_parse_args),
        ("parse_known_args", patched_parse_known),
    ):
        old = getattr(argparse.ArgumentParser, name)
        setattr(argparse.ArgumentParser, name, value)
        stack.callback(setattr, argparse.ArgumentParser, name, old)
    return stack


def _child(spec_path: str, result_path: str) -> None:
    sys.path.insert(0, ROOT)
    from tests.unit.test_every_cli import _run_one  # runpy as `python -m` / `python tools/x.py`

    with open(spec_path) as f:
        spec = json.load(f)
    results = {}
    for name, (kind, target, argv, mode, _) in spec["commands"].items():
        with _patch_argparse() if mode == "parse" else contextlib.nullcontext():
            results[name] = _run_one(kind, target, argv)
    signatures = {}  # here, where torch is imported already, not in pytest's process
    for module, name in spec["callables"]:
        params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
        named = [p.name for p in params.values() if p.kind != p.VAR_KEYWORD]
        signatures[f"{module}.{name}"] = (named, len(named) < len(params))
    with open(result_path, "w") as f:
        json.dump({"commands": results, "signatures": signatures}, f)


# ------------------------------------------------------------------ the tests
CASES = command_cases()


@pytest.fixture(scope="module")
def command_results(tmp_path_factory):
    from tests.unit.test_every_cli import run_child

    commands = {name: check for name, (check, _) in CASES.items()}
    callables = sorted({(m, n) for _, m, n, _ in building_blocks()})
    payload = {"commands": commands, "callables": callables}
    return run_child(__file__, payload, tmp_path_factory.mktemp("docs"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", list(CASES))
def test_shell_command_parses(where, command_results):
    (kind, target, argv, mode, ranks), command = CASES[where]
    code, output, _ = command_results["commands"][where]
    what = f"{where}: `{command}`"
    assert "Traceback" not in output, f"{what}\n{output[-3000:]}"
    assert code == 0, f"{what} exits {code} ({mode}):\n{output[-3000:]}"
    if mode == "parse":
        assert PARSED in output or "usage" in output.lower(), (
            f"{what}: never parsed its argv with argparse, so this test cannot check it"
        )
    if ranks is not None:
        got = re.search(r"config valid for (\d+) ranks?", output)
        assert got and int(got.group(1)) == ranks, (
            f"{what}: the command starts {ranks} ranks, the config's layout needs "
            f"{got and got.group(1)}:\n{output[-2000:]}"
        )


def test_commands_are_found():
    """The extraction sees the commands the pages hold (a broken fence would hide them all)."""
    pages = {where.split(":")[0] for where in CASES}
    assert {"README.md", "docs/clusters.md", "docs/planner.md"} <= pages, sorted(pages)
    assert any(c[0][1] == "megatron_lite.launch" for c in CASES.values())


# ---- config keys
def config_fields() -> dict[str, set[str]]:
    from megatron_lite.config import Config

    config = Config()
    return {f.name: {g.name for g in dataclasses.fields(getattr(config, f.name))}
            for f in dataclasses.fields(Config)}  # fmt: skip


KEY = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([A-Za-z_][A-Za-z0-9_]*)(\*?)(\(?)")
NOT_KEYS = {"py", "yaml", "sh", "md", "json", "jsonl", "txt", "png", "sbatch", "lock", "log"}


def named_keys(page: str) -> list[tuple[int, str, str]]:
    """(line, section, key) of every `section.key` in prose and shell blocks (not Python)."""
    lines = list(prose(page))
    for block in blocks(page):
        if block.lang in SHELL_LANGS:  # untagged blocks are output: errors name bad keys
            lines += [(block.line + i, text) for i, text in enumerate(block.lines, 1)]
    out = []
    for number, text in lines:
        for m in KEY.finditer(text):
            section, key, star, call = m.groups()
            if key not in NOT_KEYS and not call:
                out.append((number, section, key + star))
    return out


def test_every_named_config_key_exists():
    fields = config_fields()
    bad = []
    for page in PAGES:
        for line, section, key in named_keys(page):
            known = fields[section]
            ok = any(f.startswith(key[:-1]) for f in known) if key.endswith("*") else key in known
            if not ok:
                bad.append(f"{page}:{line}: {section}.{key}")
    assert not bad, "config keys the docs name that megatron_lite/config.py does not have:\n" + (
        "\n".join(bad)
    )


def documented_keys() -> dict[str, int]:
    """{"section.key": line} of the first column of docs/configuration.md's "Every key" table."""
    text = read("docs/configuration.md").split("\n")
    start = text.index("## Every key")
    out = {}
    for number, line in enumerate(text[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("| `"):
            continue
        section = None
        for span in re.findall(r"`([^`]*)`", re.split(r"(?<!\\)\|", line)[1]):
            if "." in span:
                section, _, span = span.partition(".")
            out[f"{section}.{span}"] = number
    return out


def test_every_config_key_is_documented():
    documented = documented_keys()
    fields = config_fields()
    missing = [f"{s}.{k}" for s, keys in fields.items() for k in sorted(keys)
               if f"{s}.{k}" not in documented]  # fmt: skip
    assert not missing, f"keys without a row in docs/configuration.md's table: {missing}"
    stale = [f"{k} (line {n})" for k, n in documented.items()
             if k.split(".")[1] not in fields.get(k.split(".")[0], ())]  # fmt: skip
    assert not stale, f"rows of docs/configuration.md for keys config.py does not have: {stale}"


# ---- the building-block table
def _params(args: str) -> list[str]:
    """Parameter names of `a, b=1, *, c=(1, 2)` (top-level commas; `*` dropped)."""
    names, depth, piece = [], 0, ""
    for ch in args + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            m = re.match(r"\s*\**(\w+)", piece)
            if m:
                names.append(m.group(1))
            piece = ""
        else:
            piece += ch
    return names


def building_blocks() -> list[tuple[int, str, str, list[str]]]:
    """(line, module, name, listed parameters) of each callable in docs/own_model.md's
    building-block table."""
    out = []
    for number, line in enumerate(read("docs/own_model.md").split("\n"), 1):
        if not line.startswith("| `megatron_lite."):
            continue
        spans = re.findall(r"`([^`]*)`", re.split(r"(?<!\\)\|", line)[1])
        for span in spans[1:]:
            m = re.fullmatch(r"(\w+)\((.*)\)", span.replace("\\|", "|"))
            if m:
                out.append((number, spans[0], m.group(1), _params(m.group(2))))
    return out


def test_building_block_table_matches_the_signatures(command_results):
    rows = building_blocks()
    assert len(rows) >= 20, "docs/own_model.md lost its building-block table"
    bad = []
    for number, module, name, listed in rows:
        real, var_keyword = command_results["signatures"][f"{module}.{name}"]
        # with **kwargs, keyword arguments beyond the named ones are the callee's to check
        ok = listed[: len(real)] == real if var_keyword else listed == real
        if not ok:
            bad.append(f"docs/own_model.md:{number}: {module}.{name}({', '.join(real)})")
    assert not bad, "the building-block table differs from these signatures:\n" + "\n".join(bad)


# ---- links and anchors
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: str) -> set[str]:
    out, seen = set(), {}
    for _, line in prose(page):
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1).strip())
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for page in PAGES:
        for number, line in prose(page):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                path, _, anchor = target.partition("#")
                resolved = page  # a bare #anchor is this page's
                if path:
                    resolved = os.path.normpath(os.path.join(os.path.dirname(page), path))
                if not os.path.exists(os.path.join(ROOT, resolved)):
                    bad.append(f"{page}:{number}: {target} ({resolved} does not exist)")
                elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                    bad.append(f"{page}:{number}: {target} (no heading #{anchor} in {resolved})")
    assert not bad, "links that do not resolve:\n" + "\n".join(bad)


def test_slug_follows_github():
    assert slug("Long context: context parallelism (Ulysses, ring, hybrid)") == (
        "long-context-context-parallelism-ulysses-ring-hybrid"
    )
    assert slug("The converter's safety") == "the-converters-safety"
    assert slug("`metrics.jsonl` and `mem/*`") == "metricsjsonl-and-mem"
    assert slug("ZB-V and DualPipeV") == "zb-v-and-dualpipev"


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
