"""model.compile's rules: the mode (anywhere), and on the ranks' machine a torch with inductor
and the C++ compiler inductor's CPU backend builds with (also what Triton's launcher stubs need
on a GPU), found before any process group exists rather than as a traceback in step 1."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

from megatron_lite.config import Config, ConfigError
from megatron_lite.validation.rules import _choice

# torch.compile's modes (torch._inductor.list_mode_options); None: inductor's default
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _validate_compile(cfg: Config) -> None:
    _choice("model.compile_mode", cfg.model.compile_mode, COMPILE_MODES)


def inductor_compilers() -> tuple[str, ...]:
    """The C++ compilers inductor tries, in its order: $CXX, else torch._inductor.config.cpp.cxx
    (g++ by default; None entries are its opt-in conda install, skipped here)."""
    if os.environ.get("CXX"):
        return (os.environ["CXX"],)
    from torch._inductor import config

    cxx = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    return tuple(c for c in cxx if c)


def _runs(compiler: str) -> bool:
    path = shutil.which(compiler)
    if path is None:
        return False
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def check_compile_support(cfg: Config) -> None:
    """model.compile=true needs torch's inductor and a working C++ compiler on this machine."""
    if not cfg.model.compile:
        return
    if importlib.util.find_spec("torch._inductor") is None:
        raise ConfigError(
            "model.compile=true: this torch has no inductor (torch._inductor), which compiles "
            "the regions. Fix: install a torch build with inductor (any official wheel), or "
            "set model.compile=false"
        )
    compilers = inductor_compilers()
    if not any(_runs(c) for c in compilers):
        raise ConfigError(
            f"model.compile=true: inductor builds its kernels with a C++ compiler, and none of "
            f"{', '.join(compilers) or '(none configured)'} runs on this machine. Fix: install "
            "one (e.g. apt-get install g++) or point CXX at it, or set model.compile=false"
        )
