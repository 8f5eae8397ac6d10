"""NVMe optimizer offload (train.optimizer_offload=nvme, data_parallel/nvme.py) gives the losses
of CPU offload bitwise on ZeRO-1 dp2 (20 steps) and ZeRO-2 dp2 (6 steps): the same torch AdamW
arithmetic on the same values, only read from and written to a swap file group by group. The
1 MiB buffer cuts each rank's ~1.5 MB of masters and states into several groups, each read
while the one before steps."""

import pytest

from tests.parallel.parity import train_losses

COMMON = ["parallel.ddp_bucket_size=20000", "model.arch=llama"]


def _losses(tmp_path, name, steps, offload, stage=1):
    out = tmp_path / name
    swap = tmp_path / f"{name}_swap"
    swap.mkdir()
    extra = [f"train.optimizer_offload={offload}", f"train.steps={steps}",
             f"parallel.zero_stage={stage}"]  # fmt: skip
    if offload == "nvme":  # 1 MiB: TINY's largest piece (the embedding) is 0.2 MiB of state
        extra += [f"train.nvme_path={swap}", "train.nvme_buffer_mb=1"]
    return list(train_losses(2, [*COMMON, *extra], str(out)))


@pytest.mark.slow  # ~12 s; the fast tier has the optimizer-level test (test_nvme_swap.py)
@pytest.mark.parity
def test_nvme_offload_twenty_steps_bitwise_equal_to_cpu_offload(tmp_path):
    cpu = _losses(tmp_path, "cpu", 20, "cpu")
    nvme = _losses(tmp_path, "nvme", 20, "nvme")
    assert len(cpu) == 20
    assert nvme == cpu, f"nvme offload losses differ from cpu offload's: {nvme} vs {cpu}"


def test_nvme_offload_zero2_bitwise_equal_to_cpu_offload(tmp_path):
    """ZeRO-2 (gradients sharded between steps): the same pieces, 6 steps (fast tier: 2.6 s
    measured with the fork server warm)."""
    cpu = _losses(tmp_path, "cpu", 6, "cpu", stage=2)
    nvme = _losses(tmp_path, "nvme", 6, "nvme", stage=2)
    assert nvme == cpu, f"zero2: nvme offload losses differ from cpu offload's: {nvme} vs {cpu}"
