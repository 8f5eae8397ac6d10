"""Training entry point.

    torchrun --nproc-per-node N -m megatron_lite.train --config FILE [section.key=value ...]
    python -m megatron_lite.train --config FILE [...]            # one rank

Parses and validates the config and prepares the data before any process group exists, so a
bad config or data file ends with a one-paragraph error (exit code 2) instead of a traceback or
a hang. Under torchrun every rank finds the error; `user_error` makes sure it is printed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from megatron_lite.atomic import write_atomic
from megatron_lite.config import Config, ConfigError, load_config, save_config
from megatron_lite.parallel.nccl_env import set_nccl_env_defaults
from megatron_lite.rendezvous import StartupError, group_store
from megatron_lite.resolve import rank_layout
from megatron_lite.validation import check_hardware, validate


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a missing value) as one line naming the flag,
    exit 2, like every other user error of the CLIs."""

    def error(self, message: str) -> NoReturn:
        fix = "" if ". Fix: " in message else f". Fix: see {self.prog} --help"
        print(f"error: {message}{fix}", file=sys.stderr, flush=True)
        sys.exit(2)


class Once(argparse.Action):
    """A flag that takes a value and may be given twice only with the same value."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        old = getattr(namespace, self.dest)
        if old is not None and old != value:
            parser.error(
                f"{option_string} given twice ({old!r}, then {value!r}): the run would take "
                f"only the last. Fix: give {option_string} once"
            )
        setattr(namespace, self.dest, value)


def arg_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The train CLI's arguments; the launcher's parser extends it (megatron_lite.launch)."""
    p = OneLineParser(
        prog="python -m megatron_lite.train",
        add_help=add_help,
        allow_abbrev=False,
        description="Train a decoder-only transformer with DP x TP x PP x CP x EP parallelism. "
        "Run under torchrun for several ranks; the world size must equal "
        "tp·pp·cp·dp from the config.",
    )
    p.add_argument("--config", action=Once, help="YAML config file (e.g. configs/quickstart.yaml)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, YAML-typed, e.g. train.steps=100 parallel.tp=2",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """--config and overrides in any order (`a=1 --config F b=2` too)."""
    return arg_parser().parse_intermixed_args(argv)


def train_argv(args: argparse.Namespace) -> list[str]:
    """The arguments of megatron_lite.train that give `args` (its --config and overrides)."""
    return (["--config", args.config] if args.config is not None else []) + args.overrides


def prepare(argv=None, world_size: int | None = None, hardware: bool = True):
    """Config + data, no process groups: returns (cfg, dataset, vocab_size) or raises
    ConfigError / DataFileError with a user-facing message. `hardware=False` skips the checks
    that need the ranks' machine (GPU backends), for validating on a login node."""
    from megatron_lite.data import build_dataset, build_valid_dataset

    args = parse_args(argv)
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg = validate(load_config(args.config, args.overrides), world_size)
    if hardware:
        check_hardware(cfg)
    dataset, vocab_size = build_dataset(cfg)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = vocab_size
    if cfg.train.eval_interval > 0:  # build (or check) the validation indices' cache now:
        valid = build_valid_dataset(cfg)  # the launcher does it once, before any rank starts
        cap_eval_iters(cfg, valid)
    return cfg, dataset, cfg.model.vocab_size


def cap_eval_iters(cfg: Config, valid) -> None:
    """train.eval_iters at most the whole global batches the validation set holds (at least
    one): more would evaluate the same samples again. Says so (on rank 0) when it caps."""
    from megatron_lite.data import epoch_samples

    t, samples = cfg.train, epoch_samples(valid)
    if samples is None:  # mock data never repeats
        return
    n, gbs = t.eval_iters, t.global_batch_size
    cap = max(1, samples // gbs)
    warning = None
    if samples < gbs:
        warning = (
            f"train.eval_iters={n}: the validation set's {samples} samples are fewer than one "
            f"global batch of {gbs}; evaluating 1 batch, which repeats samples. Fix: more "
            f"validation data (a larger validation share of data.split, or data.valid_paths)"
        )
    elif n > cap:
        warning = (
            f"train.eval_iters={n}: the validation set's {samples} samples hold {cap} global "
            f"batch(es) of {gbs}; evaluating {cap}, not {n} (more would repeat samples). Fix: "
            f"set train.eval_iters={cap}, or give more validation data"
        )
    if warning and os.environ.get("RANK", "0") == "0":
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    t.eval_iters = min(t.eval_iters, cap)


EXIT_NONFINITE = 3  # training stopped on a NaN/Inf loss or gradient (docs/clusters.md: exit codes)
EXIT_STARTUP = 1  # a rank could not join its process group (its message names what failed)


# Under torchrun every rank finds a config error, and the first rank to exit makes the agent
# SIGTERM the others: so a rank prints before it exits, and the first rank of a node to get
# there claims the report; the others wait to be ended once it exits (on a loaded machine that
# can take seconds), and print themselves only if still alive after this long.
REPORT_WAIT_S = 30.0


def user_error(e: Exception) -> NoReturn:
    """Exit 2 with the one-paragraph message `e`, before any process group exists: printed by
    the process itself, or under torchrun once per node, by whichever rank there gets to the
    error first, before that rank exits."""
    if not _first_to_report():
        time.sleep(REPORT_WAIT_S)
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def _first_to_report() -> bool:
    """Whether this rank reports a user error for its node's ranks: the first to create a claim
    file in torchrun's directory of this attempt (shared by the ranks of one agent, new for each
    restart). True outside torchrun, or if the claim cannot be made: twice beats never."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # <attempt dir>/<local rank>/...
    if error_file is None:
        return True
    claim = os.path.join(os.path.dirname(os.path.dirname(error_file)), "user_error_reported")
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:  # another rank of this node is printing it
        return False
    except OSError:
        return True
    return True


def local_device(local_rank: int, visible: int | None = None) -> int:
    """The CUDA device of this rank: its local rank when it sees all of the node's GPUs,
    device 0 when the launcher binds one GPU per rank (Slurm --gpus-per-task=1)."""
    visible = torch.cuda.device_count() if visible is None else visible
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ConfigError(
            f"local rank {local_rank} sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): more ranks than GPUs on "
            "this node. Fix: start one rank per GPU (nproc_per_node = GPUs per node)"
        )
    return local_rank


def init_distributed(cfg: Config) -> None:
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_device(int(os.environ.get("LOCAL_RANK", "0"))))
        backend = "nccl"
        # NCCL's watchdog and flight recorder, where the user set nothing (parallel/nccl_env.py)
        dump_prefix = os.path.join(os.path.abspath(cfg.train.out_dir), "nccl_trace_rank_")
        set_nccl_env_defaults(os.environ, dump_prefix)
    else:
        backend = "gloo"
    if "RANK" not in os.environ:  # plain `python -m`: a world of one
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:  # torchrun's store under a prefix of this attempt (megatron_lite/rendezvous.py)
        store = group_store(rank, world, timeout)
        if store is None:  # env://: rank 0 hosts a store at MASTER_PORT
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
    except RuntimeError as e:  # StartupError, DistNetworkError, gloo/NCCL's connect errors
        raise StartupError(startup_message(e, rank, timeout)) from None


def startup_message(e: RuntimeError, rank: int, timeout: datetime.timedelta) -> str:
    """One paragraph for a rank that could not join its process group."""
    if isinstance(e, StartupError):
        return str(e)
    text = " ".join(str(e).split())
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (
            f"rank {rank}: could not host the process group's store at {where} (MASTER_ADDR:"
            "MASTER_PORT): another process holds that port (torchrun chose a free port, "
            "released it, and something took it before this rank bound it; torchrun does so "
            "when TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). Fix: unset "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE, so torchrun's agent holds the port for the "
            "ranks (megatron_lite keeps its restarts apart), or give torchrun a free "
            "--master-port"
        )
    return (
        f"rank {rank}: joining the process group through {where} failed: {type(e).__name__}: "
        f"{text[:400]}. Fix: see the other ranks' messages (a rank that failed first ends the "
        f"others' start-up); a peer that starts late needs parallel.timeout_s above its delay "
        f"(now {timeout.total_seconds():g} s)"
    )


def _restore_signal_defaults() -> None:
    """A supervisor (supervise.py) starts torchrun with the stop signals ignored, and ranks
    inherit that: give them back their defaults (training/signals.py installs its handlers)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_together(code: int, error: Exception | None, run_lock=None) -> None:
    """End a rank whose peers stop for the same agreed reason (a user error after the process
    group exists, a non-finite step): rank 0 prints the message, the run directory lock is
    released, and the process group is torn down after a barrier, so no rank aborts on exit."""
    if error is not None and dist.get_rank() == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    if run_lock is not None:
        run_lock.release()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def main(argv=None) -> None:
    _restore_signal_defaults()
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before training started (in training it saves, stops)
        print("interrupted (exit 130)", file=sys.stderr, flush=True)
        os._exit(130)  # no teardown that could wait on peers


def _main(argv) -> None:
    from megatron_lite.data import DataFileError

    try:
        cfg, dataset, vocab_size = prepare(argv)
    except (ConfigError, DataFileError) as e:
        user_error(e)
    try:
        init_distributed(cfg)
    except ConfigError as e:  # more ranks than GPUs: before any process group exists
        user_error(e)
    except StartupError as e:  # no process group: this rank's own line, not a traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STARTUP)
    from megatron_lite.checkpoint.run_dir import RunDirError, claim_run_dir
    from megatron_lite.parallel.mesh import ParallelMesh

    p = cfg.parallel
    layout = rank_layout(p, dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    try:  # one run per directory, before anything is written into it (see run_dir.py);
        # then rank 0 writes the run files (a failed write is part of the verdict)
        run_lock = claim_run_dir(cfg, rank, world, then=lambda: write_run_files(cfg, layout))
    except RunDirError as e:  # rank 0's verdict, broadcast: every rank is here
        exit_together(2, e)
    from megatron_lite.checkpoint import CheckpointError, CheckpointReadError
    from megatron_lite.parallel.mappings import CollectiveError
    from megatron_lite.training.hang_dump import exit_on_collective_error
    from megatron_lite.training.nonfinite import NonFiniteError
    from megatron_lite.training.trainer import Trainer

    mesh = ParallelMesh(layout, timeout_s=p.timeout_s)
    try:
        trainer = Trainer(cfg, mesh, dataset, vocab_size)  # resumes from a checkpoint
    except (CheckpointError, CheckpointReadError) as e:  # agreed across ranks
        exit_together(2, e, run_lock)
    n_params = trainer.num_parameters()
    mem = trainer.memory_report()  # collective
    if dist.get_rank() == 0:
        print(
            f"model: {cfg.model.arch}, {n_params / 1e6:.2f}M parameters, vocab {vocab_size}; "
            f"writing {cfg.train.out_dir}/metrics.jsonl",
            flush=True,
        )
        terms = ", ".join(f"{k[4:]} {v / 2**20:.1f} MiB" for k, v in mem.items())
        total = sum(v for k, v in mem.items() if not k.endswith("_peak")) / 2**20
        stage = f"ZeRO-{p.zero_stage}" + (f", dp_shard={p.dp_shard}" if p.dp_shard else "")
        print(f"model states per rank ({stage}; max over ranks): {terms}; total {total:.1f} MiB")
    try:
        trainer.train()
    except CheckpointError as e:  # a failed save (CheckpointWriteError), raised on every rank
        exit_together(2, e, run_lock)  # the failed save was the last one: nothing is pending
    except NonFiniteError as e:  # every rank saw the same reduced loss and norm
        trainer.checkpointer.finish()
        trainer.signals.restore()
        exit_together(EXIT_NONFINITE, e, run_lock)
    except CollectiveError as e:  # a hang or a dead peer: write hang/rank<R>.json, exit 1
        rank, world = dist.get_rank(), dist.get_world_size()
        exit_on_collective_error(e, cfg.train.out_dir, rank, world, p.timeout_s)
    failure = metrics_failure(trainer)  # rank 0's, agreed (collective)
    # train() waited for the last async save; no rank tears down its connections while a peer
    # may still be finishing a send to it
    exit_together(0 if failure is None else 2, failure, run_lock)


def metrics_failure(trainer) -> RuntimeError | None:
    """Rank 0's failed write of metrics.jsonl (a full disk: the run stopped at the next step,
    saving a checkpoint when train.save_interval > 0) as the user error of every rank."""
    from megatron_lite.parallel import mappings

    box = [None]
    if dist.get_rank() == 0 and trainer.logger.error is not None:
        e, t = trainer.logger.error, trainer.cfg.train
        saved = "with a checkpoint" if t.save_interval > 0 else "without a checkpoint"
        box = [
            f"could not write {e.filename}: {e.strerror}. Training stopped after step "
            f"{trainer.step} {saved}. Fix: free space on that disk (or make train.out_dir "
            "writable), then run the same command (train.resume=auto continues)"
        ]
    mappings.guarded("metrics check", None, lambda: mappings.broadcast_objects(box, 0, None))
    return None if box[0] is None else RuntimeError(box[0])


def write_run_files(cfg: Config, layout) -> None:
    """Rank 0: the resolved config and the rank map in the run directory; the map on screen."""
    os.makedirs(cfg.train.out_dir, exist_ok=True)
    save_config(cfg, os.path.join(cfg.train.out_dir, "config.yaml"))
    rank_map = layout.rank_map()
    write_atomic(os.path.join(cfg.train.out_dir, "rank_map.txt"), rank_map + "\n")
    if layout.world_size > 64:  # thousands of lines help nobody on the console
        rank_map = rank_map.splitlines()[0] + f": see {cfg.train.out_dir}/rank_map.txt"
    print(rank_map, flush=True)


if __name__ == "__main__":
    main()
