"""Checkpoint faults with the real Trainer on forked gloo ranks (tiny model, mock data): a
crafted `.metadata` is refused under train.resume and train.init_from with nothing executed;
a save that fails on one rank is reported on every rank as a write naming the path, and the
previous checkpoint still resumes; a torn metrics line and a stale `latest` do not stop
resume=auto, which takes the newest committed step; when every checkpoint is damaged the run
stops listing them; resume=none over checkpoints is refused, and overwrite moves them aside; a
metadata.json of the wrong shape is damage on every rank (named, or passed over by auto); a
full disk under a save or under metrics.jsonl names the file and "No space left on device"."""

import errno
import io
import json
import os
import shutil

import pytest

from megatron_lite.checkpoint import files
from tests.crafted_checkpoint import craft_metadata
from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY

SMALL = [*TINY, "model.num_layers=2", "data.mock=true", "train.save_interval=2"]


class FillingFile(io.FileIO):
    """A file on a disk that fills after `room` bytes: raw writes beyond fail with ENOSPC,
    below Python's buffers and torch's serializer (a full disk without a small mount)."""

    def __init__(self, path, mode, room: int):
        super().__init__(path, mode)
        self.room = room

    def write(self, b):
        if self.tell() + len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(b)


def _train(rank, world, overrides, out_dir, fail_save_at):
    """Train; returns ("ok", steps trained) or ("error", exception type, message) per rank.
    `fail_save_at`: the last rank's writes into that step's save fail (EIO from fsync;
    (step, "full disk"): ENOSPC while it writes its data file)."""
    from megatron_lite.checkpoint.errors import CheckpointError
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    try:
        trainer = Trainer(cfg, mesh, dataset, vocab)
        if isinstance(fail_save_at, tuple) and rank == world - 1:  # (step, "full disk")
            # the disk fills while the rank writes its data file of that save: the file's
            # raw writes (below DCP and torch's serializer) fail with ENOSPC past 4 KiB
            import pathlib

            path_open, victim = pathlib.Path.open, f".tmp-step_{fail_save_at[0]}/__"

            def full_disk_open(self, mode="r", *args, **kwargs):
                if "w" in mode and victim in str(self):
                    return io.BufferedWriter(FillingFile(str(self), mode, room=4096))
                return path_open(self, mode, *args, **kwargs)

            pathlib.Path.open = full_disk_open
        elif fail_save_at is not None and rank == world - 1:
            fsync, victim = os.fsync, f".tmp-step_{fail_save_at}"

            def failing_fsync(fd):
                if victim in os.readlink(f"/proc/self/fd/{fd}"):
                    raise OSError(errno.EIO, "Input/output error (injected)")
                return fsync(fd)

            os.fsync = failing_fsync
        return ("ok", [r["step"] for r in trainer.train()])
    except CheckpointError as e:
        return ("error", type(e).__name__, str(e))


def train(world, overrides, out_dir, fail_save_at=None):
    return run_ranks(world, _train, [*SMALL, *overrides], str(out_dir), fail_save_at, timeout=90)


def steps_in_metrics(out_dir) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """4 steps on one rank, checkpoints step_2 and step_4."""
    d = tmp_path_factory.mktemp("base")
    assert train(1, ["train.steps=4"], d) == [("ok", [0, 1, 2, 3])]
    return d


@pytest.fixture
def run(base, tmp_path):
    """A copy of the base run directory to damage."""
    d = tmp_path / "run"
    shutil.copytree(base, d)
    return d


def test_crafted_metadata_is_refused_by_resume_and_init_from(run, tmp_path):
    marker = tmp_path / "code-ran"
    file = craft_metadata(str(run / "checkpoints" / "step_4"), str(marker))
    ((status, kind, msg),) = train(1, ["train.steps=6"], run)  # resume=auto picks step_4
    assert (status, kind) == ("error", "UnsafeCheckpointError"), msg
    assert f"refused to load {file}" in msg
    init = ["train.resume=none", f"train.init_from={run / 'checkpoints' / 'step_4'}"]
    ((status, kind, msg),) = train(1, init, tmp_path / "fresh")
    assert (status, kind) == ("error", "UnsafeCheckpointError") and file in msg, msg
    assert not marker.exists(), "code from the crafted .metadata ran"


def check_write_error(out, ckpt):
    assert out[0] == out[1], f"the ranks disagree: {out}"
    status, kind, msg = out[0]
    assert (status, kind) == ("error", "CheckpointWriteError"), msg
    assert f"could not write checkpoint {ckpt / 'step_4'} (step 4)" in msg
    assert "rank 1: OSError: [Errno 5] Input/output error (injected)" in msg
    assert f"the previous checkpoint {ckpt / 'step_2'} is untouched" in msg
    assert sorted(os.listdir(ckpt)) == [".tmp-step_4", "latest", "step_2"]
    assert files.read_latest(str(ckpt)) == str(ckpt / "step_2")
    files.verify(str(ckpt / "step_2"))  # checksums of every file: untouched by the failure


