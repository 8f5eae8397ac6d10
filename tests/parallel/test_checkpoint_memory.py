"""Checkpoint save and load stream: on dp=2 (ZeRO-1, ZeRO-2 sync and async, ZeRO-3 with bf16
weights) the CPU tensor bytes a save or a load allocates beyond the model states already
resident stay within the bound checkpoint/holdings.py states. A save: the chunks this rank
writes (DCP keeps each until its file is closed; an async save stages exactly those) plus one
bucket of fp32. A load: one bucket of fp32 (one stored chunk at a time, read into place) plus
DCP's plans and the small buffers of step counts and RNG states. The load restores every
weight and AdamW state bitwise. The old save assembled every buffer's whole AdamW state per
kind (>= 2 model sizes of fp32 more); the old load held the whole TP-local state on the host."""

import math

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY

MODEL = [*TINY, "model.arch=llama", "data.mock=true", "train.steps=2", "train.save_interval=2"]
BUCKETS = ["parallel.ddp_bucket_size=8192"]  # about one matrix per bucket: a fine bound
CASES = [
    ("zero1", ["parallel.zero_stage=1", *BUCKETS]),
    ("zero2", ["parallel.zero_stage=2", *BUCKETS]),
    ("zero2_async", ["parallel.zero_stage=2", *BUCKETS, "train.async_save=true"]),
    ("zero3_bf16", ["parallel.zero_stage=3", "train.precision=bf16"]),
]
# what a load holds besides the chunk being read: DCP's pickled plans (exchanged as byte
# tensors, all ranks' on the coordinator, at times freed by the garbage collector only after
# the reads), the step counts (4 bytes per parameter) and the RNG states
SMALL = 128 << 10


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _model_states(trainer) -> list:
    """Every weight, master and AdamW state tensor this rank holds (the optimizer's masters
    are its parameters; stage 3's are the sharded parameters themselves)."""
    inner = trainer.optimizer.inner
    out = [_local(p).detach() for p in trainer.params]
    for group in inner.param_groups:
        for p in group["params"]:
            out.append(_local(p).detach())
            out += [_local(inner.state[p][k]) for k in sorted(inner.state[p])]
    return out


def _written_bytes(path: str, rank: int) -> int:
    """Bytes of the chunks rank `rank` wrote (its DCP file), from the checkpoint's index."""
    from megatron_lite.checkpoint.dcp_metadata import SafeFileSystemReader

    md = SafeFileSystemReader(path).read_metadata()
    total = 0
    for index, info in md.storage_data.items():
        if info.relative_path == f"__{rank}_0.distcp":
            stored = md.state_dict_metadata[index.fqn]
            (chunk,) = [c for c in stored.chunks if tuple(c.offsets) == tuple(index.offset)]
            total += math.prod(chunk.sizes) * stored.properties.dtype.itemsize
    return total


def _bucket_bytes(trainer) -> int:
    """One bucket of fp32: the largest gradient bucket (stage 3: the largest parameter)."""
    buffers = getattr(trainer.dp, "buffers", [])
    if buffers:
        return 4 * max(b.end - b.start for buf in buffers for b in buf.buckets)
    return 4 * max(math.prod(p.shape) for p in trainer.params)


def _measure(rank, world, out_dir):
    """Per case: (name, save peak, load peak beyond what stays, bytes written, bucket)."""
    import torch

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer
    from tests.parallel.live_bytes import LiveBytes

    rows = []
    for name, overrides in CASES:
        run = f"{out_dir}/{name}"
        cfg, dataset, vocab = prepare([f"train.out_dir={run}", *MODEL, *overrides], world)
        trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
        ckpt, saves = trainer.checkpointer, []
        save = ckpt.save

        def measured_save(step, consumed, save=save, saves=saves):
            with LiveBytes(ignore_existing=True) as meter:
                blocked = save(step, consumed)
            saves.append(meter.peak)
            return blocked

        ckpt.save = measured_save
        trainer.train()  # saves after step 2 (an async save is committed by its end)
        path = f"{run}/checkpoints/step_2"
        saved = [t.clone() for t in _model_states(trainer)]
        for t in _model_states(trainer):
            t.fill_(7)  # what the load must overwrite
        with LiveBytes(ignore_existing=True) as meter:
            ckpt.loader.load(ckpt.loader.verify(path))
        load_extra = meter.peak - meter.live  # what stays is model state (old: new tensors)
        for i, (a, b) in enumerate(zip(saved, _model_states(trainer), strict=True)):
            assert torch.equal(a, b), f"{name}: model state tensor {i} not restored by the load"
        rows.append(
            (name, max(saves), load_extra, _written_bytes(path, rank), _bucket_bytes(trainer))
        )
    return rows


@pytest.mark.slow  # 6 s (the suite's budget)
def test_save_and_load_memory_within_one_bucket(tmp_path):
    out = run_ranks(2, _measure, str(tmp_path), timeout=240)
    for rank, rows in enumerate(out):
        for name, save, load, written, bucket in rows:
            print(
                f"CKPT MEMORY {name} rank {rank}: save {save} B (writes {written}, bucket "
                f"{bucket}), load {load} B"
            )
            assert save <= written + bucket, (
                f"{name} rank {rank}: the save allocated {save} bytes, more than the {written} "
                f"it writes plus one bucket ({bucket})"
            )
            assert load <= bucket + SMALL, (
                f"{name} rank {rank}: the load allocated {load} bytes beyond the model states, "
                f"more than one bucket ({bucket}) + {SMALL}"
            )
