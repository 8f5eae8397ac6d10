"""Pipeline memory: sent outputs are freed (their graph kept) and the microbatches in flight
per rank equal the schedule's count, on forked gloo ranks with a tiny float64 model.

Expected in-flight counts, from the schedules' formulas (Megatron's warm-up counts):
  1F1B (vpp = 1):  min(pp - r, m)            (warm-up pp - r - 1 forwards, then one more)
  interleaved:     min((pp - r - 1)·2 + (vpp - 1)·pp + 1, m·vpp), and m·vpp when m == pp
(units: (microbatch, chunk) pairs, each chunk 1/vpp of the stage's layers).
"""

import pytest
import torch
from torch import nn

from tests.dist_harness import run_ranks

S, B, H = 8, 2, 16


class Stage(nn.Module):
    """x + tanh(W x): its output (the add) is not saved by its own node."""

    def __init__(self, stage: int, last: bool):
        super().__init__()
        g = torch.Generator().manual_seed(100 + stage)
        self.weight = nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5)
        self.last = last

    def forward(self, x):
        return x + torch.tanh(x @ self.weight)


def forward_step(chunk, mb, x):
    y = chunk(mb if x is None else x)
    return y.square().mean() if chunk.last else y


def expected_in_flight(pp: int, r: int, m: int, vpp: int) -> int:
    if vpp == 1:
        return min(pp - r, m)
    if m == pp:
        return m * vpp
    return min((pp - r - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)


def _microbatches(m):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(S, B, H, generator=g, dtype=torch.float64) for _ in range(m)]


def _run(rank, world, cases):
    import torch.distributed as dist

    from megatron_lite.pipeline.engine import PipelineStats, forward_backward

    results = []
    for vpp, m in cases:
        n = world * vpp
        stages = [Stage(v, v == n - 1) for v in range(n)]
        chunks = [stages[c * world + rank] for c in range(vpp)]
        micro, stats = _microbatches(m), PipelineStats()
        forward_backward(
            chunks, micro, forward_step, pp_group=dist.group.WORLD, tensor_shape=(S, B, H),
            dtype=torch.float64, timeout_s=30, stats=stats,
        )  # fmt: skip
        ref = [Stage(v, v == n - 1) for v in range(n)]  # one process, the whole model
        for mb in micro:
            x = mb
            for st in ref:
                x = st(x)
            x.square().mean().backward()
        err = max(
            (chunks[c].weight.grad - ref[c * world + rank].weight.grad).abs().max().item()
            for c in range(vpp)
        )
        results.append((vpp, m, stats.max_in_flight, stats.max_output_bytes,
                        stats.freed_outputs, err))  # fmt: skip
    return results


@pytest.mark.parametrize(
    "pp,cases", [(2, [(1, 4), (2, 4), (2, 2)]), (4, [(1, 4), (1, 6), (2, 8), (2, 4)])]
)
def test_in_flight_and_freed_outputs_match_the_schedule(pp, cases):
    act_bytes = S * B * H * 8
    for rank, results in enumerate(run_ranks(pp, _run, cases, timeout=60)):
        for vpp, m, in_flight, held_bytes, freed, err in results:
            where = f"pp={pp} vpp={vpp} m={m} rank {rank}"
            assert in_flight == expected_in_flight(pp, rank, m, vpp), where
            assert err < 1e-12, f"{where}: grads differ from one process by {err}"
            sends = m * vpp - (m if rank == pp - 1 else 0)  # the last stage sends nothing
            assert freed == sends, f"{where}: freed {freed} of {sends} sent outputs"
            if rank == 0:  # only the newest output is whole; the sent ones keep one element
                assert held_bytes == act_bytes + 8 * (in_flight - 1), where
