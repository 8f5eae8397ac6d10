"""tools/convert_checkpoint.py never destroys what a user owns: it refuses a non-empty
directory it did not write (even with --overwrite), any output inside a run's checkpoint folder,
and an output that is or holds its input; it never touches a user's `OUT.tmp`; --overwrite
replaces only its own earlier output. A full disk or a file-size limit is an error naming the
file with the old output intact and nothing left beside it; a kill -9 at each step of a
conversion leaves the old output byte-identical or the new one complete, and the next run
cleans up what the killed one left."""

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

pytest.importorskip("safetensors")

import torch  # noqa: E402

from tests.unit.convert_tiny import snapshot, without_marker, write_hf  # noqa: E402
from tools import convert_checkpoint as convert  # noqa: E402
from tools.convert_output import KILL_AT_ENV, MARKER  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py")]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Two different tiny models, each as an HF directory and as our checkpoint."""
    root = tmp_path_factory.mktemp("src")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        hf = write_hf(root / f"hf_{name}", "llama", seed=seed)
        convert.hf_to_dcp(hf, str(root / f"ckpt_{name}"))
        out[name] = (hf, str(root / f"ckpt_{name}"))
    return out


def _rc(capsys, argv):
    rc = convert.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


def _siblings(path) -> list[str]:
    """Whatever the converter left beside `path` (its temporaries)."""
    parent, name = os.path.split(str(path))
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{name}.convert-"))


def _user_hf_model(path) -> str:
    """A user's HF directory: a new single file beside an older sharded model's shards."""
    write_hf(path, "llama", seed=5)
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (path / name).write_bytes(b"user data " + name.encode())
    return str(path)


@pytest.mark.parametrize("overwrite", [False, True])
def test_dcp_to_hf_never_writes_into_a_users_model(src, tmp_path, capsys, overwrite):
    user = _user_hf_model(tmp_path / "hf_user")
    before = snapshot(user)
    argv = ["dcp-to-hf", src["a"][1], user] + ["--overwrite"] * overwrite
    rc, err = _rc(capsys, argv)
    assert rc == 2 and f"output {user} is a non-empty directory" in err and MARKER in err, err
    assert snapshot(user) == before, "the user's model was changed"
    assert _siblings(user) == []


def test_hf_to_dcp_leaves_a_users_out_tmp_alone(src, tmp_path, capsys):
    out = tmp_path / "out"
    user_tmp = tmp_path / "out.tmp"
    user_tmp.mkdir()
    (user_tmp / "notes.txt").write_text("mine")
    before = snapshot(user_tmp)
    assert _rc(capsys, ["hf-to-dcp", src["a"][0], str(out)])[0] == 0
    assert snapshot(user_tmp) == before
    assert sorted(os.listdir(tmp_path)) == ["out", "out.tmp"]


def _run_dir(path):
    """A training run: checkpoints/step_2 (committed), latest, config.yaml."""
    step = path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text(json.dumps({"kind": "train", "step": 2}))
    (step / "__0_0.distcp").write_bytes(b"weights")
    (path / "checkpoints" / "latest").write_text("step_2\n")
    (path / "config.yaml").write_text("model: {}\n")
    return path


RUN_OUTPUTS = [  # (command, output under the run, --overwrite)
    ("hf-to-dcp", "checkpoints/step_2", False),
    ("hf-to-dcp", "checkpoints/step_2", True),
    ("hf-to-dcp", "checkpoints/step_3", False),
    ("hf-to-dcp", "checkpoints/converted/init", False),
    ("dcp-to-hf", "checkpoints/hf", False),
    ("hf-to-dcp", "checkpoints", False),
]


@pytest.mark.parametrize("cmd, rel, overwrite", RUN_OUTPUTS)
def test_no_output_inside_a_runs_checkpoints(src, tmp_path, capsys, cmd, rel, overwrite):
    run = _run_dir(tmp_path / "run")
    before = snapshot(run)
    source = src["a"][0] if cmd == "hf-to-dcp" else src["a"][1]
    out = str(run / rel)
    rc, err = _rc(capsys, [cmd, source, out] + ["--overwrite"] * overwrite)
    assert rc == 2 and out in err, err
    assert "run checkpoint folder" in err or "non-empty directory" in err, err
    assert snapshot(run) == before, "the run directory was changed"


