"""A schedule is one record (pipeline/registry.py `ScheduleSpec`): a toy GPipe (every forward,
then every backward), defined and registered in this file alone, runs through config
validation (its name, its own microbatch rule and message), the simulator (its in-flight count
and closed-form bubble against the simulated table), the planner's in-flight count and the
engine on two gloo ranks (the loss and gradients of one process). The docs' table is the
shipped records'."""

import os
from fractions import Fraction

import pytest
import torch

from megatron_lite.config import ConfigError, load_config
from megatron_lite.pipeline.registry import (
    ScheduleSpec,
    bubble_formula,
    in_flight,
    register_schedule,
    schedule_names,
    schedules_table,
    simulate_options,
    unregister_schedule,
)
from megatron_lite.pipeline.schedules import Action, get_schedule_table, virtual_stage, with_comm
from megatron_lite.pipeline.simulate import simulate
from tests.dist_harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = "toy-gpipe"
S, B, H = 4, 2, 8


def gpipe(pp: int, rank: int, m: int, vpp: int) -> list[Action]:
    """GPipe (Huang et al. 2019): every microbatch's forward, then every backward, each input
    received right before its compute and each result sent right after."""
    computes = [Action("forward", mb) for mb in range(m)]
    computes += [Action("backward", mb) for mb in range(m)]
    return with_comm(computes, pp, rank)


TOY_SPEC = ScheduleSpec(
    name=TOY,
    build=gpipe,
    in_flight=lambda pp, vpp, m, rank: m,  # every forward before the first backward
    summary="toy GPipe",
    # a rule of its own, to see validation word it (GPipe itself runs on pp microbatches)
    min_microbatches=lambda pp, vpp: pp + 1,
    min_formula="pp+1",
    min_why="the toy asks one microbatch more than the stages",
    bubble_fill=lambda fwd, bwd, wgt: fwd + bwd,  # as 1F1B: (pp-1)/m
    bubble_rule="(pp-1)/m",
)


def _ensure_toy() -> None:
    """Register the toy in this process (the ranks fork from a server that never imported this
    file's fixture)."""
    if TOY not in schedule_names():
        register_schedule(TOY_SPEC)


@pytest.fixture
def toy():
    _ensure_toy()
    yield TOY
    unregister_schedule(TOY)


def test_validation_takes_the_toy_and_words_its_rule(toy):
    from megatron_lite.validation import validate

    base = ["data.mock=true", "model.vocab_size=256", "parallel.pp=2",
            f"parallel.pipeline_schedule={toy}", "train.micro_batch_size=1"]  # fmt: skip
    cfg = validate(load_config(None, [*base, "train.global_batch_size=3"]), 2, warn=False)
    assert cfg.parallel.pipeline_schedule == toy
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*base, "train.global_batch_size=2"]), 2, warn=False)
    assert "must be >= pp+1=3 for the toy-gpipe schedule: the toy asks one" in str(e.value)
    assert "Fix: use global_batch_size >= 3" in str(e.value)
    with pytest.raises(ConfigError, match="needs vpp=1.*Fix: set parallel.vpp=1"):
        validate(load_config(None, [*base, "parallel.vpp=2"]), 2, warn=False)


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 5), (4, 8)])
def test_simulator_runs_the_toy_with_its_records_counts(toy, pp, m):
    result = simulate(get_schedule_table(pp, m, 1, toy), **simulate_options(toy))
    counts = [in_flight(pp, 1, m, r, toy) for r in range(pp)]
    assert list(result.peak_in_flight) == counts == [m] * pp, (result.peak_in_flight, counts)
    exact = bubble_formula(toy, pp, 1, m, Fraction(1), Fraction(2))  # the record's closed form
    assert result.bubble_fraction == exact == Fraction(pp - 1, m), (result.bubble_fraction, exact)


def test_planner_reads_the_toys_in_flight_count(toy):
    from megatron_lite.plan.memory import rank_memory

    quickstart = os.path.join(ROOT, "configs", "quickstart.yaml")  # pp2, 4 microbatches
    cfg = load_config(quickstart, [f"parallel.pipeline_schedule={toy}", "model.vocab_size=4096"])
    assert [rank_memory(cfg, 8, r).in_flight for r in range(2)] == [4, 4]


class Stage(torch.nn.Module):
    def __init__(self, stage: int, last: bool):
        super().__init__()
        g = torch.Generator().manual_seed(100 + stage)
        self.weight = torch.nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) / H)
        self.last = last

    def forward(self, x):
        return x + torch.tanh(x @ self.weight)


def _step(chunk, mb, x):
    y = chunk(mb if x is None else x)
    return y.square().mean() if chunk.last else y


def _run(rank, world, m):
    import torch.distributed as dist

    from megatron_lite.pipeline.engine import PipelineStats, forward_backward

    _ensure_toy()
    micro = [torch.randn(S, B, H, generator=torch.Generator().manual_seed(7 + i),
                         dtype=torch.float64) for i in range(m)]  # fmt: skip
    chunk = Stage(virtual_stage(rank, 0, world), rank == world - 1)
    stats = PipelineStats()
    loss = forward_backward([chunk], micro, _step, pp_group=dist.group.WORLD,
                            tensor_shape=(S, B, H), dtype=torch.float64, timeout_s=30,
                            stats=stats, schedule=TOY)  # fmt: skip
    return float(loss), chunk.weight.grad.clone(), stats.max_in_flight


def test_engine_runs_the_toy_to_one_process_losses_and_grads():
    m, world = 3, 2
    ref = [Stage(s, s == world - 1) for s in range(world)]  # one process, the whole model
    total = 0.0
    for i in range(m):
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7 + i),
                        dtype=torch.float64)  # fmt: skip
        for st in ref:
            x = st(x)
        loss = x.square().mean()
        loss.backward()
        total += loss.item()
    for rank, (loss, grad, held) in enumerate(run_ranks(world, _run, m, timeout=60)):
        want = total if rank == world - 1 else 0.0  # the loss is on the last stage
        assert loss == pytest.approx(want, rel=1e-12, abs=0.0), (rank, loss, want)
        err = (grad - ref[rank].weight.grad).abs().max().item()
        assert err < 1e-12, f"rank {rank}: grads differ from one process by {err}"
        assert held == m, f"rank {rank}: {held} microbatches in flight, GPipe holds all {m}"


def test_docs_table_is_the_shipped_records():
    assert TOY not in schedule_names()  # the fixture took it out again
    with open(os.path.join(ROOT, "docs", "pipeline.md"), encoding="utf-8") as f:
        page = f.read()
    assert schedules_table() in page, "docs/pipeline.md's schedules table: paste schedules_table()"
