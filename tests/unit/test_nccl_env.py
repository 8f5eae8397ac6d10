"""NCCL watchdog and flight recorder defaults (parallel/nccl_env.py): set only where the user set
the variable under none of its names, under the name the running torch reads first."""

import os

import pytest
import torch

from megatron_lite.parallel.nccl_env import set_nccl_env_defaults

PREFIX = "/runs/a/nccl_trace_rank_"


def test_defaults_fill_an_empty_environment_with_the_names_torch_2_9_reads():
    env = {"PATH": "/bin"}
    added = set_nccl_env_defaults(env, PREFIX, "2.13.0+cpu")
    want = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": PREFIX,
    }
    assert added == want
    assert env == {"PATH": "/bin", **want}


def test_older_torch_gets_the_old_flight_recorder_names():
    env = {}
    set_nccl_env_defaults(env, PREFIX, "2.6.0")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == PREFIX
    assert "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_FR_DUMP_TEMP_FILE" not in env


def test_what_the_user_set_under_either_name_is_kept():
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # e.g. torchrun's
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",  # the old name of TORCH_FR_BUFFER_SIZE: off
        "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_",
    }
    before = dict(env)
    added = set_nccl_env_defaults(env, PREFIX, "2.13.0")
    assert added == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert env == {**before, **added}


def test_the_names_are_the_ones_the_installed_torch_reads():
    """The installed torch's own headers name the variables it reads (an independent source)."""
    c10d = os.path.join(os.path.dirname(torch.__file__), "include/torch/csrc/distributed/c10d")
    headers = [os.path.join(c10d, f) for f in ("ProcessGroupNCCL.hpp", "FlightRecorder.hpp")]
    if not all(os.path.exists(h) for h in headers):
        pytest.skip("this torch ships without its c10d headers")
    text = "".join(open(h).read() for h in headers)
    added = set_nccl_env_defaults({}, PREFIX)
    for name in added.keys() - {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}:
        assert f'"{name}"' in text, f"{name} is not a variable torch {torch.__version__} reads"
