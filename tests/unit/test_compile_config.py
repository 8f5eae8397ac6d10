"""model.compile / model.compile_mode: a bad mode, a machine without a working C++ compiler
and a torch without inductor are ConfigErrors naming model.compile before any process group;
the CLI prints them as one error line, not a traceback."""

import importlib.util
import os
import subprocess
import sys

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import check_hardware, validate
from megatron_lite.validation.compile import inductor_compilers

BASE = ["data.mock=true", "model.vocab_size=128", "model.compile=true"]


def test_bad_mode_is_rejected():
    with pytest.raises(ConfigError, match="model.compile_mode='fast': must be one of") as e:
        validate(load_config(None, [*BASE, "model.compile_mode=fast"]), 1)
    assert "Fix: " in str(e.value)


def test_compile_defaults_off_and_modes_accepted():
    cfg = validate(load_config(None, BASE[:2]), 1)
    assert cfg.model.compile is False and cfg.model.compile_mode is None
    validate(load_config(None, [*BASE, "model.compile_mode=max-autotune-no-cudagraphs"]), 1)


def test_missing_compiler_is_a_config_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert inductor_compilers() == ("/nonexistent/g++",)
    cfg = validate(load_config(None, BASE), 1)
    with pytest.raises(ConfigError, match=r"model.compile=true: inductor builds .*/nonexistent"):
        check_hardware(cfg)
    monkeypatch.setenv("CXX", sys.executable)  # the probe, like inductor's, runs `--version`
    check_hardware(cfg)


def test_torch_without_inductor_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torch._inductor" else real(n, *a)
    )
    with pytest.raises(ConfigError, match="this torch has no inductor"):
        check_hardware(validate(load_config(None, BASE), 1))


@pytest.mark.slow  # ~20 s: a fresh interpreter imports torch
@pytest.mark.timeout(120)
def test_cli_reports_missing_compiler_without_traceback(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent/g++"}
    args = [sys.executable, "-m", "megatron_lite.train", *BASE, f"train.out_dir={tmp_path}"]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "model.compile=true" in out.stderr and "Traceback" not in out.stderr, out.stderr
