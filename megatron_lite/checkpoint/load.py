"""Loading one checkpoint into the model chunks and the optimizer, exactly or resharded.

`Loader.verify(path)` reads the checkpoint's metadata, sets up this rank's load targets (views
of the weights and AdamW shards it holds, holdings.py) and checks the sha256 of exactly the
bytes this rank will read; `Loader.load(job)` reads them with DCP straight into place (each
rank its share of its replica group's tensors, the rest received over the group, see
exchange.py), then sets the step counts, the masters and, in the same layout, the RNG tracker.
What the Checkpointer's resume means in each case is in checkpointer.py.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.chunks import ShardLoadPlanner
from megatron_lite.checkpoint.dcp_metadata import SafeFileSystemReader, planned_reads
from megatron_lite.checkpoint.directory import CheckpointDir
from megatron_lite.checkpoint.errors import CheckpointError, CheckpointReadError
from megatron_lite.checkpoint.holdings import LoadTargets, load_targets
from megatron_lite.checkpoint.rank_agreement import describe_error
from megatron_lite.checkpoint.state import add_rng_targets, loaded_rng_states, set_rng_states
from megatron_lite.parallel.mappings import guarded
from megatron_lite.resolve import stage_layers

__all__ = ["LoadJob", "Loader", "consumed_samples", "layout_of"]
# model settings that must match the checkpoint's (tensor shapes are checked separately)
FUNCTION_KEYS = (
    "arch",
    "num_attention_heads",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "multi_latent_attention",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_norm_topk",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_group_score",
)


def layout_of(cfg) -> dict:
    """What makes RNG states and shard shapes layout specific."""
    p = cfg.parallel
    keys = ("tp", "pp", "vpp", "cp", "ep", "dp", "sequence_parallel", "order")
    split = {"stage_layers": stage_layers(cfg.model, p)}  # which layers each rank holds
    return {"world_size": p.tp * p.pp * p.cp * p.dp, **{k: getattr(p, k) for k in keys}, **split}


def _layout_changes(saved: dict, now: dict) -> str:
    """The layout keys that differ from the checkpoint's, as "tp 2->1, dp 1->2"."""
    return ", ".join(f"{k} {saved.get(k)}->{v}" for k, v in now.items() if saved.get(k) != v)


def consumed_samples(meta: dict, train) -> tuple[int, str | None]:
    """(the data position to continue from, a note when the global batch size changed):
    checkpoints from before it was stored count step × their global batch size."""
    saved_gbs = meta["config"].get("train", {}).get("global_batch_size")
    consumed = meta.get("consumed_samples", meta["step"] * (saved_gbs or 0))
    if saved_gbs is None or saved_gbs == train.global_batch_size:
        return consumed, None
    return consumed, (
        f"train.global_batch_size changed {saved_gbs} -> {train.global_batch_size}: continuing "
        f"from sample {consumed} (the next unseen one); the LR schedule continues by step"
    )


@dataclasses.dataclass
class LoadJob:
    """A checkpoint being loaded: its metadata, reader and this rank's targets (see load)."""

    path: str
    meta: dict
    reader: SafeFileSystemReader
    metadata: object  # DCP's Metadata
    targets: LoadTargets
    with_optim: bool
    same_layout: bool
    reset: bool = False  # train.reset_optimizer_state: another optimizer's checkpoint resumed
    # with fresh optimizer states (weights, step and data position kept)


