"""NVMe optimizer offload (train.optimizer_offload=nvme, data_parallel/nvme.py) gives the losses
of CPU offload bitwise on ZeRO-1 dp2: the same torch AdamW arithmetic on the same values, only
read from and written to a swap file group by group. A small buffer (several groups, the ring
wrapping) and the default one (one group) are both exercised."""

import os

import pytest

from tests.parallel.parity import train_losses

ZERO1 = ["parallel.zero_stage=1", "parallel.ddp_bucket_size=20000", "model.arch=llama"]


def _losses(tmp_path, name, steps, offload):
    out = tmp_path / name
    swap = tmp_path / f"{name}_swap"
    swap.mkdir()
    extra = [f"train.optimizer_offload={offload}", f"train.steps={steps}"]
    if offload == "nvme":  # 1 MiB: TINY's largest piece (the embedding) is 0.2 MiB of state
        extra += [f"train.nvme_path={swap}", "train.nvme_buffer_mb=1"]
    losses = train_losses(2, [*ZERO1, *extra], str(out))
    return list(losses), sorted(os.listdir(swap))


def _check(tmp_path, steps):
    cpu, _ = _losses(tmp_path, "cpu", steps, "cpu")
    nvme, left = _losses(tmp_path, "nvme", steps, "nvme")
    assert nvme == cpu, f"nvme offload losses differ from cpu offload's: {nvme} vs {cpu}"
    assert len(cpu) == steps
    return left


def test_nvme_offload_three_steps_bitwise_equal_to_cpu_offload(tmp_path):
    _check(tmp_path, 3)


@pytest.mark.slow
@pytest.mark.parity
def test_nvme_offload_twenty_steps_bitwise_equal_to_cpu_offload(tmp_path):
    _check(tmp_path, 20)
