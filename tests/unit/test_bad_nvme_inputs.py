"""Bad NVMe offload inputs are errors naming the key or the path, before any process group
(config validation, the machine checks train and launch run after it, build_data_parallel's
argument checks), or at build time for the buffer (the pieces decide its minimum); nvme keys
without nvme offload warn that they do nothing."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from torch import nn

from megatron_lite.config import ConfigError, load_config
from megatron_lite.parallel.data_parallel import DataParallelArgumentError, build_data_parallel
from megatron_lite.parallel.data_parallel.arguments import check_nvme_buffer
from megatron_lite.validation import check_hardware, validate
from megatron_lite.validation.inactive import config_warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
NVME = ["train.optimizer_offload=nvme", "parallel.zero_stage=1"]


def _error(overrides: list[str]) -> str:
    """The message of validate(), then check_hardware() (the path rules: the machine's)."""
    with pytest.raises(ConfigError) as err:
        check_hardware(validate(load_config(SMOKE, overrides), 1))
    return str(err.value)


def test_a_missing_path_is_a_machine_rule(tmp_path):
    """validate() passes (a login node plans a job for a drive it lacks); check_hardware, which
    train and launch run before any process group, refuses."""
    over = [*NVME, f"train.nvme_path={tmp_path / 'nowhere'}"]
    validate(load_config(SMOKE, over), 1, warn=False)
    assert "does not exist" in _error(over)


def test_nvme_without_a_path(tmp_path):
    msg = _error(NVME)
    assert "train.nvme_path=None: must name a directory" in msg and "Fix:" in msg, msg


def test_nvme_path_missing(tmp_path):
    path = tmp_path / "nowhere"
    msg = _error([*NVME, f"train.nvme_path={path}"])
    assert f"train.nvme_path='{path}': does not exist" in msg, msg


def test_nvme_path_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    msg = _error([*NVME, f"train.nvme_path={path}"])
    assert f"train.nvme_path='{path}': is not a directory" in msg, msg


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write: a read-only tmpfs as root (permissions do not
    stop root), else one without write permission."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                           capture_output=True)  # fmt: skip
    if mount.returncode:
        pytest.skip(f"root without mount: {mount.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def test_nvme_path_read_only(read_only_dir):
    msg = _error([*NVME, f"train.nvme_path={read_only_dir}"])
    assert f"train.nvme_path='{read_only_dir}': is not writable" in msg, msg


def test_nvme_with_zero3_is_refused(tmp_path):
    msg = _error(["train.optimizer_offload=nvme", "parallel.zero_stage=3",
                  f"train.nvme_path={tmp_path}"])  # fmt: skip
    assert "train.optimizer_offload='nvme': optimizer offload is for zero_stage 0-2" in msg, msg


def test_nvme_buffer_must_be_positive(tmp_path):
    msg = _error([*NVME, f"train.nvme_path={tmp_path}", "train.nvme_buffer_mb=0"])
    assert "train.nvme_buffer_mb=0: must be >= 1" in msg, msg


def test_nvme_keys_without_nvme_warn(tmp_path):
    cfg = validate(load_config(SMOKE, [f"train.nvme_path={tmp_path}"]), 1, warn=False)
    warned = [w for w in config_warnings(cfg) if "train.nvme_path" in w]
    assert len(warned) == 1 and "train.optimizer_offload=none" in warned[0], warned


def test_api_nvme_needs_a_path():
    model = nn.Linear(4, 4)
    with pytest.raises(DataParallelArgumentError) as err:
        build_data_parallel([model], None, zero_stage=1, offload="nvme")
    assert err.value.arg == "nvme_path", err.value
    missing = f"/nonexistent-{uuid.uuid4().hex}"
    with pytest.raises(DataParallelArgumentError, match="nvme_path=.*does not exist"):
        build_data_parallel([model], None, zero_stage=1, offload="nvme", nvme_path=missing)


def test_buffer_smaller_than_the_largest_piece_names_both_sizes():
    sizes = [3 << 20, 12 << 20, 1 << 20]  # bytes of each piece's master and states
    with pytest.raises(DataParallelArgumentError) as err:
        check_nvme_buffer("DataParallel", 8, sizes, 8 << 20)
    msg = str(err.value)
    assert "nvme_buffer_mb=8" in msg and "8.0 MiB" in msg and "12.0 MiB" in msg, msg
    assert "pass nvme_buffer_mb >= 12 (train.nvme_buffer_mb" in msg, msg
    check_nvme_buffer("DataParallel", 12, sizes, 12 << 20)  # exactly the largest: fine
