"""The engine runs ZB-H1 on forked gloo ranks with a float64 model of parallel linear layers:
the weight gradients equal one process's, W really runs the linear layers' weight GEMMs (B
leaves them unset), and the microbatches in flight per rank are the simulator's."""

import pytest
import torch
from torch import nn

from megatron_lite.pipeline.schedules import get_schedule_table
from megatron_lite.pipeline.simulate import simulate
from tests.dist_harness import run_ranks

S, B, H = 8, 2, 16


class Stage(nn.Module):
    """x + tanh(linear(x)) through a ColumnParallelLinear on a one-rank TP group."""

    def __init__(self, stage: int, last: bool):
        import torch.distributed as dist

        from megatron_lite.parallel.layers import ColumnParallelLinear

        super().__init__()
        tp = dist.new_group([dist.get_rank()]) if dist.is_initialized() else None
        self.linear = ColumnParallelLinear(H, H, tp, bias=True).double()
        g = torch.Generator().manual_seed(100 + stage)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5)
            self.linear.bias.copy_(torch.randn(H, generator=g, dtype=torch.float64) / H)
        self.last = last

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def forward_step(chunk, mb, x):
    y = chunk(mb if x is None else x)
    return y.square().mean() if chunk.last else y


def _run(rank, world, m):
    import torch.distributed as dist

    from megatron_lite.parallel import linear_async
    from megatron_lite.pipeline.engine import PipelineStats, forward_backward

    micro = [torch.randn(S, B, H, generator=torch.Generator().manual_seed(7 + i),
                         dtype=torch.float64) for i in range(m)]  # fmt: skip
    stages = [Stage(v, v == world - 1) for v in range(world)]  # every rank builds all (seeds)
    chunk = stages[rank]
    ran = []  # (weight grad set before W?, queue length) per W
    real_run = linear_async.run_wgrads

    def spy(queue):
        ran.append((chunk.linear.weight.grad is not None, len(queue)))
        real_run(queue)

    linear_async.run_wgrads = spy
    stats = PipelineStats()
    try:
        forward_backward(
            [chunk], micro, forward_step, pp_group=dist.group.WORLD, tensor_shape=(S, B, H),
            dtype=torch.float64, timeout_s=30, stats=stats, schedule="zb-h1",
        )  # fmt: skip
    finally:
        linear_async.run_wgrads = real_run
    ref = [Stage(v, v == world - 1) for v in range(world)]  # one process, the whole model
    for mb in micro:
        x = mb
        for st in ref:
            x = st(x)
        x.square().mean().backward()
    err = max(
        (chunk.linear.weight.grad - ref[rank].linear.weight.grad).abs().max().item(),
        (chunk.linear.bias.grad - ref[rank].linear.bias.grad).abs().max().item(),
    )
    return stats.max_in_flight, err, ran


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 7)])
def test_zb_h1_matches_one_process_and_runs_the_weight_gemms_in_w(pp, m):
    peaks = simulate(get_schedule_table(pp, m, 1, "zb-h1"), comm="posted").peak_in_flight
    for rank, (in_flight, err, ran) in enumerate(run_ranks(pp, _run, m, timeout=60)):
        where = f"pp={pp} m={m} rank {rank}"
        assert err < 1e-12, f"{where}: grads differ from one process by {err}"
        assert in_flight == peaks[rank] == min(pp, m), f"{where}: {in_flight} in flight"
        assert len(ran) == m and all(n == 1 for _, n in ran), (where, ran)  # one GEMM per W
        assert not ran[0][0], f"{where}: the weight had a gradient before the first W"
