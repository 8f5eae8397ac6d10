"""log.tensorboard=true: the event files hold what metrics.jsonl holds, read back with
TensorBoard's own reader (EventAccumulator): every numeric field at every step, after a run and
after a resume from an earlier checkpoint that redoes logged steps; a run from step 0 moves an
earlier run's event files aside; without the tensorboard package every entry point refuses the
config before any process group exists, naming the key and the install command."""

import json
import os
import sys

import numpy as np
import pytest

from megatron_lite import launch, train
from megatron_lite.config import ConfigError, load_config
from megatron_lite.training.tensorboard import TensorBoardSink, event_files
from megatron_lite.validation import validate
from tests.dist_harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
TINY = ["model.vocab_size=256", "model.num_layers=2", "model.hidden_size=32",
        "model.num_attention_heads=4", "model.ffn_hidden_size=64", "model.seq_length=16",
        "train.micro_batch_size=2", "train.global_batch_size=4", "data.mock=true",
        "log.progress=false", "log.tensorboard=true", "train.eval_interval=2",
        "train.eval_iters=1", "train.save_interval=2"]  # fmt: skip


def read_events(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the scalars in `log_dir` as TensorBoard shows them (its event
    reader, with its purging of steps a restarted run redid)."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    acc = EventAccumulator(log_dir, size_guidance={SCALARS: 0})  # 0: keep every event
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def numeric_by_tag(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's numeric fields as {field: [(step, value)]}, each value rounded to the
    float32 the event proto stores (a bool as 0/1)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, int | float):
                out.setdefault(k, []).append((r["step"], float(np.float32(v))))
    return out


def assert_same(events, records, where: str) -> None:
    expected = numeric_by_tag(records)
    assert set(events) == set(expected), (
        f"{where}: tags only in the event files {sorted(set(events) - set(expected))}, "
        f"only in metrics.jsonl {sorted(set(expected) - set(events))}"
    )
    for tag, series in expected.items():
        got = [(s, float(np.float32(v))) for s, v in events[tag]]
        assert got == series, f"{where}: {tag}: event files {got} != metrics.jsonl {series}"


def _train(rank, world, runs, out_dir):
    """Each of `runs` (override lists) trained in turn in `out_dir`, as train.main would."""
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    for overrides in runs:
        cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
        Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab).train()


def test_event_files_hold_the_metrics_records_through_a_resume(tmp_path):
    """A 4-step run (eval and checkpoint every 2 steps), then a run resumed from the step-2
    checkpoint to step 5: it redoes steps 2 and 3, whose timings differ from the first run's,
    so event files that kept both runs' values disagree with metrics.jsonl."""
    out = str(tmp_path / "run")
    first = [*TINY, "train.steps=4"]
    resumed = [
        *TINY,
        "train.steps=5",
        f"train.resume={out}/checkpoints/step_2",
        "train.overwrite=true",
    ]  # moves step_4 aside; metrics.jsonl stays (copied)
    run_ranks(1, _train, [first], out, timeout=120)
    log_dir = os.path.join(out, "tensorboard")
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "eval_loss" in records[1] and "mem/weights" in records[0], records[1]
    before = read_events(log_dir)
    assert_same(before, records, "after the first run")
    run_ranks(1, _train, [resumed], out, timeout=120)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    after = read_events(log_dir)
    assert after["step_time_s"][2:4] != before["step_time_s"][2:4], "steps 2-3 not redone"
    assert_same(after, records, "after the resume")
    assert len(event_files(log_dir)) == 2, os.listdir(log_dir)