class Loader:
    """Verifies and loads checkpoints into `chunks`, `optimizer` and `tracker`; every method
    is collective (over `directory`'s groups and the mesh's replica groups)."""

    def __init__(
        self, cfg, mesh, chunks, optimizer, tracker, device: torch.device, directory: CheckpointDir
    ) -> None:
        self.cfg, self.mesh, self.chunks, self.optimizer = cfg, mesh, chunks, optimizer
        self.tracker, self.device, self.directory = tracker, device, directory
        self.rank, self.ranks = directory.rank, directory.ranks
        self.read_bytes = self.loaded_bytes = 0  # at the last load: read here, and in all

    def verify(self, path: str, model_only: bool = False) -> LoadJob:
        """Prepare the load of `path` and check, on every rank, the size of every file and the
        sha256 of exactly the bytes this rank will read (its share of the tensors, see
        exchange.py, and DCP's `.metadata`); raises on every rank: CheckpointError for a
        damaged checkpoint, CheckpointReadError for I/O trouble."""
        job = self._prepare(path, model_only)

        def check():
            stored, pieces = job.metadata.state_dict_metadata, job.targets.pieces
            ok = {  # a missing or misshapen tensor is reported by _check_keys at load time
                k
                for k in job.targets.parallel.mine
                if pieces[k].key in stored
                and tuple(stored[pieces[k].key].size) == pieces[k].global_shape
            }
            planner = ShardLoadPlanner({k: pieces[k] for k in ok})
            planner.set_up_planner({k: job.targets.buffers[k] for k in ok}, job.metadata)
            reads = planned_reads(job.metadata, planner.create_local_plan())
            files.verify_reads(path, reads, job.meta)

        self.ranks.on_every_rank(check, "checksum check")
        return job

    def _prepare(self, path: str, model_only: bool) -> LoadJob:
        """Read the checkpoint's metadata and set up the targets this rank loads into."""

        def read():
            reader = SafeFileSystemReader(path)
            return files.read_metadata(path), reader, reader.read_metadata()

        meta, reader, metadata = self.ranks.on_every_rank(read, f"reading {path}")
        stored = metadata.state_dict_metadata
        with_optim = meta["kind"] == "train" and not model_only
        saved = meta["config"].get("train", {}).get("optimizer", "adamw")
        reset = with_optim and saved != self.optimizer.spec.name
        reset = reset and self.cfg.train.reset_optimizer_state
        with_optim = with_optim and not reset
        same_layout = with_optim and meta["layout"] == layout_of(self.cfg)
        with_master = any(k.startswith("optim/master/") for k in stored)
        targets = load_targets(self.chunks, self.optimizer, self.mesh, with_optim, with_master)
        if same_layout:  # read by this rank itself (ParallelRead: keys no unit lists)
            add_rng_targets(targets.buffers, targets.pieces, stored, self.rank)
            targets.parallel.mine.update(k for k in targets.buffers if k.startswith("rng/"))
        return LoadJob(path, meta, reader, metadata, targets, with_optim, same_layout, reset)

    def load(self, job: LoadJob) -> tuple[int, int]:
        """Load a checkpoint that verify() prepared (collective): see the Checkpointer's
        module doc. Returns (step, consumed samples) to continue from: the checkpoint's, or
        (0, 0) for model weights only."""
        path, meta, targets = job.path, job.meta, job.targets
        self._check_model_config(path, meta["config"].get("model", {}))
        if job.with_optim:
            self._check_optimizer(path, meta["config"].get("train", {}))
        self._check_keys(path, targets.pieces, job.metadata.state_dict_metadata)
        targets.begin()
        self._read(job)
        targets.finish()
        step, consumed = 0, 0
        if job.with_optim or job.reset:
            step = meta["step"]
            consumed, note = consumed_samples(meta, self.cfg.train)
            if note:
                self.directory.say(note)
        if job.same_layout:
            set_rng_states(self.tracker, loaded_rng_states(targets.buffers, self.rank))
        what = "model weights from" if not job.with_optim else "resumed from"
        if job.reset:
            was = meta["config"].get("train", {}).get("optimizer", "adamw")
            what = f"resumed ({was} -> {self.optimizer.spec.name}, fresh optimizer states) from"
        share = f"read {self.read_bytes / 2**20:.1f} of {self.loaded_bytes / 2**20:.1f} MiB here"
        self.directory.say(f"{what} {path} (step {meta['step']}, {share}); now at step {step}")
        if job.with_optim and not job.same_layout:
            changed = _layout_changes(meta["layout"], layout_of(self.cfg))
            self.directory.say(
                f"layout changed ({changed}): model and optimizer state resharded; RNG states "
                "re-seeded, not restored (dropout masks differ from an unbroken run)"
            )
        return step, consumed

    def _read(self, job: LoadJob) -> None:
        """This rank's share of the tensors from disk, the rest from its replica group."""
        path, buffers, pieces = job.path, job.targets.buffers, job.targets.pieces
        parallel = job.targets.parallel
        mine = sorted(parallel.mine)
        io_group = self.directory.io_group
        try:
            guarded(
                f"dcp.load from {path}",
                io_group,
                lambda: dcp.load(
                    {k: buffers[k] for k in mine},
                    storage_reader=job.reader,
                    planner=ShardLoadPlanner({k: pieces[k] for k in mine}),
                    process_group=io_group,
                ),
            )
        except CheckpointException as e:  # raised on every rank
            raise CheckpointReadError(f"reading {path}: {describe_error(e, self.rank)}") from None
        parallel.exchange(self.device)
        self.read_bytes = parallel.read_bytes(buffers)
        self.loaded_bytes = sum(t.nbytes for t in buffers.values())

    def _check_model_config(self, path: str, saved: dict) -> None:
        """Settings that change what the weights compute without changing their shapes."""
        current = self.cfg.model
        for key in FUNCTION_KEYS:
            if key in saved and saved[key] != getattr(current, key):
                raise CheckpointError(
                    f"model.{key}={getattr(current, key)!r} but checkpoint {path} was saved "
                    f"with {saved[key]!r}. Fix: set model.{key}={saved[key]!r}"
                )

    def _check_optimizer(self, path: str, saved: dict) -> None:
        """A resume continues the optimizer that saved the state (checkpoints from before
        train.optimizer existed hold AdamW's)."""
        was, now = saved.get("optimizer", "adamw"), self.optimizer.spec.name
        if was != now:
            raise CheckpointError(
                f"train.optimizer={now!r} but checkpoint {path} holds the state of {was!r}. "
                f"Fix: set train.optimizer={was!r} to resume, or train.reset_optimizer_state=true "
                f"to continue its weights, step and data with fresh {now!r} states, or start "
                f"{now!r} from its weights with train.init_from={path} and train.resume=none"
            )

    def _check_keys(self, path: str, pieces: dict, stored: dict) -> None:
        """Clear errors for missing/mismatched tensors, and for stored model tensors no rank
        loads (the model config differs from the checkpoint's)."""
        error, tensors = None, {}
        for piece in pieces.values():  # the logical tensors, each with one of its pieces
            tensors.setdefault(piece.key, piece)
        for key, piece in tensors.items():
            if key not in stored:
                error = f"checkpoint {path} has no tensor {key!r}"
            elif tuple(stored[key].size) != piece.global_shape:
                error = (
                    f"checkpoint tensor {key!r} in {path} has shape {tuple(stored[key].size)}, "
                    f"this model needs {piece.global_shape}"
                )
            if error:
                break
        # the model tensors this rank loads (stage 3 reads the fp32 masters in their place)
        model = (k.replace("optim/master/", "model/", 1) for k in tensors)
        mine = sorted({k for k in model if k.startswith("model/")})
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
