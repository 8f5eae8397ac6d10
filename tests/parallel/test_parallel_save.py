"""Fully parallel save: with dp=4 every rank writes about a quarter of the checkpoint (max/mean
of the bytes each rank wrote <= 1.3), and the checkpoint resumes on another layout."""

import glob
import os

from tests.parallel.parity import max_rel_diff, reference_losses, train_losses

LLAMA = ("model.arch=llama",)


def test_every_dp_rank_writes_its_share(tmp_path):
    run = str(tmp_path / "dp4")
    first = ["train.save_interval=10", "train.steps=10", "train.lr_decay_steps=20"]
    a = train_losses(4, [*LLAMA, *first, "parallel.zero_stage=1"], run)
    files = glob.glob(os.path.join(run, "checkpoints", "step_10", "*.distcp"))
    sizes = [os.path.getsize(f) for f in files]
    assert len(sizes) == 4, files  # one file per writing rank
    ratio = max(sizes) / (sum(sizes) / len(sizes))
    print(f"PARALLEL SAVE dp4: bytes per rank {sizes}, max/mean {ratio:.3f}")
    assert ratio <= 1.3, sizes
    resume = f"train.resume={run}/checkpoints/step_10"
    b = train_losses(2, [*LLAMA, resume, "parallel.tp=2"], str(tmp_path / "tp2"))
    diff = max_rel_diff(a + b, reference_losses(LLAMA))
    assert diff < 1e-5, diff
