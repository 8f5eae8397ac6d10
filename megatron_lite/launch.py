"""Launch training on one machine: validate the config, prepare the data, then exec torchrun
with as many ranks as the config's layout needs (tp·pp·cp·dp).

    python -m megatron_lite.launch [--max-restarts N] [--check] --config FILE [k=v ...]

`--max-restarts N` lets torchrun restart the whole group up to N times after a rank fails; with
train.resume=auto the restarted ranks continue from the latest checkpoint. `--check` validates
the config (and this machine's GPU backends) for the ranks it needs, prints the torchrun
command, and stops there: no data is prepared and nothing is started.

Validation and data preparation happen here, in one process, so a bad config or data file ends
with one clear message instead of one per rank (and no torchrun failure report).

The ranks' store is torchrun's own: its agent binds the port before starting the ranks and holds
it to the end, so no other process can take it between a choice and a bind, and each restart
works under keys no earlier attempt wrote (megatron_lite/rendezvous.py: group_store). A rank that
cannot join its group prints one line naming itself, what it waited for and the fix.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from megatron_lite import supervise
from megatron_lite.config import ConfigError, load_config
from megatron_lite.train import (
    Once,
    OneLineParser,
    arg_parser,
    parse_args,
    prepare,
    train_argv,
    user_error,
)
from megatron_lite.validation import check_hardware, validate


def world_size_from_config(argv) -> int:
    args = parse_args(argv)
    p = load_config(args.config, args.overrides).parallel
    if p.dp is None:
        raise ConfigError(
            "parallel.dp=None: the launcher needs the data-parallel degree to know "
            "how many ranks to start. Fix: set parallel.dp in the config or on the "
            "command line (e.g. parallel.dp=2)"
        )
    if p.dp < 1:
        raise ConfigError(
            f"parallel.dp={p.dp}: must be >= 1 (it sets how many ranks to start). Fix: set "
            f"parallel.dp=1 or more"
        )
    return p.tp * p.pp * p.cp * p.dp


SHARED_STORE_OFF = (
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torchrun then picks MASTER_PORT by binding a free "
    "port and releasing it, and rank 0 binds it seconds later; another process can take it "
    "first (the start-up fails, and spends a restart). Fix: unset it; megatron_lite keeps "
    "restarts apart on torchrun's shared store"
)
# a count of restarts: ASCII digits only (int() also takes "١", " 1", "1_0"), at most 9 of them
_COUNT = re.compile(r"[0-9]{1,9}")


def launcher_parser() -> argparse.ArgumentParser:
    """The train CLI's arguments (--config, overrides) and the launcher's own flags."""
    p = OneLineParser(
        prog="python -m megatron_lite.launch",
        parents=[arg_parser(add_help=False)],
        allow_abbrev=False,
        description="Validate the config, prepare the data, then run torchrun on this machine "
        "with tp·pp·cp·dp ranks (parallel.dp must be set) of python -m megatron_lite.train.",
    )
    p.add_argument(
        "--max-restarts",
        action=Once,
        metavar="N",
        help="let torchrun restart the whole group up to N times after a rank fails; with "
        "train.resume=auto (the default) it continues from the latest checkpoint",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the config for its ranks (and the GPU backends on this machine), print "
        "the torchrun command and exit: no data is prepared, nothing is started",
    )
    return p


def split_launcher_args(argv) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's own flags (max_restarts as an int), and the arguments of
    megatron_lite.train; a bad or unknown flag exits 2 with one line naming it."""
    p = launcher_parser()
    args = p.parse_intermixed_args(argv)  # exits here on --help
    text = "0" if args.max_restarts is None else args.max_restarts
    if not _COUNT.fullmatch(text):
        p.error(
            f"--max-restarts={text!r}: must be a whole number >= 0 (digits only, at most 9). "
            "Fix: e.g. --max-restarts 1 (0 = no restarts)"
        )
    args.max_restarts = int(text)
    return args, train_argv(args)


def check(argv, world: int) -> None:
    """The config's rules for `world` ranks and the GPU backends here; ConfigError if broken."""
    args = parse_args(argv)
    check_hardware(validate(load_config(args.config, args.overrides), world))


def main(argv=None) -> None:
    launcher, argv = split_launcher_args(sys.argv[1:] if argv is None else argv)
    from megatron_lite.data import DataFileError

    try:
        world = world_size_from_config(argv)
        if launcher.check:
            check(argv, world)
        else:  # first run: download, tokenizer, preprocessing (cached)
            prepare(argv, world_size=world)
    except (ConfigError, DataFileError) as e:
        user_error(e)
    args = ["--standalone", f"--nproc-per-node={world}", f"--max-restarts={launcher.max_restarts}"]
    args += ["-m", "megatron_lite.train", *argv]
    ranks = f"{world} rank" + ("s" if world != 1 else "")
    if launcher.check:
        print(f"[launch] config valid for {ranks}; would run: torchrun {shlex.join(args)}")
        return
    # torchrun's agent, exiting with the ranks' code instead of 1 (megatron_lite/torchrun.py)
    cmd = [sys.executable, "-m", "megatron_lite.torchrun", *args]
    print(f"[launch] {ranks}: {shlex.join(args)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # torchrun's agent holds the ranks' store port for the whole run (no rank binds one), and
    # each restart works under keys of its own (megatron_lite/rendezvous.py: group_store)
    if env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        print(f"[launch] warning: {SHARED_STORE_OFF}", file=sys.stderr, flush=True)
    # SIGTERM / SIGINT / SIGUSR1 here: the ranks checkpoint and stop, exit 0 (supervise.py);
    # otherwise the ranks' exit code (2 a user error, 3 a non-finite step; docs/clusters.md)
    sys.exit(supervise.run(cmd, env))


if __name__ == "__main__":
    main()
