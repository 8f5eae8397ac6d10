"""A hostile user's table for the planner (`python -m megatron_lite.plan`): every bad flag value
and every conflicting pair of flags ends in exit 2 with one line that names the flag, before
any work (nothing printed on stdout); a search that finds nothing says which rules rejected the
layouts. Cases run in-process under capsys; one goes through a real subprocess."""

import os
import subprocess
import sys

import pytest

from megatron_lite.plan.__main__ import main
from megatron_lite.plan.flags import MAX_WORLD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
HUGE = str(1 << 40)  # the issue's --world 1099511627776

# every numeric flag: NaN, inf, negative, zero, out of range, not a number, empty
NUMERIC_CASES = [
    (flag, value)
    for flag, values in {
        "--world": ["0", "-1", "1.5", "abc", "nan", "inf", HUGE, str(MAX_WORLD + 1), "", "1e3"],
        "--nodes": ["0", "-2", "x", "2.5", str(1 << 30), "nan"],
        "--gpus-per-node": ["0", "-8", "x", "1.5", str(MAX_WORLD + 1), "inf"],
        "--nvlink-gbps": ["0", "-1", "nan", "inf", "abc", "1e9", "-inf", "1e400"],
        "--ib-gbps": ["0", "-1", "nan", "inf", "x", "1e6", ""],
        "--pcie-gbps": ["0", "-1", "nan", "inf", "x", "1e6"],
        "--nic-gbps": ["0", "-100", "nan", "inf", "x", "1e5", ""],
        "--nics-per-node": ["0", "-1", "1.5", "x", "65"],
        "--mfu": ["0", "-0.1", "5", "1.01", "nan", "inf", "x", "", "45"],
        "--reserve": ["1", "1.5", "-0.1", "nan", "inf", "x", "5"],
        "--top": ["0", "-1", "1.5", "x", "nan"],
    }.items()
    for value in values
]

