"""The data position is the consumed-sample count: resuming with another global batch size
continues with the next unseen sample (none skipped, none repeated), and the metrics say so."""

import json
import os

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset


def _train(rank, world, overrides, out_dir):
    import contextlib
    import io

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)

    class Recording:  # which samples the run reads, in order
        def __init__(self, inner):
            self.inner, self.seen = inner, []

        def __getitem__(self, i):
            self.seen.append(i)
            return self.inner[i]

    data, log = Recording(dataset), io.StringIO()
    with contextlib.redirect_stdout(log):  # what the checkpointer says on resume
        Trainer(cfg, ParallelMesh(RankLayout(world)), data, vocab).train()
    return data.seen, log.getvalue()


def test_resume_with_another_global_batch_continues_at_the_next_sample(tmp_path):
    base = [*TINY, f"data.paths=[{structured_dataset()}]", "train.micro_batch_size=2"]
    out = str(tmp_path / "run")
    first, _ = run_ranks(1, _train, [*base, "train.steps=5", "train.save_interval=5"], out)[0]
    assert first == list(range(40))  # 5 steps × 8 samples
    more = ["train.steps=8", "train.global_batch_size=4", "train.save_interval=100"]
    second, log = run_ranks(1, _train, [*base, *more], out)[0]
    assert second == list(range(40, 52)), second  # 3 steps × 4: the next unseen samples
    assert "train.global_batch_size changed 8 -> 4: continuing from sample 40" in log, log
    with open(os.path.join(out, "metrics.jsonl")) as f:
        consumed = [json.loads(line)["consumed_samples"] for line in f]
    assert consumed == [8, 16, 24, 32, 40, 44, 48, 52], consumed
