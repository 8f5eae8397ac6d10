"""Fully parallel save: with dp=4 every rank writes about a quarter of the checkpoint (max/mean
of the bytes each rank wrote <= 1.3), and the checkpoint resumes on another layout."""

import glob
import os

import pytest

from tests.parallel.parity import max_rel_diff, reference_losses, train_losses

LLAMA = ("model.arch=llama",)
# the first 5 steps of a 10-step schedule save at step 5; the resumed runs train steps 5..9
FIRST = ["train.save_interval=5", "train.steps=5", "train.lr_decay_steps=10"]
STRAIGHT = (*LLAMA, "train.steps=10")  # the single-rank reference of the 10 steps


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    """ZeRO-1 on dp=4 saves at step 5: (run dir, its 5 losses)."""
    run = str(tmp_path_factory.mktemp("parallel_save") / "dp4")
    return run, train_losses(4, [*LLAMA, *FIRST, "parallel.zero_stage=1"], run)


def test_every_dp_rank_writes_its_share(dp4, tmp_path):
    run, a = dp4
    files = glob.glob(os.path.join(run, "checkpoints", "step_5", "*.distcp"))
    sizes = [os.path.getsize(f) for f in files]
    assert len(sizes) == 4, files  # one file per writing rank
    ratio = max(sizes) / (sum(sizes) / len(sizes))
    print(f"PARALLEL SAVE dp4: bytes per rank {sizes}, max/mean {ratio:.3f}")
    assert ratio <= 1.3, sizes
    resume = f"train.resume={run}/checkpoints/step_5"
    b = train_losses(2, [*STRAIGHT, resume, "parallel.tp=2"], str(tmp_path / "tp2"))
    diff = max_rel_diff(a + b, reference_losses(STRAIGHT))
    assert diff < 1e-5, diff


def _resume_reads(rank, world, overrides, out_dir):
    import torch.distributed as dist

    import megatron_lite.models
    import megatron_lite.training.trainer
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    def no_random_init(*args):
        raise AssertionError("a resumed model must not be randomly initialized")

    megatron_lite.models.init_parameters = no_random_init  # build_model's (ZeRO-3)
    megatron_lite.training.trainer.init_parameters = no_random_init

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    trainer = Trainer(cfg, mesh, dataset, vocab)
    read, loaded = trainer.checkpointer.read_bytes, trainer.checkpointer.loaded_bytes
    losses = [r["loss"] for r in trainer.train()]
    return losses if dist.get_rank() == 0 else None, read, loaded


def _tensor_bytes(path: str) -> int:
    """Bytes of every chunk stored in the checkpoint `path` (DCP's index)."""
    import math

    from megatron_lite.checkpoint.dcp_metadata import SafeFileSystemReader

    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata.values()
    return sum(
        math.prod(c.sizes) * md.properties.dtype.itemsize for md in stored for c in md.chunks
    )


def test_every_dp_rank_reads_its_share(dp4, tmp_path):
    """Fully parallel load: on the same dp4 layout each rank reads about a quarter of the
    checkpoint (the weights it does not read are broadcast by its replicas, its ZeRO-1 shard
    of the AdamW state it reads alone), and the resumed run continues exactly; resuming draws
    no random weights (ZeRO-1 and ZeRO-3)."""
    from tests.dist_harness import run_ranks
    from tests.parallel.parity import TINY, structured_dataset

    run, a = dp4
    common = [*TINY, f"data.paths=[{structured_dataset()}]", *STRAIGHT, "parallel.zero_stage=1"]
    resume = [f"train.resume={run}/checkpoints/step_5"]
    out = run_ranks(4, _resume_reads, [*common, *resume], str(tmp_path / "again"), timeout=180)
    reads = [r for _, r, _ in out]
    ratio = max(reads) / (sum(reads) / len(reads))
    stored = _tensor_bytes(f"{run}/checkpoints/step_5")
    print(f"PARALLEL LOAD dp4: bytes read per rank {reads} of {stored}, max/mean {ratio:.3f}")
    assert ratio <= 1.3, reads
    assert max(reads) < 0.35 * stored, f"bytes read per rank {reads} of {stored} stored"
    diff = max_rel_diff(a + out[0][0], reference_losses(STRAIGHT))
    assert diff < 1e-5, diff
    # ZeRO-3 (FSDP2 shards what it is given) resumes without drawing the weights either
    zero3 = [*common, *resume, "parallel.zero_stage=3"]
    out = run_ranks(2, _resume_reads, zero3, str(tmp_path / "zero3"), timeout=180)
    diff = max_rel_diff(a + out[0][0], reference_losses(STRAIGHT))
    assert diff < 1e-5, diff
