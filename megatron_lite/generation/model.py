"""The generation model: the normal model builder on a tp-N mesh (pp = cp = dp = ep = 1), its
weights filled by the checkpoint machinery. A checkpoint from any training layout (tp, pp,
vpp, dp / ZeRO, ep, MoE) goes through checkpoint/load.py's `Loader`, which reshards on read
exactly as a resume does (each rank reads the overlap of its shards, checksums checked); HF
weights converted in memory fill the same load targets (checkpoint/holdings.py) by slicing.
"""

from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_lite.checkpoint.errors import CheckpointError
from megatron_lite.checkpoint.holdings import load_targets
from megatron_lite.checkpoint.load import Loader
from megatron_lite.checkpoint.rank_agreement import RankAgreement
from megatron_lite.config import Config, ModelConfig, ParallelConfig
from megatron_lite.generation.sources import Source
from megatron_lite.models import build_model
from megatron_lite.parallel import mappings
from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
from megatron_lite.parallel.random import RNGStatesTracker

__all__ = ["build_generation_model", "generation_config"]


def generation_config(m: ModelConfig, tp: int) -> Config:
    """A run config for inference: the weights' model keys, without dropout, recompute or
    token dropping (MoE capacity), with the local SDPA/linear backends in fp32, on tp ranks."""
    model = dataclasses.replace(
        m,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        moe_capacity_factor=None,
        attention_backend="sdpa",
        linear_backend="local",
        fp8=None,
    )
    return Config(model=model, parallel=ParallelConfig(tp=tp, dp=1))


class _NoOptimizer:
    """The `Loader`'s optimizer when only weights are loaded: no state, no masters."""

    weight_dtype = torch.float32
    spec = None

    def state_shards(self) -> list:
        return []

    def sync_masters_from_params(self) -> None:
        pass


class _ReadingDir:
    """What the `Loader` uses of a `CheckpointDir` (its rank, the error agreement, the DCP
    group, messages), without the run directory's lock: generation only reads, and may read
    a run that is still training."""

    def __init__(self, timeout_s: float):
        timeout, host = timedelta(seconds=timeout_s), mappings.host_backend()
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.io_group = dist.new_group(backend=host, timeout=timeout, group_desc="gen_ckpt_io")
        ctl = dist.new_group(backend=host, timeout=timeout, group_desc="gen_ckpt_ctl")
        self.ranks = RankAgreement(self.rank, world, ctl)

    def say(self, msg: str) -> None:
        if self.rank == 0:  # stdout is the generated text
            print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)


@torch.no_grad()
def load_converted(chunk, mesh: ParallelMesh, tensors: dict[str, torch.Tensor]) -> None:
    """Fill this rank's shards from full logical tensors (HF weights converted in memory): each
    load target is the box of its logical tensor at its offsets, as a DCP read would give."""
    targets = load_targets([chunk], _NoOptimizer(), mesh, with_optimizer=False)
    # (each rank checks its own pieces: a TP rank may hold nothing of a tensor but padding)
    missing = sorted({p.key.removeprefix("model/") for p in targets.pieces.values()} - set(tensors))
    if missing:
        raise CheckpointError(
            f"the converted weights lack {missing[:4]}, which the model built from their config "
            "has. Fix: report this: the converter's mapping and the model disagree"
        )
    targets.begin()
    for name, target in targets.buffers.items():
        piece = targets.pieces[name]
        full = tensors[piece.key.removeprefix("model/")]
        box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, target.shape, strict=True))
        target.copy_(full[box])
    targets.finish()


def build_generation_model(source: Source, tp: int, device: torch.device):
    """(this rank's model chunk holding all layers, the mesh): built on tp ranks (the whole
    world) and filled from `source` (collective)."""
    cfg = generation_config(source.model, tp)
    mesh = ParallelMesh(RankLayout(dist.get_world_size(), tp=tp), timeout_s=cfg.parallel.timeout_s)
    tracker = RNGStatesTracker()
    (chunk,) = build_model(cfg, mesh, tracker, source.model.vocab_size, init=False, device=device)
    chunk.eval()
    if source.tensors is not None:
        load_converted(chunk, mesh, source.tensors)
    else:
        directory = _ReadingDir(cfg.parallel.timeout_s)
        loader = Loader(cfg, mesh, [chunk], _NoOptimizer(), tracker, device, directory)
        loader.load(loader.verify(source.checkpoint, model_only=True))
    return chunk, mesh