# (case id, argv after --config smoke.yaml ({tmp}: a scratch directory), flags to be named)
COMBO_CASES = [
    ("verify-no-search", ["--verify"], ["--verify", "--search"]),
    ("top-no-search", ["--top", "3"], ["--top", "--search"]),
    ("ranks-no-dry-run", ["--ranks", "0"], ["--ranks", "--dry-run"]),
    ("microbatches-no-dry-run", ["--microbatches", "4"], ["--microbatches", "--dry-run"]),
    ("json-no-dry-run", ["--json", "{tmp}/x.json"], ["--json", "--dry-run"]),
    ("search-dry-run", ["--search", "--world", "8", "--dry-run"], ["--search", "--dry-run"]),
    ("search-measure", ["--search", "--world", "8", "--measure"], ["--search", "--measure"]),
    ("world-nodes-disagree", ["--world", "8", "--nodes", "2"], ["--world", "--nodes"]),
    ("nodes-times-gpus-huge", ["--nodes", str(1 << 17), "--gpus-per-node", "16"], ["--nodes"]),
    ("measure-too-many", ["--measure", "--world", "128"], ["--measure"]),
    ("microbatches-zero", ["--dry-run", "--microbatches", "0"], ["--microbatches"]),
    ("microbatches-word", ["--dry-run", "--microbatches", "many"], ["--microbatches"]),
    ("microbatches-float", ["--dry-run", "--microbatches", "1.5"], ["--microbatches"]),
    ("ranks-word", ["--dry-run", "--ranks", "a,b"], ["--ranks"]),
    ("ranks-beyond-world", ["--dry-run", "--ranks", "0,5"], ["--ranks"]),
    ("ranks-negative", ["--dry-run", "--ranks", "-1"], ["--ranks"]),
    ("ranks-twice", ["--dry-run", "--world", "2", "--ranks", "1,1"], ["--ranks"]),
    ("ranks-empty", ["--dry-run", "--ranks="], ["--ranks"]),
    ("chart-not-png", ["--chart", "{tmp}/x.txt"], ["--chart"]),
    ("chart-is-dir", ["--chart", "{tmp}"], ["--chart"]),
    ("chart-no-dir", ["--chart", "{tmp}/missing/x.png"], ["--chart"]),
    ("chart-under-file", ["--chart", "{tmp}/afile/x.png"], ["--chart"]),
    ("chart-empty", ["--chart", ""], ["--chart"]),
    ("json-is-dir", ["--dry-run", "--json", "{tmp}"], ["--json"]),
    ("json-no-dir", ["--dry-run", "--json", "{tmp}/missing/x.json"], ["--json"]),
    ("gpu-unknown", ["--gpu", "h900"], ["--gpu"]),
    ("interconnect-unknown", ["--interconnect", "infinityfabric"], ["--interconnect"]),
    ("nic-type-unknown", ["--nic-type", "ethernet"], ["--nic-type"]),
    ("ib-gbps-and-nic-gbps", ["--ib-gbps", "50", "--nic-gbps", "400"], ["--ib-gbps", "--nic-gbps"]),
    (
        "ib-gbps-and-nic-type",
        ["--ib-gbps", "50", "--nic-type", "roce"],
        ["--ib-gbps", "--nic-type"],
    ),
    (
        "ib-gbps-and-nics",
        ["--ib-gbps", "50", "--nics-per-node", "1"],
        ["--ib-gbps", "--nics-per-node"],
    ),
    ("pcie-gbps-on-nvlink", ["--pcie-gbps", "50"], ["--pcie-gbps", "NVLink"]),
    ("switch-on-nvlink", ["--gpus-per-switch", "2"], ["--gpus-per-switch"]),
    (
        "nvlink-gbps-on-pcie",
        ["--gpu", "rtx5090", "--nvlink-gbps", "450"],
        ["--nvlink-gbps", "--pcie-gbps"],
    ),
    (
        "nvlink-on-l40s",
        ["--gpu", "l40s", "--interconnect", "nvlink"],
        ["--interconnect", "--nvlink-gbps"],
    ),
    (
        "switch-beyond-node",
        ["--gpu", "l40s", "--gpus-per-switch", "16"],
        ["--gpus-per-switch", "--gpus-per-node"],
    ),
    ("switch-zero", ["--gpu", "l40s", "--gpus-per-switch", "0"], ["--gpus-per-switch"]),
    ("kernels-unknown", ["--kernels", "triton"], ["--kernels"]),
    ("flag-unknown", ["--wrld", "8"], ["--wrld"]),
    ("flag-no-value", ["--world"], ["--world"]),
    ("config-dp-huge", [f"parallel.dp={MAX_WORLD * 2}"], ["parallel.dp"]),
    ("config-tp-bad", ["parallel.tp=3"], ["parallel.tp"]),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("plan_flags")
    (root / "afile").write_text("not a directory\n")
    return str(root)


def _plan(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def _refused(argv, capsys) -> str:
    code, out, err = _plan(["--config", SMOKE, *argv], capsys)
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert "Fix: " in err and out == "", (out, err)  # before any work: nothing printed
    return err


@pytest.mark.parametrize("flag, value", NUMERIC_CASES, ids=[f"{f}={v}" for f, v in NUMERIC_CASES])
def test_bad_numeric_flag(capsys, flag, value):
    err = _refused([f"{flag}={value}"], capsys)  # "=": argparse takes "-inf" for a flag
    assert f"error: {flag}=" in err, err


@pytest.mark.parametrize("case, args, named", COMBO_CASES, ids=[c[0] for c in COMBO_CASES])
def test_bad_flag_combination(tmp, capsys, case, args, named):
    err = _refused([a.replace("{tmp}", tmp) for a in args], capsys)
    assert all(flag in err for flag in named), err


def test_a_percentage_gets_the_fraction_as_its_fix(capsys):
    err = _refused(["--mfu", "45"], capsys)
    assert "0.45" in err, err


def test_a_search_that_finds_no_valid_layout_names_the_rules_and_a_world_that_works(capsys):
    code, out, err = _plan(["--config", SMOKE, "--search", "--world", "7"], capsys)
    assert code == 1 and err == "", err
    # cp = 7 can't split 4 heads: the search tries the ring there, which 64 tokens don't fit
    for key in ("train.global_batch_size", "parallel.tp", "model.seq_length"):
        assert f" by {key} (e.g. {key}=" in out, out
    assert "--world 8" in out and "Fix:" in out, out


def test_a_search_where_nothing_fits_gives_the_smallest_peak(capsys):
    argv = ["--config", os.path.join(ROOT, "configs", "llama3_8b.yaml"), "--search", "--world=1"]
    code, out, err = _plan(argv, capsys)
    assert code == 1 and "none fits: the smallest peak" in out and "GiB usable" in out, out


def test_the_largest_world_searches_fast(capsys):
    """The divisors come in O(√n): the search of the largest allowed world starts at once."""
    argv = ["--config", SMOKE, "--search", "--world", str(MAX_WORLD)]
    code, out, _ = _plan(argv, capsys)
    assert code == 1 and "no valid layout" in out and "train.global_batch_size" in out, out


def test_plan_flag_table_is_large_enough():
    assert len(NUMERIC_CASES) + len(COMBO_CASES) >= 80


def test_cli_plan_bad_flag_prints_one_line():
    env = dict(os.environ, PYTHONPATH=ROOT)
    argv = [sys.executable, "-m", "megatron_lite.plan", "--config", SMOKE, "--mfu", "0"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith("error: --mfu=0: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
