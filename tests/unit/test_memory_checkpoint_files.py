"""In-memory checkpoint files (checkpoint/memory_files.py) and the config rules of
train.memory_checkpoint_interval (validation/memory_checkpoints.py); no process groups."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lite.checkpoint import memory_files as mf
from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import validate


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/w@0,0": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "optim/exp_avg/w@0,0": torch.randn(7, 3, generator=g),
        "optim/step/w": torch.tensor(12),  # 0-d
        "rng/cpu": torch.get_rng_state(),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0, dtype=torch.float64).reshape(3, 4).t(),
    }


def test_copy_round_trips_every_tensor_bitwise(tmp_path):
    state, path = _state(), str(tmp_path / mf.own_name(3, 40))
    size = mf.write_copy(path, {"step": 40, "rank": 3}, state)
    assert os.path.getsize(path) == size and mf.parse_name(os.path.basename(path)) == (3, 40)
    header, head = mf.read_header(path)
    assert header["step"] == 40 and head % mf.ALIGN == 0
    got = mf.tensors_of(mf.open_bytes(path), header, head)
    assert list(got) == list(state)
    for key, want in state.items():
        assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
        assert torch.equal(got[key], want), key
    assert os.listdir(tmp_path) == [os.path.basename(path)], "the temporary was renamed"


def test_truncated_or_foreign_files_are_not_copies(tmp_path):
    path = str(tmp_path / mf.own_name(0, 1))
    mf.write_copy(path, {}, _state())
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match="truncated"):
        mf.read_header(path)
    (tmp_path / "other.bin").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="no magic"):
        mf.read_header(str(tmp_path / "other.bin"))
    (tmp_path / ".tmp-rank0-step2.bin").write_bytes(b"")
    names = [n for _, _, n in mf.listing(str(tmp_path))]
    assert names == ["rank0-step1.bin"], names  # temporaries and strangers are not listed
    assert mf.parse_name(mf.replica_name(5, 9, 6)) == (5, 9)


@pytest.mark.parametrize(
    "value, world, rule",
    [
        (-1, 2, "must be >= 0"),
        (5, 1, "needs a peer rank to hold each rank's replica, and this run has 1 rank"),
    ],
)
def test_bad_interval_names_the_key(value, world, rule):
    cfg = load_config(None, ["data.mock=true", "model.vocab_size=64"])
    cfg.train.memory_checkpoint_interval = value
    cfg.parallel.dp = world
    with pytest.raises(ConfigError) as e:
        validate(cfg, world, warn=False)
    assert str(e.value).startswith(f"train.memory_checkpoint_interval={value}: {rule}"), e.value
