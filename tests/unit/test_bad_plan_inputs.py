"""The planner's flags checked against the run they drive (issue 36, class C and its hangs):
--microbatches against the pipeline schedule and the config's microbatches, counts so large
the dry run would never end, digits that are not ASCII, output files that cannot be written
(a device, a broken link, /proc), --top with --verify, --measure's real memory. Each one is
exit 2 with one line naming the flag, before any work (nothing on stdout), in-process."""

import errno
import os

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.plan.__main__ import main
from megatron_lite.plan.dry_run import (
    MAX_DRY_RUN_MICROBATCHES,
    dry_run_microbatches,
    steady_microbatches,
)
from megatron_lite.plan.flags import MAX_DRY_RUN_RANKS, MAX_VERIFY, write_output
from megatron_lite.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
PP2 = ["parallel.pp=2"]  # smoke: 2 layers, 4 microbatches of 2 per step
VPP2 = ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"]
MANY = ",".join(str(r) for r in range(MAX_DRY_RUN_RANKS + 1))
BIG_MODEL = [  # 412B parameters on 8 replicas: terabytes
    "model.num_layers=128",
    "model.hidden_size=16384",
    "model.num_attention_heads=128",
    "model.num_query_groups=8",
    "parallel.dp=null",
    "train.global_batch_size=16",
]
VPP2_V = [*VPP2, "parallel.pipeline_schedule=dualpipev"]

