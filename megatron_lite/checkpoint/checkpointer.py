"""Sharded checkpoints (torch.distributed.checkpoint) with exact and resharding resume.

`Checkpointer(trainer)` is built by the Trainer. It resumes (train.resume: auto | none | path)
or initializes weights from a checkpoint (train.init_from), then saves every
train.save_interval steps, after the last step and at the first step boundary after SIGTERM or
SIGUSR1 (then training stops cleanly). Keeps the newest train.keep_checkpoints.

What a checkpoint holds and how it is cut is in checkpoint_state.py; the directory layout,
atomic commit and checksums in checkpoint_files.py; how each step's errors are agreed across
ranks (so none waits in a collective for one that failed) in rank_agreement.py. Resume semantics:
- same layout: model, AdamW state (moments and step count), the step (= data position, see
  data/sampler.py) and every rank's RNG states are restored, so the run continues bitwise as
  if never stopped (the LR is a function of the step);
- another layout (tp, pp, vpp, cp, dp, ep, sequence_parallel or order differ): model and
  AdamW state are resharded exactly, RNG states are NOT restored (their number and meaning
  depend on the layout): every generator is seeded as at the start of a run, so dropout masks
  differ from an unbroken run; with dropout 0 the losses continue to float rounding.
- init_from: model weights only (step 0, fresh optimizer), e.g. a Hugging Face Llama converted
  with tools/convert_checkpoint.py. A resumable checkpoint in ckpt_dir takes precedence.

Async save (train.async_save) stages a CPU copy at the step boundary and writes on a thread
(DCP's thread executor) over its own gloo group; each rank then checksums what it wrote on a
thread of its own, and rank 0 commits on another. Checksums are per stored tensor chunk, and
resume checks on each rank exactly the chunks it reads; each rank reads its share of its
replica group's tensors and receives the rest (checkpoint_exchange.py). The time the step was
blocked is logged as ckpt_blocked_s.

Safety (see run_dir.py, dcp_metadata.py): the run directory is locked for one run (held until
the last async save is committed); DCP's pickled `.metadata` is read through an allow-list, so
a crafted one is refused (UnsafeCheckpointError) instead of run; resume=auto takes the newest
committed checkpoint whose checksums verify and stops, listing them, when none does; a failed
save raises CheckpointWriteError naming the path on every rank and leaves the previous
checkpoint as it was.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.dcp_metadata import (
    SafeFileSystemReader,
    listing_with_dcp_files,
    planned_reads,
    storage_ranges,
)
from megatron_lite.checkpoint.errors import (
    CheckpointError,
    CheckpointReadError,
    CheckpointWriteError,
)
from megatron_lite.checkpoint.exchange import ParallelRead
from megatron_lite.checkpoint.rank_agreement import RankAgreement, describe_error
from megatron_lite.checkpoint.run_dir import ckpt_dir_of, claim_run_dir
from megatron_lite.checkpoint.state import (
    ShardLoadPlanner,
    ShardSavePlanner,
    add_rng_targets,
    load_targets,
    loaded_rng_states,
    save_state,
    set_rng_states,
)
from megatron_lite.parallel.mappings import CollectiveError, guarded
from megatron_lite.resolve import stage_layers

__all__ = ["Checkpointer", "CheckpointError", "layout_of"]
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # SIGINT (Ctrl-C) as SIGTERM
# model settings that must match the checkpoint's (tensor shapes are checked separately)
FUNCTION_KEYS = ("arch", "num_attention_heads", "norm_eps", "rope_theta", "moe_router_topk")


def layout_of(cfg) -> dict:
    """What makes RNG states and shard shapes layout specific."""
    p = cfg.parallel
    keys = ("tp", "pp", "vpp", "cp", "ep", "dp", "sequence_parallel", "order")
    split = {"stage_layers": stage_layers(cfg.model, p)}  # which layers each rank holds
    return {"world_size": p.tp * p.pp * p.cp * p.dp, **{k: getattr(p, k) for k in keys}, **split}


def _layout_changes(saved: dict, now: dict) -> str:
    """The layout keys that differ from the checkpoint's, as "tp 2->1, dp 1->2"."""
    return ", ".join(f"{k} {saved.get(k)}->{v}" for k, v in now.items() if saved.get(k) != v)


