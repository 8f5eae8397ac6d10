"""Launch training on one machine: validate the config, prepare the data, then exec torchrun
with as many ranks as the config's layout needs (tp·pp·cp·dp).

    python -m megatron_lite.launch --config configs/quickstart.yaml [section.key=value ...]

Validation and data preparation happen here, in one process, so a bad config or data file ends
with one clear message instead of one per rank (and no torchrun failure report).
"""

from __future__ import annotations

import os
import shutil
import sys

from megatron_lite.config import ConfigError, load_config, validate
from megatron_lite.train import parse_args, user_error


def world_size_from_config(argv) -> int:
    args = parse_args(argv)
    p = load_config(args.config, args.overrides).parallel
    if p.dp is None:
        raise ConfigError(
            "parallel.dp=None: the launcher needs the data-parallel degree to know "
            "how many ranks to start. Fix: set parallel.dp in the config or on the "
            "command line (e.g. parallel.dp=2)"
        )
    return p.tp * p.pp * p.cp * p.dp


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from megatron_lite.data import DataFileError, build_dataset

    try:
        world = world_size_from_config(argv)
        args = parse_args(argv)
        cfg = validate(load_config(args.config, args.overrides), world)
        build_dataset(cfg)  # first run: download, tokenizer, preprocessing (cached)
    except (ConfigError, DataFileError) as e:
        user_error(e)
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", f"--nproc-per-node={world}", "-m", "megatron_lite.train", *argv]
    print(f"[launch] {world} ranks: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
