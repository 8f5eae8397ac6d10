"""The log.* rules beyond single values: TensorBoard needs its package (an optional extra) and a
writable directory. Checked here, before any process group, so a missing package is one message
up front instead of a traceback on rank 0 once the ranks have started."""

from __future__ import annotations

import importlib.util

from megatron_lite.config import Config
from megatron_lite.validation.paths import check_output_dir
from megatron_lite.validation.rules import _rule

# the extra that brings the package (setup.py)
TENSORBOARD_INSTALL = 'pip install -e ".[tensorboard]"'


def tensorboard_installed() -> bool:
    """The tensorboard package can be imported (found, not imported: an import costs ~1 s)."""
    return importlib.util.find_spec("tensorboard") is not None


def _validate_log(cfg: Config) -> None:
    """log.tensorboard=true: tensorboard is installed and log.tensorboard_dir (or its default,
    <train.out_dir>/tensorboard) can be created or written."""
    log = cfg.log
    if not log.tensorboard:
        return
    _rule(
        tensorboard_installed(),
        "log.tensorboard",
        log.tensorboard,
        "needs the package tensorboard, which is not installed",
        f"{TENSORBOARD_INSTALL} (or pip install tensorboard), or set log.tensorboard=false",
    )
    fix = "choose a writable directory, e.g. log.tensorboard_dir=runs/my_run/tensorboard"
    if not log.tensorboard_dir:
        fix = f'log.tensorboard_dir="" means <train.out_dir>/tensorboard; {fix}'
    check_output_dir("log.tensorboard_dir", log.tensorboard_path(cfg.train.out_dir), fix)