@dataclasses.dataclass
class _LoadJob:
    """A checkpoint being loaded: its metadata, reader and this rank's buffers (see load)."""

    path: str
    meta: dict
    reader: SafeFileSystemReader
    metadata: object  # DCP's Metadata
    buffers: dict
    pieces: dict
    apply: object
    parallel: ParallelRead
    with_optim: bool
    same_layout: bool


def _async_save(state, writer, planner, group):
    """dcp.async_save on a thread (the process executor hangs on CPU); returns a Future."""
    kw = {}
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kw["async_checkpointer_type"] = AsyncCheckpointerType.THREAD
    except ImportError:  # older torch: threads are the only executor
        pass
    out = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group, **kw)
    return getattr(out, "upload_completion", out)


class Checkpointer:
    """Save / resume for one Trainer; every method is called on every rank in the same order."""

    def __init__(self, trainer):
        self.trainer, self.cfg = trainer, trainer.cfg
        t = self.cfg.train
        self.dir = ckpt_dir_of(self.cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        timeout = timedelta(seconds=self.cfg.parallel.timeout_s)
        # DCP's collectives run on a writer thread: they get groups of their own
        self.io_group = dist.new_group(backend="gloo", timeout=timeout, group_desc="ckpt_io")
        self.ctl_group = dist.new_group(backend="gloo", timeout=timeout, group_desc="ckpt_ctl")
        self.ranks = RankAgreement(self.rank, self.world, self.ctl_group)  # errors agreed
        # an async save runs beside training and may take longer than a collective may: its
        # collectives (DCP's, on the writer thread, and the agreement at the next save or at
        # the end) use a group of their own with train.async_save_timeout_s
        slow = timedelta(seconds=max(t.async_save_timeout_s, self.cfg.parallel.timeout_s))
        self.async_group = dist.new_group(backend="gloo", timeout=slow, group_desc="ckpt_async")
        self.async_ranks = RankAgreement(self.rank, self.world, self.async_group)
        self._hasher = ThreadPoolExecutor(1)  # each rank hashes what it wrote, off the step
        self.pending = None  # Future of an async save (rank 0: including the commit)
        self._job: _LoadJob | None = None  # the checkpoint _verify accepted, for load()
        self._candidates: list[str] | None = None  # resume=auto's, listed by will_load()
        self.read_bytes = self.loaded_bytes = 0  # at the last load: read here, and in all
        self.signal_received = None
        self._old_handlers: dict = {}
        self._committer = ThreadPoolExecutor(1) if self.rank == 0 else None
        # one run per directory; a no-op when train.main already holds the lock
        self.run_lock = claim_run_dir(self.cfg, self.rank, self.world, self.ctl_group)

    # ------------------------------------------------------------------ messages
    def _say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {msg}", flush=True)

    # ------------------------------------------------------------------ resume
    def resume(self) -> bool:
        """Apply train.resume / train.init_from (collective); True when weights were loaded."""
        t = self.cfg.train
        try:
            path = self._choose(t.resume, t.init_from)
            if path is not None:
                self.load(self._job)  # prepared and verified by _choose
            return path is not None
        except BaseException:
            if self.run_lock is not None:  # nothing is being saved yet
                self.run_lock.release()
            raise

    def will_load(self) -> bool:
        """Whether resume() will load weights (or raise): a checkpoint to resume exists, or
        train.resume / train.init_from names one (collective). Lets the model skip its
        random init when a checkpoint will fill it."""
        t = self.cfg.train
        if t.resume == "auto":
            self._candidates = self.ranks.from_rank0(lambda: files.auto_candidates(self.dir))
            if self._candidates:
                return True
        return t.resume not in ("auto", "none") or t.init_from is not None

    def _choose(self, resume: str, init_from: str | None) -> str | None:
        """The checkpoint to load, verified and prepared in self._job (collective)."""
        if resume == "auto":
            candidates = self._candidates
            if candidates is None:  # will_load() did not list them
                candidates = self.ranks.from_rank0(lambda: files.auto_candidates(self.dir))
            path, notes = files.select_auto(self.dir, candidates, check=self._verify)
            for note in notes:
                self._say(note)
            if path is not None:
                return path
        elif resume != "none":
            path = self.ranks.from_rank0(lambda: files.resolve(resume))
            self._verify(path)
            return path
        if init_from is not None:
            path = self.ranks.from_rank0(lambda: files.resolve(init_from))
            self._verify(path, model_only=True)
            return path
        return None

    def _verify(self, path: str, model_only: bool = False) -> None:
        """Prepare the load of `path` and check, on every rank, the size of every file and the
        sha256 of exactly the bytes this rank will read (its share of the tensors, see
        checkpoint_exchange.py, and DCP's `.metadata`); raises on every rank: CheckpointError
        for a damaged checkpoint, CheckpointReadError for I/O trouble."""
        job = self._prepare(path, model_only)

        def check():
            stored = job.metadata.state_dict_metadata
            ok = {  # a missing or misshapen tensor is reported by _check_keys at load time
                k
                for k in job.parallel.mine
                if k in stored and tuple(stored[k].size) == job.pieces[k].global_shape
            }
            planner = ShardLoadPlanner({k: job.pieces[k] for k in ok})
            planner.set_up_planner({k: job.buffers[k] for k in ok}, job.metadata)
            reads = planned_reads(job.metadata, planner.create_local_plan())
            files.verify_reads(path, reads, job.meta)

        self.ranks.on_every_rank(check, "checksum check")
        self._job = job

    def _prepare(self, path: str, model_only: bool) -> _LoadJob:
        """Read the checkpoint's metadata and set up the buffers this rank loads into."""
        tr = self.trainer

        def read():
            reader = SafeFileSystemReader(path)
            return files.read_metadata(path), reader, reader.read_metadata()

        meta, reader, metadata = self.ranks.on_every_rank(read, f"reading {path}")
        stored = metadata.state_dict_metadata
        with_optim = meta["kind"] == "train" and not model_only
        same_layout = with_optim and meta["layout"] == layout_of(self.cfg)
        with_master = any(k.startswith("optim/master/") for k in stored)
        buffers, pieces, apply, per_param = load_targets(
            tr.chunks, tr.optimizer, with_optim, with_master
        )
        if same_layout:
            add_rng_targets(buffers, pieces, stored, self.rank)
        parallel = ParallelRead(buffers, per_param, tr.mesh)
        return _LoadJob(
            path, meta, reader, metadata, buffers, pieces, apply, parallel, with_optim, same_layout
        )

    def load(self, job: _LoadJob) -> None:
        """Load a checkpoint that _verify prepared into the trainer (collective): see the
        module doc. Each rank reads its share of its replica group's tensors and receives the
        rest."""
        tr, path = self.trainer, job.path
        self._job = None
        meta, buffers, pieces = job.meta, job.buffers, job.pieces
        self._check_model_config(path, meta["config"].get("model", {}))
        with_optim, same_layout = job.with_optim, job.same_layout
        self._check_keys(path, buffers, pieces, job.metadata.state_dict_metadata)
        mine = sorted(job.parallel.mine)
        try:
            guarded(
                f"dcp.load from {path}",
                self.io_group,
                lambda: dcp.load(
                    {k: buffers[k] for k in mine},
                    storage_reader=job.reader,
                    planner=ShardLoadPlanner({k: pieces[k] for k in mine}),
                    process_group=self.io_group,
                ),
            )
        except CheckpointException as e:  # raised on every rank
            raise CheckpointReadError(f"reading {path}: {describe_error(e, self.rank)}") from None
        job.parallel.exchange(buffers, tr.device)
        self.read_bytes = job.parallel.read_bytes(buffers)
        self.loaded_bytes = sum(t.nbytes for t in buffers.values())
        job.apply()
        if with_optim:
            tr.step = meta["step"]
            tr.consumed_samples, note = files.consumed_samples(meta, self.cfg.train)
            if note:
                self._say(note)
        if same_layout:
            set_rng_states(tr.tracker, loaded_rng_states(buffers, self.rank))
        what = "model weights from" if not with_optim else "resumed from"
        share = f"read {self.read_bytes / 2**20:.1f} of {self.loaded_bytes / 2**20:.1f} MiB here"
        self._say(f"{what} {path} (step {meta['step']}, {share}); now at step {tr.step}")
        if with_optim and not same_layout:
            changed = _layout_changes(meta["layout"], layout_of(self.cfg))
            self._say(
                f"layout changed ({changed}): model and optimizer state resharded; RNG states "
                "re-seeded, not restored (dropout masks differ from an unbroken run)"
            )

    def _check_model_config(self, path: str, saved: dict) -> None:
        """Settings that change what the weights compute without changing their shapes."""
        current = self.cfg.model
        for key in FUNCTION_KEYS:
            if key in saved and saved[key] != getattr(current, key):
                raise CheckpointError(
                    f"model.{key}={getattr(current, key)!r} but checkpoint {path} was saved "
                    f"with {saved[key]!r}. Fix: set model.{key}={saved[key]!r}"
                )

    def _check_keys(self, path: str, buffers: dict, pieces: dict, stored: dict) -> None:
        """Clear errors for missing/mismatched tensors, and for stored model tensors no rank
        loads (the model config differs from the checkpoint's)."""
        error = None
        for key in buffers:
            if key not in stored:
                error = f"checkpoint {path} has no tensor {key!r}"
            elif tuple(stored[key].size) != pieces[key].global_shape:
                error = (
                    f"checkpoint tensor {key!r} in {path} has shape {tuple(stored[key].size)}, "
                    f"this model needs {pieces[key].global_shape}"
                )
            if error:
                break
        mine = sorted(k for k in buffers if k.startswith("model/"))
        gathered = self.ranks.all_gather((error, mine), "key check")
        errors = [e for e, _ in gathered if e]
        used = {k for _, keys in gathered for k in keys}
        unused = sorted(k for k in stored if k.startswith("model/") and k not in used)
        if not errors and unused:
            errors = [f"checkpoint {path} has tensors this model does not use: {unused[:4]}"]
        if errors:
            raise CheckpointError(
                f"{errors[0]}. Fix: make the model.* keys match the checkpoint's (see "
                f"{os.path.join(path, files.METADATA)}), or start fresh with train.resume=none"
            )

    # ------------------------------------------------------------------ save
    def save(self) -> float:
        """Checkpoint the current step (collective); returns the seconds this call blocked.
        A failure raises CheckpointWriteError on every rank (see checkpoint_files.save_failed)."""
        t0 = time.perf_counter()
        self.wait()
        tr, t = self.trainer, self.cfg.train
        tmp, final = files.tmp_dir(self.dir, tr.step), files.step_dir(self.dir, tr.step)
        try:
            self._save(tmp, final, t.async_save)
        except CollectiveError:  # a hang or a dead peer: the hang dump reports it
            raise
        except (OSError, CheckpointError, CheckpointReadError, CheckpointException) as e:
            # every rank raised it (each step above agrees on errors)
            raise files.save_failed(self.dir, tmp, final, [describe_error(e, self.rank)]) from None
        return time.perf_counter() - t0

    def _save(self, tmp: str, final: str, async_save: bool) -> None:
        tr = self.trainer

        def fresh_dir():
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save of this step
            os.makedirs(tmp)

        self.ranks.from_rank0(fresh_dir, io="write")  # every rank waits for the directory
        tr.dp.wait_params()  # the last step's weight all-gathers (overlap_param_gather) are done
        state, pieces = save_state(tr.chunks, tr.optimizer, tr.mesh, tr.tracker, self.rank)
        meta = {
            "kind": "train",
            "step": tr.step,
            "consumed_samples": tr.consumed_samples,
            "layout": layout_of(self.cfg),
            "config": self.cfg.to_dict(),
            "torch": torch.__version__,
        }
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
        planner = ShardSavePlanner(pieces)
        if async_save:
            future = _async_save(state, writer, planner, self.async_group)
            future = self._hasher.submit(self._hash_own, future, tmp)
            if self.rank == 0:
                future = self._committer.submit(self._commit_after, future, tmp, final, meta)
            self.pending = (future, tmp, final)
            return
        # returns once every rank's files are written (DCP ends with a collective)
        guarded(
            f"dcp.save to {tmp}",
            self.io_group,
            lambda: dcp.save(
                state, storage_writer=writer, planner=planner, process_group=self.io_group
            ),
        )
        table = self._checksums(tmp)
        error = None
        if self.rank == 0:
            try:
                self._commit(tmp, final, meta, table)
            except Exception as e:  # every rank must hear of it, or the others would hang
                error = e
        self.ranks.agree(error)  # raw; save() adds the paths

    def _checksums(self, tmp: str) -> dict[str, dict]:
        """sha256 of the written files, each rank hashing its share (collective)."""
        self.ranks.barrier()  # dcp.save may return on a rank before the others' files are done
        names, ranges = self.ranks.from_rank0(lambda: listing_with_dcp_files(tmp), io="write")
        parts = self.ranks.on_every_rank(
            lambda: files.file_table(tmp, (self.rank, self.world), names, ranges),
            f"checksumming {tmp}",
            gather=True,
            io="write",
        )
        return {name: row for part in parts for name, row in part.items()}

    def _hash_own(self, future, tmp: str) -> None:
        """Async save, on this rank's thread: once DCP is done, hash the file it wrote."""
        future.result()
        files.write_own_checksums(tmp, self.rank, self.world, storage_ranges(tmp))

    def _commit_after(self, future, tmp, final, meta) -> None:
        """Rank 0's commit thread: every rank's checksums (from files, not a collective)."""
        future.result()
        table = files.gather_checksums(tmp, self.world, self.cfg.train.async_save_timeout_s)
        self._commit(tmp, final, meta, table)

    def _commit(self, tmp: str, final: str, meta: dict, table: dict | None = None) -> None:
        """Rank 0, once every rank's DCP files are written: metadata with the checksums
        (`table`, or all computed here for an async save), rename, `latest`, pruning."""
        if os.path.exists(final):
            self._say(f"keeping the earlier {final} (renamed {os.path.basename(final)}.replaced-*)")
        files.commit(tmp, final, meta, table)
        files.set_latest(self.dir, final)
        removed, kept = files.prune(self.dir, self.cfg.train.keep_checkpoints, meta["step"])
        for gone in removed:
            self._say(f"removed old checkpoint {gone}")
        for path, why in kept:
            self._say(f"not removing {path}: it fails validation ({why}); inspect it by hand")
        self._say(f"saved {final}")

    def wait(self) -> None:
        """Finish a pending async save on every rank (collective when one is pending)."""
        if self.pending is None:
            return
        (future, tmp, final), self.pending = self.pending, None
        error = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            error = e
        try:
            self.async_ranks.agree(error)  # on the async group: a slow save is no timeout
        except CheckpointWriteError as e:
            raise files.save_failed(self.dir, tmp, final, [str(e)]) from None

    # ------------------------------------------------------------------ training-loop hooks
    def start(self) -> None:
        """Install the SIGTERM / SIGUSR1 handlers (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = signal.Signals(signum).name

    def after_step(self, record: dict, stop: bool) -> bool:
        """Save when due (adds ckpt_blocked_s to the record); True = stop training now.
        `stop`: whether any rank got a stop signal, already agreed by the caller (the trainer
        folds the flag into its one per-step world all-reduce)."""
        t, step = self.cfg.train, self.trainer.step
        due = t.save_interval > 0 and (step % t.save_interval == 0 or step == t.steps)
        if due or (stop and t.save_interval > 0):
            record["ckpt_blocked_s"] = self.save()
        if stop:
            self.wait()
            why = self.signal_received or "a signal on another rank"
            saved = f"checkpoint saved at step {step}"
            if t.save_interval == 0:
                saved = "no checkpoint saved (train.save_interval=0)"
            self._say(f"received {why}: {saved}; stopping cleanly")
        return stop

    def finish(self) -> None:
        """Wait for a pending save and restore the signal handlers."""
        t0 = time.perf_counter()
        pending = self.pending is not None
        self.wait()
        if pending:
            self._say(f"waited {time.perf_counter() - t0:.3f}s for the last async save")
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        if self.run_lock is not None:  # no save is pending any more
            self.run_lock.release()