def test_an_empty_checkpoints_folder_of_a_run_counts(src, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    out = str(run / "checkpoints" / "step_0")
    rc, err = _rc(capsys, ["hf-to-dcp", src["a"][0], out])
    assert rc == 2 and str(run / "checkpoints") in err and "run checkpoint folder" in err, err
    assert os.listdir(run / "checkpoints") == []


def test_overwrite_replaces_only_an_earlier_output(src, tmp_path, capsys):
    from safetensors.torch import load_file

    out = str(tmp_path / "hf")
    assert _rc(capsys, ["dcp-to-hf", src["a"][1], out])[0] == 0
    first = snapshot(out)
    rc, err = _rc(capsys, ["dcp-to-hf", src["b"][1], out])
    assert rc == 2 and "--overwrite" in err and out in err, err
    assert snapshot(out) == first
    assert _rc(capsys, ["dcp-to-hf", src["b"][1], out, "--overwrite"])[0] == 0
    got = load_file(os.path.join(out, "model.safetensors"))
    want = load_file(os.path.join(src["b"][0], "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert _siblings(out) == [] and sorted(os.listdir(tmp_path)) == ["hf"]


def test_other_outputs_that_are_refused(src, tmp_path, capsys):
    hf, ckpt = src["a"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    link = tmp_path / "link"
    (tmp_path / "target").mkdir()
    link.symlink_to(tmp_path / "target")
    cases = [  # (argv, needle)
        (["hf-to-dcp", hf, str(a_file)], "exists and is not a directory"),
        (["hf-to-dcp", hf, str(a_file / "sub")], "is not a directory"),
        (["hf-to-dcp", hf, str(link)], "is a symbolic link"),
        (["hf-to-dcp", hf, os.path.join(hf, "converted")], f"lies inside the input {hf}"),
        (["dcp-to-hf", ckpt, ckpt, "--overwrite"], "is, holds or lies inside the input"),
        (["hf-to-dcp", hf, ""], "is empty"),
    ]
    for argv, needle in cases:
        rc, err = _rc(capsys, argv)
        assert rc == 2 and needle in err, (argv, err)
    assert a_file.read_text() == "x" and os.listdir(tmp_path / "target") == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _rc(capsys, ["hf-to-dcp", hf, str(empty)])[0] == 0  # an empty directory is used
    assert os.path.isfile(empty / "metadata.json")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_a_killed_conversion_are_cleaned_lookalikes_kept(src, tmp_path, capsys):
    from tools.convert_output import write_marker

    out = tmp_path / "out"
    ours = tmp_path / ".out.convert-abcd1234"
    ours.mkdir()
    write_marker(str(ours), "hf-to-dcp", "x", complete=False)
    marker = json.loads((ours / MARKER).read_text())
    marker["writer"]["pid"] = _dead_pid()
    (ours / MARKER).write_text(json.dumps(marker))
    (ours / "__0_0.distcp").write_bytes(b"partial")
    lookalike = tmp_path / ".out.convert-zzzz9999"  # no marker: not provably ours
    lookalike.mkdir()
    (lookalike / "keep").write_text("mine")
    rc, err = _rc(capsys, ["hf-to-dcp", src["a"][0], str(out)])
    assert rc == 0 and f"kept {lookalike}" in err, err
    assert not ours.exists() and (lookalike / "keep").read_text() == "mine"


def test_disk_full_names_the_file_and_keeps_the_old_output(src, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "hf")
    assert _rc(capsys, ["dcp-to-hf", src["a"][1], out])[0] == 0
    before = snapshot(out)

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(convert, "write_atomic", full)  # config.json, after the weights
    rc, err = _rc(capsys, ["dcp-to-hf", src["b"][1], out, "--overwrite"])
    assert rc == 2 and "config.json: No space left on device" in err and out in err, err
    assert snapshot(out) == before and _siblings(out) == []


def _limited(argv, limit, env=None):
    """Run the CLI with a file-size limit of `limit` bytes (SIGXFSZ left at its default: the
    converter must ignore it itself so the write fails with EFBIG instead)."""

    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    return subprocess.run(
        CLI + argv, preexec_fn=preexec, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize("cmd", ["dcp-to-hf", pytest.param("hf-to-dcp", marks=pytest.mark.slow)])
def test_file_size_limit_names_the_file_and_keeps_the_old_output(src, tmp_path, cmd):
    hf, ckpt = src["b"]
    source = ckpt if cmd == "dcp-to-hf" else hf
    out = str(tmp_path / "out")
    assert convert.main([cmd, src["a"][1] if cmd == "dcp-to-hf" else src["a"][0], out]) == 0
    before = snapshot(out)
    p = _limited([cmd, source, out, "--overwrite"], 2048)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "File too large" in p.stderr, p.stderr
    big = "model.safetensors" if cmd == "dcp-to-hf" else ".distcp"
    assert big in p.stderr and out in p.stderr, p.stderr
    assert snapshot(out) == before and _siblings(out) == []


# the main tier kills at the swap and while the old output is removed; the slow tier at the rest
SLOW = pytest.mark.slow
KILL_POINTS = [
    pytest.param("staged", marks=SLOW),
    pytest.param("writing", marks=SLOW),
    pytest.param("complete", marks=SLOW),
    "placed",
    "removing",
]


@pytest.fixture(scope="module")
def new_output(src, tmp_path_factory):
    """What an uninterrupted dcp-to-hf of model b writes (the marker aside)."""
    out = str(tmp_path_factory.mktemp("reference") / "hf")
    assert convert.main(["dcp-to-hf", src["b"][1], out]) == 0
    return without_marker(snapshot(out))


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_9_during_overwrite_leaves_old_or_new_never_a_mix(src, new_output, tmp_path, point):
    out = str(tmp_path / "hf")
    assert convert.main(["dcp-to-hf", src["a"][1], out]) == 0
    old = snapshot(out)
    (tmp_path / "user.txt").write_text("mine")
    argv = ["dcp-to-hf", src["b"][1], out, "--overwrite"]
    p = subprocess.run(CLI + argv, env={**os.environ, KILL_AT_ENV: point}, capture_output=True)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    now = snapshot(out)
    if point in ("placed", "removing"):  # killed after the swap: the new output is complete
        assert without_marker(now) == new_output, point
    else:
        assert now == old, f"killed at {point}: the old output changed"
    assert (tmp_path / "user.txt").read_text() == "mine"
    assert convert.main(argv) == 0  # the next run cleans up and completes
    assert without_marker(snapshot(out)) == new_output and _siblings(out) == []
    assert sorted(os.listdir(tmp_path)) == ["hf", "user.txt"]


@pytest.mark.parametrize(
    "point", ["writing", *(pytest.param(p, marks=SLOW) for p in ("staged", "complete"))]
)
def test_kill_9_before_a_new_checkpoint_is_placed_leaves_nothing(src, tmp_path, point):
    out = str(tmp_path / "ckpt")
    argv = ["hf-to-dcp", src["a"][0], out]
    p = subprocess.run(CLI + argv, env={**os.environ, KILL_AT_ENV: point}, capture_output=True)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    assert not os.path.exists(out), f"killed at {point}: a partial {out} is visible"
    assert convert.main(argv) == 0
    assert _siblings(out) == [] and os.listdir(tmp_path) == ["ckpt"]
    from megatron_lite.checkpoint import files

    assert files.verify(out)["kind"] == "model"
    shutil.rmtree(out)


# A file system without an atomic exchange (e.g. NFS): the old output is renamed aside first.
NO_EXCHANGE = (
    "import sys; sys.path.insert(0, {root!r}); import tools.convert_output as o; "
    "o._renameat2 = lambda src, dst, flags: False; "
    "from tools.convert_checkpoint import main; sys.exit(main(sys.argv[1:]))"
)


def test_without_exchange_overwrite_replaces(src, new_output, tmp_path, capsys, monkeypatch):
    import tools.convert_output as convert_output

    monkeypatch.setattr(convert_output, "_renameat2", lambda src, dst, flags: False)
    out = str(tmp_path / "hf")
    assert _rc(capsys, ["dcp-to-hf", src["a"][1], out])[0] == 0
    assert _rc(capsys, ["dcp-to-hf", src["b"][1], out, "--overwrite"])[0] == 0
    assert without_marker(snapshot(out)) == new_output and _siblings(out) == []


@pytest.mark.slow
def test_without_exchange_a_kill_keeps_the_old_output_restorable(src, new_output, tmp_path, capsys):
    out = str(tmp_path / "hf")
    assert convert.main(["dcp-to-hf", src["a"][1], out]) == 0
    old = snapshot(out)
    argv = ["dcp-to-hf", src["b"][1], out, "--overwrite"]
    driver = [sys.executable, "-c", NO_EXCHANGE.format(root=ROOT)]
    p = subprocess.run(
        driver + argv, env={**os.environ, KILL_AT_ENV: "placed"}, capture_output=True
    )
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    [left] = [os.path.join(tmp_path, n) for n in _siblings(out) if ".convert-old-" in n]
    assert snapshot(left) == old, "the old output is not intact beside the missing one"
    rc, err = _rc(capsys, argv)  # the next run says how to restore it, and converts
    assert rc == 0 and f"restore it with mv {left} {out}" in err, err
    assert without_marker(snapshot(out)) == new_output and snapshot(left) == old