def test_failed_save_is_a_write_error_on_every_rank_and_the_previous_resumes(tmp_path):
    layout = ["parallel.dp=2", "train.steps=6"]
    check_write_error(train(2, layout, tmp_path, fail_save_at=4), tmp_path / "checkpoints")
    assert train(2, layout, tmp_path) == [("ok", [2, 3, 4, 5])] * 2
    ckpt = sorted(os.listdir(tmp_path / "checkpoints"))
    assert ckpt == ["latest", "step_4", "step_6"], "the unfinished save was not cleaned"


def test_failed_async_save_is_a_write_error_on_every_rank(tmp_path):
    """Reported at the next step boundary that waits for it (here the end of training)."""
    out = train(2, ["parallel.dp=2", "train.steps=4", "train.async_save=true"], tmp_path, 4)
    check_write_error(out, tmp_path / "checkpoints")


@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_names_the_file_and_no_space_left(tmp_path, async_save):
    """A full disk under the save (ENOSPC on rank 1's data file, which torch's serializer
    reports as "enforce fail ... unexpected pos"): every rank's message names that file and
    says no space is left; nothing is committed, the previous checkpoint is untouched."""
    layout = ["parallel.dp=2", "train.steps=6", f"train.async_save={str(async_save).lower()}"]
    out = train(2, layout, tmp_path, fail_save_at=(4, "full disk"))
    assert out[0] == out[1], f"the ranks disagree: {out}"
    status, kind, msg = out[0]
    ckpt = tmp_path / "checkpoints"
    assert (status, kind) == ("error", "CheckpointWriteError"), msg
    assert f"could not write checkpoint {ckpt / 'step_4'} (step 4)" in msg, msg
    assert "No space left on device" in msg and "enforce fail" not in msg, msg
    assert f"{ckpt / '.tmp-step_4' / '__1_0.distcp'}" in msg, msg
    assert files.read_latest(str(ckpt)) == str(ckpt / "step_2")
    files.verify(str(ckpt / "step_2"))


def _train_full_metrics_disk(rank, world, overrides, out_dir):
    """Train with metrics.jsonl on a disk that fills after its first 1500 bytes (its raw
    writes fail with ENOSPC): -> (steps trained, the agreed failure message or None)."""
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import metrics_failure, prepare
    from megatron_lite.training import logging as metrics_logging
    from megatron_lite.training.trainer import Trainer

    def full_disk_open(path, mode="r", *args, **kwargs):
        assert mode == "a", mode  # the logger's append
        return io.TextIOWrapper(io.BufferedWriter(FillingFile(path, "a", room=1500)))

    metrics_logging.open = full_disk_open  # the module's `open` (builtins elsewhere)
    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    trainer = Trainer(cfg, mesh, dataset, vocab)
    steps = [r["step"] for r in trainer.train()]
    failure = metrics_failure(trainer)
    return steps, None if failure is None else str(failure)


def test_full_disk_under_metrics_stops_with_a_checkpoint_and_resumes(tmp_path):
    """metrics.jsonl cannot be written (full disk): rank 0 names it, every rank stops at the
    next step with a checkpoint (exit 2 through train.main), and once there is room the same
    command continues from that checkpoint."""
    layout = [*SMALL, "parallel.dp=2", "train.steps=8", "train.save_interval=100"]
    out = run_ranks(2, _train_full_metrics_disk, layout, str(tmp_path), timeout=90)
    assert out[0] == out[1], f"the ranks disagree: {out}"
    steps, msg = out[0]
    assert msg is not None and len(steps) < 8, out
    metrics = tmp_path / "metrics.jsonl"
    assert msg.startswith(f"could not write {metrics}: No space left on device"), msg
    assert f"Training stopped after step {len(steps)} with a checkpoint" in msg, msg
    assert files.read_latest(str(tmp_path / "checkpoints")) == str(
        tmp_path / "checkpoints" / f"step_{len(steps)}"
    )
    logged = steps_in_metrics_whole(metrics)
    assert logged == list(range(len(logged))) and len(logged) < len(steps), logged
    assert (
        train(2, ["parallel.dp=2", "train.steps=8"], tmp_path)
        == [("ok", list(range(len(steps), 8)))] * 2
    )


