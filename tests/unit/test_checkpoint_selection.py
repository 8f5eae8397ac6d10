"""Which checkpoint resume=auto takes and what pruning may delete, without processes: the
newest committed valid step wins over an older `latest`; every checkpoint damaged stops with
a list (nothing deleted); pruning never deletes a damaged checkpoint or one newer than the
save; re-saving a step keeps the earlier directory."""

import os

import pytest

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.errors import CheckpointError
from tests.unit.test_checkpoint_files import fake_save


def test_auto_takes_the_newest_committed_step_over_latest(tmp_path):
    d = str(tmp_path)
    fake_save(d, 10)
    fake_save(d, 20)
    files.set_latest(d, files.step_dir(d, 10))  # died between the commit and `latest`
    assert files.select_auto(d) == (files.step_dir(d, 20), [])


def test_every_checkpoint_damaged_stops_with_a_list(tmp_path):
    d = str(tmp_path)
    for step in (10, 20):
        os.truncate(os.path.join(fake_save(d, step), "__1_0.distcp"), 3)
    before = sorted(os.listdir(d))
    with pytest.raises(CheckpointError) as e:
        files.select_auto(d)
    msg = str(e.value)
    assert "none of the 2 checkpoints" in msg and "nothing was deleted" in msg
    assert "step_20: checkpoint file" in msg and "step_10: checkpoint file" in msg
    assert msg.index("step_20:") < msg.index("step_10:"), "not listed newest first"
    assert "train.overwrite=true" in msg
    assert sorted(os.listdir(d)) == before


def test_prune_keeps_damaged_and_newer_checkpoints(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30):
        fake_save(d, step, keep=3)
    os.remove(os.path.join(files.step_dir(d, 20), "__0_0.distcp"))  # damaged
    fake_save(d, 40, keep=3)  # 40, 30, 10 intact: keep 3, so nothing goes
    removed, kept = files.prune(d, 2, newest_step=40)
    assert removed == [files.step_dir(d, 10)]
    assert [p for p, _ in kept] == [files.step_dir(d, 20)] and "missing" in kept[0][1]
    assert os.path.isdir(files.step_dir(d, 20)), "a damaged checkpoint was deleted"
    # a save of an earlier step never prunes the newer ones (they are another timeline's)
    removed, _ = files.prune(d, 1, newest_step=30)
    assert removed == [] and os.path.isdir(files.step_dir(d, 40))


def test_resaving_a_step_keeps_the_earlier_directory(tmp_path):
    d = str(tmp_path)
    first = fake_save(d, 10)
    sha = files.sha256_file(os.path.join(first, "__0_0.distcp"))
    fake_save(d, 10)
    (kept,) = [n for n in os.listdir(d) if n.startswith("step_10.replaced-")]
    assert files.sha256_file(os.path.join(d, kept, "__0_0.distcp")) == sha
    assert [s for s, _ in files.list_checkpoints(d)] == [10]
