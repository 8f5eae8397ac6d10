"""Sharded checkpoints (torch.distributed.checkpoint) with exact and resharding resume.

    directory = CheckpointDir(cfg)           # before the model: groups, run lock, will_load()
    ckpt = Checkpointer(cfg, mesh, chunks, dp, tracker, device, directory)
    position = ckpt.resume()                 # (step, consumed_samples), or None: nothing loaded
    blocked_s = ckpt.save(step, consumed_samples)
    ckpt.finish()                            # the last async save committed, the lock released

The Checkpointer holds no trainer: it is built from the config, the mesh, the model chunks, the
data-parallel wrapper (its optimizer holds the optimizer state) and the RNG tracker. `resume()`
applies train.resume (auto | none | path) or initializes weights from train.init_from; when to
save (train.save_interval, stop signals) is the training loop's decision (training/signals.py).
`save` keeps the newest train.keep_checkpoints.

What a checkpoint holds and how it is cut is in state.py; the directory layout, atomic commit
and checksums in files.py; how each step's errors are agreed across ranks (so none waits in a
collective for one that failed) in rank_agreement.py; loading in load.py. Resume semantics:
- same layout: model, optimizer state (its spec's states and step count), the step (= data
  position, see data/sampler.py) and every rank's RNG states are restored, so the run
  continues bitwise as if never stopped (the LR is a function of the step);
- another layout (tp, pp, vpp, cp, dp, ep, sequence_parallel or order differ): model and
  optimizer state are resharded exactly, RNG states are NOT restored (their number and meaning
  depend on the layout): every generator is seeded as at the start of a run, so dropout masks
  differ from an unbroken run; with dropout 0 the losses continue to float rounding.
- init_from: model weights only (step 0, fresh optimizer), e.g. a Hugging Face Llama converted
  with tools/convert_checkpoint.py. A resumable checkpoint in ckpt_dir takes precedence.
- the optimizer (train.optimizer) must be the one that saved the state (load.py says so).

Saves and loads stream (holdings.py states the bound): each rank writes the chunks it holds,
as views of its weights and optimizer shards (nothing is gathered), and a load reads into them in
place. Async save (train.async_save) stages a CPU copy of exactly the chunks this rank writes
at the step boundary and writes on a thread (DCP's thread executor) over its own gloo group;
each rank then checksums what it wrote on a thread of its own, and rank 0 commits on another.
Checksums are per stored tensor chunk, and resume checks on each rank exactly the chunks it
reads; each rank reads its share of its replica group's tensors and receives the rest
(exchange.py). The time the step was blocked is what `save` returns (logged as ckpt_blocked_s).

Safety (see run_dir.py, dcp_metadata.py): the run directory is locked for one run (held until
the last async save is committed); DCP's pickled `.metadata` is read through an allow-list, so
a crafted one is refused (UnsafeCheckpointError) instead of run; resume=auto takes the newest
committed checkpoint whose checksums verify and stops, listing them, when none does; a failed
save raises CheckpointWriteError naming the path on every rank and leaves the previous
checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.chunks import DiskWriter, ShardSavePlanner, StagingWriter
from megatron_lite.checkpoint.dcp_metadata import listing_with_dcp_files, storage_ranges
from megatron_lite.checkpoint.directory import CheckpointDir
from megatron_lite.checkpoint.errors import (
    CheckpointError,
    CheckpointReadError,
    CheckpointWriteError,
)
from megatron_lite.checkpoint.holdings import load_targets, save_state
from megatron_lite.checkpoint.load import Loader, LoadJob, layout_of
from megatron_lite.checkpoint.rank_agreement import describe_error
from megatron_lite.checkpoint.state import rng_states, set_rng_states
from megatron_lite.parallel.mappings import CollectiveError, guarded

__all__ = ["Checkpointer"]


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Checkpointer:
    """Save / resume of one rank's model chunks, optimizer state (`dp.optimizer`) and RNG
    `tracker` in `directory`; every method is called on every rank in the same order."""

    def __init__(
        self,
        cfg,
        mesh,
        chunks: list[torch.nn.Module],
        dp,
        tracker,
        device: torch.device,
        directory: CheckpointDir,
    ) -> None:
        self.cfg, self.mesh, self.chunks, self.dp, self.tracker = cfg, mesh, chunks, dp, tracker
        self.directory, self.dir = directory, directory.path
        self.rank, self.world = directory.rank, directory.world
        self.ranks, self.async_ranks = directory.ranks, directory.async_ranks
        self.loader = Loader(cfg, mesh, chunks, dp.optimizer, tracker, device, directory)
        self._hasher = ThreadPoolExecutor(1)  # each rank hashes what it wrote, off the step
        self.pending = None  # Future of an async save (rank 0: including the commit)
        self._job: LoadJob | None = None  # the checkpoint _verify accepted, for resume()
        self._committer = ThreadPoolExecutor(1) if self.rank == 0 else None
        self.memory = directory.memory  # in-memory checkpoints (memory.py), or None
        if self.memory is not None:  # refuse to start when /dev/shm cannot hold them
            self.memory.check_space(sum(_nbytes(t) for t in self._memory_state()[1].values()))

    @property
    def read_bytes(self) -> int:
        """Bytes of the last load this rank read from disk itself."""
        return self.loader.read_bytes

    @property
    def loaded_bytes(self) -> int:
        """Bytes of the last load this rank holds (read here or received)."""
        return self.loader.loaded_bytes

    # ------------------------------------------------------------------ resume
    def resume(self) -> tuple[int, int] | None:
        """Apply train.resume / train.init_from (collective): (step, consumed samples) to
        continue from when weights were loaded ((0, 0) for init_from's weights only), None
        when nothing was. Loads exactly when directory.will_load() said so (or raises)."""
        t = self.cfg.train
        try:
            loaded = self._resume_from_memory()
            if loaded is not None:
                return loaded
            path = self._choose(t.resume, t.init_from)
            if path is None:
                return None
            job, self._job = self._job, None  # prepared and verified by _choose
            return self.loader.load(job)
        except BaseException:
            self.directory.release()  # nothing is being saved yet
            raise

    def _memory_state(self):
        """(load targets, {key: tensor}): what a same-layout disk resume restores on this rank
        (holdings.load_targets: weights, optimizer states, step counts) and its RNG states."""
        self.dp.wait_params()
        masters = self.dp.optimizer.weight_dtype != torch.float32
        targets = load_targets(self.chunks, self.dp.optimizer, self.mesh, True, masters)
        tensors = dict(targets.buffers)
        for step, key in targets.steps:
            tensors[key] = step.detach()
        tensors.update({f"rng/{g}": t for g, t in rng_states(self.tracker).items()})
        return targets, tensors

    def save_memory(self, step: int, consumed_samples: int) -> float:
        """An in-memory checkpoint after `step` (collective); returns the seconds it took."""
        if self.memory is None:  # a dry run (fake process groups) keeps no copies
            return 0.0
        t0 = time.perf_counter()
        self.memory.save(step, consumed_samples, self._memory_state()[1])
        return time.perf_counter() - t0

    def _resume_from_memory(self) -> tuple[int, int] | None:
        """Load the in-memory step will_load() agreed on when it is not older than the newest
        disk checkpoint (collective) -> (step, consumed samples), or None."""
        plan = self.directory.memory_plan
        if plan is None:
            return None
        disk = [int(os.path.basename(p).removeprefix("step_")) for p in self.directory.candidates()]
        if disk and max(disk) > plan.step:
            self.directory.say(f"in-memory step {plan.step} is older than step_{max(disk)}")
            return None
        t0 = time.perf_counter()
        targets, tensors = self._memory_state()
        targets.begin()  # zeros where nothing is stored (vocabulary padding), as a disk load
        rng = {k: torch.empty_like(t) for k, t in tensors.items() if k.startswith("rng/")}
        fill = {**targets.buffers, **rng}
        try:
            header = self.ranks.on_every_rank(
                lambda: self.memory.load(plan, fill), f"loading in-memory step {plan.step}"
            )
        except CheckpointReadError as e:  # agreed on every rank; a disk load rewrites it all
            if not disk:
                raise
            self.directory.say(f"{e}; falling back to the disk checkpoints")
            return None
        targets.finish()
        set_rng_states(self.tracker, {k[4:]: t for k, t in rng.items()})
        where = sorted({h for r, (h, _, _) in plan.sources.items() if h != r})
        peers = f", {len(where)} from a peer's replica" if where else ""
        self.directory.say(
            f"resumed from the in-memory checkpoint of step {plan.step} in {self.memory.dir} "
            f"({time.perf_counter() - t0:.2f}s{peers}); now at step {plan.step}"
        )
        return plan.step, header["consumed_samples"]

    def _choose(self, resume: str, init_from: str | None) -> str | None:
        """The checkpoint to load, verified and prepared in self._job (collective)."""
        if resume == "auto":
            candidates = self.directory.candidates()
            path, notes = files.select_auto(self.dir, candidates, check=self._verify)
            for note in notes:
                self.directory.say(note)
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
        """Loader.verify, keeping the prepared load (select_auto's check)."""
        self._job = self.loader.verify(path, model_only)

    # ------------------------------------------------------------------ save
    def save(self, step: int, consumed_samples: int) -> float:
        """Checkpoint the state after `step` optimizer steps, `consumed_samples` being the data
        position (collective); returns the seconds this call blocked. A failure raises
        CheckpointWriteError on every rank (see files.save_failed)."""
        t0 = time.perf_counter()
        self.wait()
        t = self.cfg.train
        tmp, final = files.tmp_dir(self.dir, step), files.step_dir(self.dir, step)
        try:
            self._save(tmp, final, t.async_save, step, consumed_samples)
        except CollectiveError:  # a hang or a dead peer: the hang dump reports it
            raise
        except (OSError, CheckpointError, CheckpointReadError, CheckpointException) as e:
            # every rank raised it (each step above agrees on errors)
            raise files.save_failed(self.dir, tmp, final, [describe_error(e, self.rank)]) from None
        return time.perf_counter() - t0

    def _save(self, tmp: str, final: str, async_save: bool, step: int, consumed: int) -> None:
        def fresh_dir():
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save of this step
            os.makedirs(tmp)

        self.ranks.from_rank0(fresh_dir, io="write")  # every rank waits for the directory
        self.dp.wait_params()  # the last step's weight all-gathers (overlap_param_gather) done
        state, pieces = save_state(
            self.chunks, self.dp.optimizer, self.mesh, self.tracker, self.rank
        )
        meta = {
            "kind": "train",
            "step": step,
            "consumed_samples": consumed,
            "layout": layout_of(self.cfg),
            "config": self.cfg.to_dict(),
            "torch": torch.__version__,
        }
        writer_type = StagingWriter if async_save else DiskWriter
        writer = writer_type(tmp, single_file_per_rank=True, sync_files=True)
        planner = ShardSavePlanner(pieces)
        if async_save:
            future = _async_save(state, writer, planner, self.directory.async_group)
            future = self._hasher.submit(self._hash_own, future, tmp)
            if self.rank == 0:
                future = self._committer.submit(self._commit_after, future, tmp, final, meta)
            self.pending = (future, tmp, final)
            return
        # returns once every rank's files are written (DCP ends with a collective)
        io_group = self.directory.io_group
        guarded(
            f"dcp.save to {tmp}",
            io_group,
            lambda: dcp.save(state, storage_writer=writer, planner=planner, process_group=io_group),
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
        say = self.directory.say
        if os.path.exists(final):
            say(f"keeping the earlier {final} (renamed {os.path.basename(final)}.replaced-*)")
        files.commit(tmp, final, meta, table)
        files.set_latest(self.dir, final)
        removed, kept = files.prune(self.dir, self.cfg.train.keep_checkpoints, meta["step"])
        for gone in removed:
            say(f"removed old checkpoint {gone}")
        for path, why in kept:
            say(f"not removing {path}: it fails validation ({why}); inspect it by hand")
        say(f"saved {final}")

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

    def finish(self) -> None:
        """Wait for a pending save, then release the run directory's lock."""
        t0 = time.perf_counter()
        pending = self.pending is not None
        self.wait()
        if pending:
            self.directory.say(f"waited {time.perf_counter() - t0:.3f}s for the last async save")
        self.directory.release()  # no save is pending any more
        if self.memory is not None:  # a clean end: the copies are not needed any more
            self.memory.remove()