def steps_in_metrics_whole(path) -> list[int]:
    """The steps of metrics.jsonl's whole records (a write that failed may leave a torn
    last line: the next run drops it)."""
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            pass
    return out


def test_torn_metrics_line_and_stale_latest_resume_from_the_newest(run):
    metrics = run / "metrics.jsonl"
    before = metrics.read_text()
    with open(metrics, "a") as f:
        f.write('{"step": 4, "loss": 5.')  # died mid-write
    files.set_latest(str(run / "checkpoints"), str(run / "checkpoints" / "step_2"))
    assert train(1, ["train.steps=6"], run) == [("ok", [4, 5])]
    assert steps_in_metrics(run) == [0, 1, 2, 3, 4, 5]
    assert metrics.read_text().startswith(before), "earlier records changed"


def test_every_checkpoint_damaged_stops_and_deletes_nothing(run):
    ckpt = run / "checkpoints"
    for step in (2, 4):
        os.truncate(ckpt / f"step_{step}" / "__0_0.distcp", 10)
    before = sorted(os.walk(ckpt))
    ((status, kind, msg),) = train(1, ["train.steps=6"], run)
    assert (status, kind) == ("error", "CheckpointError"), msg
    assert "none of the 2 checkpoints" in msg and "step_4: " in msg and "step_2: " in msg
    assert sorted(os.walk(ckpt)) == before
    assert steps_in_metrics(run) == [0, 1, 2, 3], "metrics were rewritten"


def test_resume_none_over_checkpoints_is_refused_and_overwrite_moves_them(run):
    out = train(2, ["parallel.dp=2", "train.resume=none"], run)  # refused on every rank
    assert out[0] == out[1], f"the ranks disagree: {out}"
    status, kind, msg = out[0]
    assert (status, kind) == ("error", "RunDirError") and "step_4, step_2" in msg, msg
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_2", "step_4"]
    old = (run / "metrics.jsonl").read_text()
    assert train(1, ["train.resume=none", "train.overwrite=true", "train.steps=2"], run) == [
        ("ok", [0, 1])
    ]
    (aside,) = [n for n in os.listdir(run) if n.startswith("overwritten-")]
    assert sorted(os.listdir(run / aside / "checkpoints")) == ["latest", "step_2", "step_4"]
    assert (run / aside / "metrics.jsonl").read_text() == old
    assert steps_in_metrics(run) == [0, 1]


# metadata.json of the wrong shape (tests/unit/test_checkpoint_metadata.py has the whole table)
MISSHAPEN = {
    "json-array": lambda m: [m],
    "no-kind": lambda m: {k: v for k, v in m.items() if k != "kind"},
    "step-string": lambda m: {**m, "step": "4"},
    "layout-string": lambda m: {**m, "layout": "tp1"},
    "model-config-list": lambda m: {**m, "config": {**m["config"], "model": [1]}},
}


def _each(rank, world, runs):
    """_train for each (overrides, out_dir) in turn, in one process per rank."""
    return [_train(rank, world, overrides, out_dir, None) for overrides, out_dir in runs]


def test_misshapen_metadata_is_damage_on_every_rank(base, tmp_path):
    """Named explicitly, each shape stops both ranks with the same CheckpointError naming the
    file (no AttributeError/KeyError/TypeError); under resume=auto the run falls back to
    step_2 and trains on."""
    runs, meta_files = [], []
    for case, change in MISSHAPEN.items():
        d = tmp_path / case
        shutil.copytree(base, d)
        meta_file = d / "checkpoints" / "step_4" / files.METADATA
        meta_file.write_text(json.dumps(change(json.loads(meta_file.read_text()))))
        resume = f"train.resume={d / 'checkpoints' / 'step_4'}"
        runs.append(([*SMALL, "parallel.dp=2", "train.steps=6", resume], str(d)))
        meta_files.append(str(meta_file))
    auto = tmp_path / "json-array"  # then resume=auto in the first one: step_2, steps 2..5
    runs.append(([*SMALL, "parallel.dp=2", "train.steps=6"], str(auto)))
    results = run_ranks(2, _each, runs, timeout=120)
    assert results[0] == results[1], f"the ranks disagree: {results}"
    for (status, kind, msg), meta_file in zip(results[0][:-1], meta_files, strict=True):
        assert (status, kind) == ("error", "CheckpointError"), msg
        assert msg.startswith(f"{meta_file} is damaged: ") and "Fix:" in msg, msg
    assert results[0][-1] == ("ok", [2, 3, 4, 5]), results[0][-1]
    kept = [n for n in os.listdir(auto / "checkpoints") if n.startswith("step_4.replaced-")]
    assert kept, "the damaged step_4 was deleted, not kept aside, when step 4 was saved again"