def test_run_from_step_zero_moves_earlier_event_files_aside(tmp_path):
    log_dir = str(tmp_path / "tb")
    for loss in (9.0, 1.0):
        sink = TensorBoardSink(log_dir)
        for step in range(3):
            sink.write({"step": step, "loss": loss + step, "skipped": True}, first_step=0)
        sink.close()
    assert read_events(log_dir) == {
        "loss": [(0, 1.0), (1, 2.0), (2, 3.0)],
        "skipped": [(0, 1.0), (1, 1.0), (2, 1.0)],
    }
    (aside,) = [n for n in os.listdir(log_dir) if n.startswith("overwritten-")]
    assert read_events(os.path.join(log_dir, aside))["loss"] == [(0, 9.0), (1, 10.0), (2, 11.0)]


# ------------------------------------------------------------------ without the package
@pytest.fixture
def no_tensorboard(monkeypatch, tmp_path):
    """tensorboard not installed (its import fails), and no training may start."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def started(*_):
        raise AssertionError("log.tensorboard=true without tensorboard passed validation")

    monkeypatch.setattr(train, "init_distributed", started)
    monkeypatch.setattr(os, "execvpe", started)


NEEDLE = 'log.tensorboard=True: needs the package tensorboard, which is not installed. Fix: pip install -e ".[tensorboard]"'  # noqa: E501


def _exit_2(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err


def test_missing_tensorboard_is_refused_by_every_entry_point(no_tensorboard, tmp_path, capsys):
    with pytest.raises(ImportError):
        import tensorboard  # noqa: F401 (the fixture works)
    on = ["--config", SMOKE, "log.tensorboard=true"]
    assert NEEDLE in _exit_2(train.main, on, capsys)  # a CLI override
    assert NEEDLE in _exit_2(launch.main, ["--check", *on], capsys)
    assert NEEDLE in _exit_2(launch.main, on, capsys)
    yaml_file = tmp_path / "tb.yaml"
    with open(SMOKE) as f:
        yaml_file.write_text(f.read() + "log:\n  tensorboard: true\n")
    assert NEEDLE in _exit_2(train.main, ["--config", str(yaml_file)], capsys)  # a config file
    with pytest.raises(ConfigError, match="needs the package tensorboard") as e:
        validate(load_config(SMOKE, ["log.tensorboard=true"]), 1)  # the Python API
    assert "or set log.tensorboard=false" in str(e.value)
    validate(load_config(SMOKE, []), 1)  # off: tensorboard is not needed


def test_tensorboard_dir_is_checked_and_warned_about(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = load_config(SMOKE, ["log.tensorboard=true", f"log.tensorboard_dir={afile}/tb"])
    with pytest.raises(ConfigError, match=f"log.tensorboard_dir='{afile}/tb': lies under"):
        validate(cfg, 1)
    from megatron_lite.validation import config_warnings

    cfg = load_config(SMOKE, [f"log.tensorboard_dir={tmp_path}"])
    assert any("log.tensorboard_dir" in w and "log.tensorboard is false" in w
               for w in config_warnings(validate(cfg, 1, warn=False)))  # fmt: skip


def test_failed_event_write_stops_the_run_like_metrics_jsonl(tmp_path):
    """A full disk under the event files: the logger keeps the error naming the directory (the
    trainer stops the run on it at the next step, as for metrics.jsonl) and stops writing
    events; metrics.jsonl goes on."""
    from megatron_lite.training.logging import MetricsLogger

    cfg = load_config(None, [f"train.out_dir={tmp_path}", "log.tensorboard=true",
                             "log.progress=false"])  # fmt: skip
    logger = MetricsLogger(cfg, active=True)
    logger.log({"step": 0, "loss": 1.0}, first_step=0)
    (sink,) = [s for s in logger.sinks if isinstance(s, TensorBoardSink)]

    def full(*_):
        raise OSError(28, "No space left on device")

    sink.writer.flush = full
    logger.log({"step": 1, "loss": 2.0}, first_step=0)
    logger.log({"step": 2, "loss": 3.0}, first_step=0)
    logger.close()
    e = logger.error
    assert (e.errno, e.filename) == (28, str(tmp_path / "tensorboard")), e
    assert logger.failed == [sink]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2]
