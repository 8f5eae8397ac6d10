"""The engine runs ZB-H1, ZB-V and DualPipeV on forked gloo ranks with a float64 model of parallel
linear layers: the weight gradients equal one process's, W really runs the linear layers' weight
GEMMs (B leaves them unset), and the microbatches in flight per rank are the simulator's. ZB-V
and DualPipeV hold two chunks per rank in the V placement (rank r: stages r and 2·pp − 1 − r,
the turn on the last rank, the loss on the first)."""

import pytest
import torch
from torch import nn

from megatron_lite.pipeline.schedules import get_schedule_table, simulate_options, virtual_stage
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


def _run(rank, world, m, schedule):
    import torch.distributed as dist

    from megatron_lite.parallel import linear_async
    from megatron_lite.pipeline.engine import PipelineStats, forward_backward

    micro = [torch.randn(S, B, H, generator=torch.Generator().manual_seed(7 + i),
                         dtype=torch.float64) for i in range(m)]  # fmt: skip
    vpp, place = (1, "loop") if schedule == "zb-h1" else (2, "v")
    n = world * vpp
    stages = [Stage(v, v == n - 1) for v in range(n)]  # every rank builds all (seeds)
    mine = [virtual_stage(rank, c, world, place) for c in range(vpp)]
    chunks = [stages[v] for v in mine]
    ran = []  # (weight grads set before W?, queue length) per W
    real_run = linear_async.run_wgrads

    def spy(queue):
        ran.append((any(c.linear.weight.grad is not None for c in chunks), len(queue)))
        real_run(queue)

    linear_async.run_wgrads = spy
    stats = PipelineStats()
    try:
        forward_backward(
            chunks, micro, forward_step, pp_group=dist.group.WORLD, tensor_shape=(S, B, H),
            dtype=torch.float64, timeout_s=30, stats=stats, schedule=schedule,
        )  # fmt: skip
    finally:
        linear_async.run_wgrads = real_run
    ref = [Stage(v, v == n - 1) for v in range(n)]  # one process, the whole model
    for mb in micro:
        x = mb
        for st in ref:
            x = st(x)
        x.square().mean().backward()
    err = max(
        (getattr(got.linear, name).grad - getattr(ref[v].linear, name).grad).abs().max()
        for got, v in zip(chunks, mine, strict=True)
        for name in ("weight", "bias")
    ).item()
    return stats.max_in_flight, err, ran


@pytest.mark.parametrize(
    "schedule,pp,m", [("zb-h1", 2, 4), ("zb-h1", 4, 4), ("zb-h1", 4, 7), ("zb-v", 2, 3),
                      ("zb-v", 4, 5), ("zb-v", 4, 8), ("dualpipev", 2, 5), ("dualpipev", 4, 9)],
)  # fmt: skip
def test_zero_bubble_matches_one_process_and_runs_the_weight_gemms_in_w(schedule, pp, m):
    vpp = 1 if schedule == "zb-h1" else 2
    table = get_schedule_table(pp, m, vpp, schedule)
    peaks = simulate(table, **simulate_options(schedule, vpp)).peak_in_flight
    for rank, (in_flight, err, ran) in enumerate(run_ranks(pp, _run, m, schedule, timeout=60)):
        where = f"{schedule} pp={pp} m={m} rank {rank}"
        assert err < 1e-12, f"{where}: grads differ from one process by {err}"
        # ZB-H1 holds 1F1B's min(pp, m); ZB-V min(m + 1 + rank, 2·pp) half-model chunks,
        # DualPipeV 2·pp + 1 of them
        want = {"zb-h1": min(pp, m), "zb-v": min(m + 1 + rank, 2 * pp), "dualpipev": 2 * pp + 1}
        want = want[schedule]
        assert in_flight == peaks[rank] == want, f"{where}: {in_flight} in flight"
        assert len(ran) == m * vpp and all(k == 1 for _, k in ran), (where, ran)  # 1 GEMM a W
        if schedule != "dualpipev":  # (its first backwards run their W at once: not split)
            assert not ran[0][0], f"{where}: a weight had a gradient before the first W"
