"""The planner's offload figures (plan/offload_bytes.py) against what the built optimizer holds
on ZeRO-1 dp2: the swap files' bytes (NVMe) and the host masters and states (CPU), summed over
the ranks (a rank's share differs from the mean by bucket padding; the sum is exact)."""

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset

ZERO1 = ["model.arch=llama", "parallel.zero_stage=1", "parallel.ddp_bucket_size=20000"]


def _held(rank, world, overrides, out_dir):
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare([f"train.out_dir={out_dir}", *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)
    dp = trainer.dp
    host = dp.memory("cpu")
    out = (dp.nvme_bytes(), host["master"] + host["optimizer"])
    dp.close()
    dist.barrier()
    return out


@pytest.mark.parametrize("offload", [pytest.param("cpu", marks=pytest.mark.slow), "nvme"])
def test_planner_offload_bytes_match_the_built_optimizer(tmp_path, offload):
    from megatron_lite.config import load_config
    from megatron_lite.plan.offload_bytes import offload_bytes
    from megatron_lite.validation import validate

    swap = tmp_path / "swap"
    swap.mkdir()
    over = [*TINY, f"data.paths=[{structured_dataset()}]", *ZERO1,
            f"train.optimizer_offload={offload}", f"train.nvme_path={swap}",
            "train.nvme_buffer_mb=1"]  # fmt: skip
    held = run_ranks(2, _held, over, str(tmp_path / "run"), timeout=120)
    cfg = validate(load_config(None, ["parallel.dp=2", *over]), 2, warn=False)
    want = offload_bytes(cfg)
    nvme = sum(n for n, _ in held)
    host = sum(h for _, h in held)
    if offload == "nvme":
        assert nvme == 2 * want.nvme, f"swap files {nvme} B, planner 2 × {want.nvme}"
        assert host == 2 * want.host == 2 * 2**20, f"host buffers {host} B, planner {want.host}"
    else:
        assert host == 2 * want.host, f"host masters+states {host} B, planner 2 × {want.host}"
        assert nvme == 0 == want.nvme
    assert want.device == 0
