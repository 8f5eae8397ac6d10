"""The real CLI end to end: user errors end in one paragraph (exit 2, no traceback) before any
process group exists, and a torchrun launch of the quickstart trains and writes its run
directory."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")


def _run(args, env=None, timeout=120):
    env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (
            ["megatron_lite.train", "--config", SMOKE, "parallel.tp=3"],
            {"WORLD_SIZE": "3"},
            "parallel.tp=3: model.num_attention_heads=4 must be divisible by tp",
        ),
        (
            ["megatron_lite.train", "--config", SMOKE, "parallel.tp=2", "parallel.dp=2"],
            {"WORLD_SIZE": "3"},
            "world size 3 must equal tp·pp·cp·dp = 2·1·1·2 = 4",
        ),
        (
            ["megatron_lite.launch", "--config", SMOKE, "model.num_layer=3"],
            {},
            "unknown config key 'model.num_layer'. Did you mean 'model.num_layers'?",
        ),
        (
            [
                "megatron_lite.launch",
                "--config",
                SMOKE,
                "data.mock=false",
                "data.paths=[/nonexistent/corpus]",
            ],
            {},
            "file /nonexistent/corpus.bin does not exist",
        ),
        (
            ["megatron_lite.launch", "--config", "/nonexistent/c.yaml"],
            {},
            "config file '/nonexistent/c.yaml' does not exist",
        ),
    ],
)
def test_user_errors_are_one_paragraph(args, env, needle):
    r = _run(args, env)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.strip().count("\n") == 0, f"more than one paragraph:\n{r.stderr}"


def test_truncated_dataset_is_reported_by_name(tmp_path):
    from megatron_lite.data import IndexedDatasetBuilder

    prefix = str(tmp_path / "docs")
    with IndexedDatasetBuilder(prefix) as b:
        for i in range(4):
            b.add_document(list(range(i, i + 50)))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(30)
    r = _run(
        ["megatron_lite.launch", "--config", SMOKE, "data.mock=false", f"data.paths=[{prefix}]"]
    )
    assert r.returncode == 2 and "docs.bin" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow  # in CI's slow tier (bash tests/run.sh -m slow): keeps the suite under 10 min
def test_quickstart_trains_under_torchrun_and_writes_run_dir(tmp_path):
    """The README's main job, shortened, in one launch: the launcher runs torchrun with the
    quickstart layout's 8 ranks (tp2+SP x pp2 x dp2, ZeRO-1) on the real corpus from the shared
    cache (fetched and tokenized on first use; `bash quickstart.sh`, CI's first command, does
    it on a fresh clone), prints the rank map and progress, writes metrics.jsonl and the
    resolved config, and logs to wandb offline without a network."""
    out = tmp_path / "run"
    r = _run(
        [
            "megatron_lite.launch",
            "--config",
            os.path.join(ROOT, "configs/quickstart.yaml"),
            "train.steps=3",
            "log.interval=1",
            "log.wandb=true",
            f"train.out_dir={out}",
        ],
        env={"WANDB_SILENT": "true"},
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rank map" in r.stdout and "step     3/3" in r.stdout, r.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [0, 1, 2]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                "comm_bytes/all_gather", "comm_bytes/reduce_scatter"):  # fmt: skip
        assert key in records[0], key
    assert records[0]["loss"] > 7.5, records  # ~ln(4096) at the start
    assert (out / "config.yaml").exists()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb")), list((out / "wandb").iterdir())


@pytest.mark.parametrize(
    "local_rank, visible, device", [(3, 8, 3), (3, 1, 0), (0, 1, 0), (7, 8, 7)]
)
def test_each_rank_picks_its_gpu(local_rank, visible, device):
    """All of the node's GPUs visible: the local rank's; one GPU bound per rank (Slurm
    --gpus-per-task=1): device 0, not the local rank (which does not exist there)."""
    from megatron_lite.train import local_device

    assert local_device(local_rank, visible) == device


def test_more_ranks_than_gpus_is_an_error_naming_the_fix():
    from megatron_lite.config import ConfigError
    from megatron_lite.train import local_device

    with pytest.raises(ConfigError, match="local rank 4 sees 4 GPUs.*Fix: start one rank per GPU"):
        local_device(4, 4)


# ---------------------------------------------------------------- the launcher's own flags
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


@pytest.mark.parametrize(
    "argv, check, restarts, train_argv",
    [
        (["--check", "--max-restarts", "1", "--config", "Q"], True, 1, ["--config", "Q"]),
        (["--max-restarts=1", "--config", "Q"], False, 1, ["--config", "Q"]),
        (["--config", "Q", "--max-restarts", "2", "a=1"], False, 2, ["--config", "Q", "a=1"]),
        (["--check", "--check", "--config", "Q"], True, 0, ["--config", "Q"]),
        (["a=1", "--config", "Q", "--check", "b=2"], True, 0, ["--config", "Q", "a=1", "b=2"]),
        (["--max-restarts", "1", "--max-restarts", "1"], False, 1, []),
        (["--max-restarts", "0", "--config", "Q"], False, 0, ["--config", "Q"]),
    ],
)
def test_launcher_flags_anywhere_leave_the_train_arguments(argv, check, restarts, train_argv):
    from megatron_lite.launch import split_launcher_args

    launcher, rest = split_launcher_args(argv)
    assert (launcher.check, launcher.max_restarts, rest) == (check, restarts, train_argv)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--max-restarts", "-1"], "--max-restarts='-1'"),
        (["--max-restarts=-1"], "--max-restarts='-1'"),
        (["--max-restarts", "1.5"], "--max-restarts='1.5'"),
        (["--max-restarts", "abc"], "--max-restarts='abc'"),
        (["--max-restarts", ""], "--max-restarts=''"),
        (["--max-restarts", "\u0661"], "--max-restarts='\u0661'"),  # an Arabic-Indic 1
        (["--max-restarts", "\u00b2"], "--max-restarts='\u00b2'"),  # superscript 2
        (["--max-restarts", " 1"], "--max-restarts=' 1'"),
        (["--max-restarts", "1_0"], "--max-restarts='1_0'"),
        (["--max-restarts", "1234567890"], "--max-restarts='1234567890'"),
        (["--config", "Q", "--max-restarts"], "--max-restarts: expected one argument"),
        (["--max-restarts", "--check"], "--max-restarts: expected one argument"),
        (["--max-restarts", "1", "--max-restarts", "2"], "--max-restarts given twice"),
        (["--config", "Q", "--foo"], "unrecognized arguments: --foo"),
        (["--max", "1"], "unrecognized arguments: --max"),
        (["--chec"], "unrecognized arguments: --chec"),
        (["--check=yes"], "--check: ignored explicit argument 'yes'"),
        (["--config", "a.yaml", "--config", "b.yaml"], "--config given twice"),
        (["--config"], "--config: expected one argument"),
        (["-x", "--config", "Q"], "unrecognized arguments: -x"),
    ],
)
def test_bad_launcher_flag_is_one_line_naming_it(argv, flag, capsys):
    from megatron_lite.launch import split_launcher_args

    with pytest.raises(SystemExit) as e:
        split_launcher_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and flag in err and "Fix: " in err, err
    assert err.strip().count("\n") == 0, f"more than one line:\n{err}"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--config", "a.yaml", "--config", "b.yaml"], "--config given twice"),
        (["--config", "Q", "--max-restarts", "1"], "unrecognized arguments: --max-restarts"),
        (["--conf", "Q"], "unrecognized arguments: --conf"),
    ],
)
def test_bad_train_flag_is_one_line_naming_it(argv, flag, capsys):
    """The train CLI (torchrun -m megatron_lite.train) has no launcher flags."""
    from megatron_lite.train import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and err.count("\n") == 1, err


def test_check_with_max_restarts_prints_the_torchrun_command():
    """The form that failed with 'megatron_lite.train: unrecognized arguments: --check'."""
    r = _run(["megatron_lite.launch", "--check", "--max-restarts", "1", "--config", QUICKSTART])
    assert r.returncode == 0, r.stdout + r.stderr
    want = "would run: torchrun --standalone --nproc-per-node=8 --max-restarts=1 -m "
    assert want + f"megatron_lite.train --config {QUICKSTART}\n" in r.stdout, r.stdout


def test_launch_warns_when_torchruns_shared_store_is_off(monkeypatch, capsys, tmp_path):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 brings back the port race: the launcher names it."""
    from megatron_lite import launch

    ran = []
    monkeypatch.setattr(launch.supervise, "run", lambda cmd, env: ran.append(env) or 0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with pytest.raises(SystemExit) as e:
        launch.main(["--max-restarts", "1", "--config", SMOKE, f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert e.value.code == 0 and len(ran) == 1, err
    assert "[launch] warning: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: " in err, err
    assert "Fix: unset it" in err, err