# (case id, argv after --config smoke.yaml ({tmp}: a scratch directory), words the one line
# must hold: the flag, its value, the rule's key figure)
CASES = [
    # --microbatches against the layout's schedule and the config's M
    ("mb-below-pp", [*PP2, "--dry-run", "--microbatches", "1"], ["--microbatches=1", "pp=2"]),
    ("mb-interleaved-not-multiple", [*VPP2, "--dry-run", "--microbatches", "3"],
     ["--microbatches=3", "interleaved", "--microbatches 4"]),
    ("mb-dualpipev-below-2pp",
     [*VPP2_V, "train.global_batch_size=16", "--dry-run", "--microbatches", "2"],
     ["--microbatches=2", "dualpipev", "--microbatches 4"]),
    ("mb-zb-v-below-pp",
     [*VPP2, "parallel.pipeline_schedule=zb-v", "--dry-run", "--microbatches", "1"],
     ["--microbatches=1", "pp=2"]),
    ("mb-huge", ["--dry-run", "--microbatches", "10000000"],
     ["--microbatches=10000000", "train.global_batch_size", "all (= 4)"]),
    ("mb-above-m", ["--dry-run", "--microbatches", "5"], ["--microbatches=5", "4 microbatches"]),
    ("mb-all-huge-config", ["train.global_batch_size=20000000", "--dry-run", "--microbatches",
                            "all"], ["--microbatches=all", str(MAX_DRY_RUN_MICROBATCHES)]),
    ("mb-count-huge-config", ["train.global_batch_size=20000000", "--dry-run", "--microbatches",
                              "5000"], ["--microbatches=5000", str(MAX_DRY_RUN_MICROBATCHES)]),
    ("mb-superscript", ["--dry-run", "--microbatches", "²"], ["--microbatches=²", "ASCII"]),
    ("mb-arabic-indic", ["--dry-run", "--microbatches", "٢"], ["--microbatches=٢"]),
    ("mb-fullwidth", ["--dry-run", "--microbatches", "４"], ["--microbatches=４"]),
    ("mb-empty", ["--dry-run", "--microbatches="], ["--microbatches=''"]),
    ("mb-space", ["--dry-run", "--microbatches", " 4"], ["--microbatches=' 4'"]),
    ("mb-underscore", ["--dry-run", "--microbatches", "1_0"], ["--microbatches=1_0"]),
    ("mb-negative", ["--dry-run", "--microbatches=-2"], ["--microbatches=-2"]),
    ("mb-hex", ["--dry-run", "--microbatches", "0x2"], ["--microbatches=0x2"]),
    ("mb-upper-all", ["--dry-run", "--microbatches", "ALL"], ["--microbatches=ALL"]),
    ("mb-twenty-digits", ["--dry-run", "--microbatches", "9" * 20], ["--microbatches=999"]),
    # --ranks: ASCII digits, each once, a bounded count
    ("ranks-superscript", ["--dry-run", "--ranks", "²"], ["--ranks=²", "ASCII"]),
    ("ranks-fullwidth", ["--dry-run", "--world", "2", "parallel.dp=2", "--ranks", "１"],
     ["--ranks=１"]),
    ("ranks-empty-entry", ["--dry-run", "--world", "2", "parallel.dp=2", "--ranks", "0,,1"],
     ["--ranks=0,,1"]),
    ("ranks-semicolon", ["--dry-run", "--world", "2", "parallel.dp=2", "--ranks", "0;1"],
     ["--ranks=0;1"]),
    ("ranks-too-many", ["--dry-run", "--world", "128", "--ranks", MANY],
     ["--ranks=0,1,2", f"at most {MAX_DRY_RUN_RANKS}"]),
    ("ranks-twice-named", ["--dry-run", "--world", "2", "parallel.dp=2", "--ranks", "1,0,1"],
     ["--ranks=1,0,1", "rank 1 twice"]),
    # output files: checked before the plan, not after the dry run
    ("json-dev-full", ["--dry-run", "--json", "/dev/full"], ["--json=/dev/full", "regular"]),
    ("json-proc", ["--dry-run", "--json", "/proc/x.json"], ["--json=/proc/x.json", "/proc"]),
    ("json-dangling-link", ["--dry-run", "--json", "{tmp}/dangling.json"],
     ["--json=", "dangling.json", "broken symbolic link"]),
    ("json-fifo", ["--dry-run", "--json", "{tmp}/fifo.json"], ["--json=", "fifo.json"]),
    ("json-under-file", ["--dry-run", "--json", "{tmp}/afile/x.json"], ["--json=", "afile"]),
    ("json-link-to-device", ["--dry-run", "--json", "{tmp}/full.json"], ["--json=", "regular"]),
    ("chart-dangling-link", ["--chart", "{tmp}/dangling.png"], ["--chart=", "broken"]),
    ("chart-proc", ["--chart", "/proc/x.png"], ["--chart=/proc/x.png"]),
    ("chart-link-to-device", ["--chart", "{tmp}/full.png"], ["--chart=", "regular"]),
    # numbers: ASCII only (int() and float() take other digits, "_" and spaces)
    ("world-fullwidth", ["--world", "８"], ["--world=８"]),
    ("world-underscore", ["--world", "1_0"], ["--world=1_0"]),
    ("world-space", ["--world", " 8"], ["--world=' 8'"]),
    ("world-superscript", ["--world", "²"], ["--world=²"]),
    ("nodes-arabic-indic", ["--nodes", "٢"], ["--nodes=٢"]),
    ("gpus-per-node-hex", ["--gpus-per-node", "0x8"], ["--gpus-per-node=0x8"]),
    ("mfu-fullwidth", ["--mfu", "０.5"], ["--mfu=０.5"]),
    ("mfu-underscore", ["--mfu", "0.4_5"], ["--mfu=0.4_5"]),
    ("reserve-arabic-indic", ["--reserve", "٠.١"], ["--reserve=٠.١"]),
    ("ib-gbps-inner-space", ["--ib-gbps", "5 0"], ["--ib-gbps=5 0"]),
    ("nvlink-gbps-underscore", ["--nvlink-gbps", "450_0"], ["--nvlink-gbps=450_0"]),
    ("top-superscript", ["--search", "--world", "8", "--top", "²"], ["--top=²"]),
    ("top-exponent", ["--search", "--world", "8", "--top", "1e2"], ["--top=1e2"]),
    # counts whose work would never end
    ("verify-top-too-many", ["--search", "--verify", "--world", "8", "--top", str(MAX_VERIFY + 1)],
     [f"--top={MAX_VERIFY + 1}", f"at most {MAX_VERIFY}"]),
    ("measure-beyond-memory", ["--measure", "--world", "8", *BIG_MODEL],
     ["--measure", "GiB available", "--dry-run"]),
    ("gpu-wrong-case", ["--gpu", "H100"], ["--gpu"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("bad_plan_inputs")
    (root / "afile").write_text("not a directory\n")
    for name in ("dangling.json", "dangling.png"):
        os.symlink(str(root / "missing" / name), str(root / name))
    for name in ("full.json", "full.png"):
        os.symlink("/dev/full", str(root / name))
    os.mkfifo(str(root / "fifo.json"))
    return str(root)


def _refused(argv, capsys) -> str:
    try:
        code = main(["--config", SMOKE, *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert "Fix: " in err and out == "", (out, err)  # before any work: nothing printed
    return err


@pytest.mark.parametrize("case, args, words", CASES, ids=[c[0] for c in CASES])
def test_a_bad_planner_input_is_one_line_naming_the_flag(tmp, capsys, case, args, words):
    err = _refused([a.replace("{tmp}", tmp) for a in args], capsys)
    assert all(w in err for w in words), (words, err)


def test_the_table_holds_forty_inputs():
    assert len({c[0] for c in CASES}) == len(CASES) >= 40


def _cfg(*overrides: str):
    return validate(load_config(SMOKE, list(overrides)), 2 if "parallel.pp=2" in overrides else 1)


def test_the_dry_runs_count_is_the_schedules_rule_for_every_count():
    """Every count from 1 to M is accepted exactly when the schedule's rule accepts it (the
    rule validation checks train.global_batch_size with), for 1F1B, interleaved and DualPipeV."""
    from megatron_lite.pipeline.schedules import microbatches_problem

    for layout in (PP2, VPP2, VPP2_V):
        cfg = _cfg(*layout, "train.global_batch_size=24")
        p = cfg.parallel
        for n in range(1, 13):
            ok = microbatches_problem(p.pp, n, p.vpp, p.pipeline_schedule) is None
            if ok:
                assert dry_run_microbatches(cfg, str(n)) == n
            else:
                with pytest.raises(ConfigError, match=f"--microbatches={n}: "):
                    dry_run_microbatches(cfg, n)
        assert dry_run_microbatches(cfg, "all") == 12
        assert dry_run_microbatches(cfg, "steady") == steady_microbatches(cfg) == 4


def test_the_python_api_refuses_a_count_the_schedule_cannot_run():
    """dry_run() (also tools/bench_dry_run.py's entry) checks the count before any rank runs."""
    from megatron_lite.plan.dry_run import dry_run

    cfg = _cfg("parallel.pp=2")
    with pytest.raises(ConfigError, match="--microbatches=1: num_microbatches=1 must be >= pp=2"):
        dry_run(cfg, 2, [0], microbatches=1)
    with pytest.raises(ConfigError, match="--microbatches=True"):
        dry_run(cfg, 2, [0], microbatches=True)


def test_a_write_that_fails_keeps_the_old_file_and_names_the_flag(tmp_path):
    """A full disk after the dry run: one ConfigError naming the flag; the old file is as it
    was and no temporary is left beside it."""
    out = tmp_path / "dry.json"
    out.write_text("old\n")

    def full(path: str) -> None:
        with open(path, "w") as f:
            f.write("partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(ConfigError, match=r"--json=.*dry\.json: could not be written \(No space"):
        write_output("--json", str(out), full)
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["dry.json"]
    write_output("--json", str(out), lambda p: open(p, "w").write("new\n"))
    assert out.read_text() == "new\n" and os.listdir(tmp_path) == ["dry.json"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)  # not the temporary's private mode
