"""Zero-bubble schedule tables (ZB-H1, ZB-V) against the papers' closed forms, by the simulator."""

from fractions import Fraction

import pytest

from megatron_lite.pipeline.schedules import (
    Action,
    get_schedule,
    get_schedule_table,
    receive_in_send_order,
    simulate_options,
    stage_location,
    virtual_stage,
    with_comm,
    zb_h1,
    zb_v,
)
from megatron_lite.pipeline.simulate import DeadlockError, ScheduleError, simulate
from tests.unit.test_schedules import B, F, rB, rF, sB, sF


def table(build, pp, m):
    return [build(pp, r, m) for r in range(pp)]


def W(mb, c=0):
    return Action("weight", mb, c)


# (F, B, W): B is the input-gradient pass alone; the paper's closed forms assume W <= B
COSTS = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, Fraction(3, 2), Fraction(1, 2)), (3, 2, 2)]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_bubble_is_the_papers_closed_form(pp):
    """Qi et al. 2024: ZB-H1 leaves (pp-1)(F+B-W) idle per rank, 1F1B (pp-1)(F+B+W)."""
    for m in (pp, pp + 1, 2 * pp, 3 * pp + 1):
        for f, b, w in COSTS:
            zb = simulate(table(zb_h1, pp, m), f, b + w, weight_cost=w, comm="posted")
            one = simulate(get_schedule_table(pp, m), f, b + w)
            assert set(zb.idle) == {(pp - 1) * (f + b - w)}, (m, f, b, w, zb.idle)
            assert set(one.idle) == {(pp - 1) * (f + b + w)}
    uniform = simulate(table(zb_h1, pp, 2 * pp), 1, 2, weight_cost=1, comm="posted")
    assert uniform.bubble_fraction == simulate(get_schedule_table(pp, 2 * pp)).bubble_fraction / 3


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 9), (8, 16)])
def test_zb_h1_holds_no_more_activations_than_1f1b(pp, m):
    """Every rank peaks at pp microbatches forwarded and not yet through W: 1F1B's rank 0."""
    zb = simulate(table(zb_h1, pp, m), comm="posted").peak_in_flight
    one = simulate(get_schedule_table(pp, m)).peak_in_flight
    assert zb == (max(one),) * pp == (min(pp, m),) * pp


def test_zb_h1_defers_weight_passes_by_rank():
    """Rank r runs its first W after its (r+1)-th backward: the held-back W fill the cool-down."""
    pp, m = 4, 8
    for r in range(pp):
        computes = [a for a in zb_h1(pp, r, m) if not a.is_comm]
        first_w = next(i for i, a in enumerate(computes) if a.kind == "weight")
        assert sum(a.kind == "backward" for a in computes[:first_w]) == min(r + 1, m)
        assert [a.microbatch for a in computes if a.kind == "weight"] == list(range(m))


def test_v_placement_puts_two_stages_per_rank_and_turns_on_the_last_rank():
    pp = 4
    assert [virtual_stage(r, 0, pp, "v") for r in range(pp)] == [0, 1, 2, 3]
    assert [virtual_stage(r, 1, pp, "v") for r in range(pp)] == [7, 6, 5, 4]
    for stage in range(2 * pp):
        assert virtual_stage(*stage_location(stage, pp, "v"), pp, "v") == stage
    # the last rank's chunk 0 feeds its own chunk 1: no p2p on that turn
    actions = with_comm([F(0, 0), F(0, 1), B(0, 1), B(0, 0)], pp, pp - 1, 2, "v")
    assert [a.kind for a in actions] == [
        "recv_forward", "forward", "forward", "send_forward",
        "recv_backward", "backward", "backward", "send_backward",
    ]  # fmt: skip


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_v_reaches_the_warm_up_bound(pp):
    """At F = B = W (one chunk each) the last rank cannot start before pp - 1 chunk forwards
    have run upstream, so every rank (all do the same work) idles at least pp - 1: ZB-V idles
    exactly that once m >= 2pp - 1, 1/6 of 1F1B's (pp - 1)(F + B + W) on whole-model costs."""
    for m in range(pp, 4 * pp + 1):
        result = simulate(table(zb_v, pp, m), 1, 2, weight_cost=1, placement="v", comm="posted")
        assert max(result.peak_in_flight) <= 2 * pp  # pp whole-model microbatches, as 1F1B
        if m >= 2 * pp - 1:
            assert set(result.idle) == {pp - 1}, (m, result.idle)
            one = simulate(get_schedule_table(pp, m), 2, 4)  # a whole-model stage is two chunks
            assert result.bubble_fraction == one.bubble_fraction / 6
            assert result.peak_in_flight == (2 * pp,) * pp


def test_zb_v_needs_receives_in_send_order():
    """Link r -> r+1 carries chunk-0 activations and chunk-1 gradients; posted where each
    compute needs them, the receiver would take them in another order than they are sent."""
    from megatron_lite.pipeline import zero_bubble

    pp, m = 4, 8
    natural = [with_comm(zero_bubble._zb_v_computes(pp, r, m), pp, r, 2, "v") for r in range(pp)]
    with pytest.raises(ScheduleError, match="is received by"):
        simulate(natural, placement="v", comm="posted")
    simulate(receive_in_send_order(natural, "v"), placement="v", comm="posted")


def test_posted_batches_leave_1f1b_and_interleaved_unchanged():
    for pp, m, vpp in [(2, 3, 1), (4, 8, 1), (4, 8, 2), (3, 9, 3)]:
        rendezvous = simulate(get_schedule_table(pp, m, vpp), 1, 2.5, 0.25)
        posted = simulate(get_schedule_table(pp, m, vpp), 1, 2.5, 0.25, comm="posted")
        assert posted.makespan == pytest.approx(rendezvous.makespan)
        assert posted.peak_in_flight == rendezvous.peak_in_flight


def test_posted_sends_do_not_block_but_missing_inputs_deadlock():
    # each rank sends before it receives, in separate batches: a rendezvous deadlock (the
    # second send waits for a receive posted only after the peer's own send), fine posted
    rank0 = [F(0), (sF(0),), F(1), (sF(1),), (rB(0),), B(0), (rB(1),), B(1)]
    rank1 = [(rF(0),), F(0), B(0), (sB(0),), (rF(1),), F(1), B(1), (sB(1),)]
    with pytest.raises(DeadlockError):
        simulate([rank0, rank1])
    assert simulate([rank0, rank1], comm="posted").makespan == 9
    # rank 0 needs the gradient before it sends the activation rank 1 needs: stuck either way
    late = [F(0), rB(0), B(0), sF(0), F(1), sF(1), rB(1), B(1)]
    with pytest.raises(
        DeadlockError, match=r"rank 0 action 1 recv_backward\(mb=0, chunk=0\) waits for rank 1"
    ):
        simulate([late, rank1], comm="posted")


def test_simulator_checks_weight_passes_and_the_v_turn():
    with pytest.raises(ScheduleError, match="weight.*comes before its backward"):
        simulate([[F(0), W(0), B(0)]])
    with pytest.raises(ScheduleError, match="no weight of microbatch 1 on virtual stage 0"):
        simulate([[F(0), B(0), W(0), F(1), B(1)]])
    last = with_comm([F(0, 0), F(0, 1), B(0, 1), B(0, 0)], 2, 1, 2, "v")
    first = with_comm([F(0, 0), F(0, 1), B(0, 1), B(0, 0)], 2, 0, 2, "v")
    assert simulate([first, last], placement="v").makespan == 12  # 4 F and 4 B in a row
    turn = last[:2] + [Action("send_forward", 0, 0)] + last[2:]
    with pytest.raises(ScheduleError, match="neighbouring stage is on this rank"):
        simulate([first, turn], placement="v")


def test_weight_cost_splits_the_backward():
    """The same work costs the same: a split table at weight_cost w equals 1F1B's step time
    when nothing overlaps (pp = 1), and W releases the activation, not B."""
    split = [F(0), B(0), W(0), F(1), B(1), W(1)]
    result = simulate([split], 1, 3, weight_cost=1)
    assert result.makespan == simulate([[F(0), B(0), F(1), B(1)]], 1, 3).makespan == 8
    assert simulate([[F(0), F(1), B(0), B(1), W(0), W(1)]]).peak_in_flight == (2,)


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["parallel.pipeline_schedule=zb-v"], "needs vpp=2.*Fix: set parallel.vpp=2"),
        (["parallel.pipeline_schedule=zb-v", "parallel.vpp=4"], "Fix: set parallel.vpp=2"),
        (["parallel.pipeline_schedule=zb-h1", "parallel.vpp=2"], "needs vpp=1"),
        (["parallel.pipeline_schedule=interleaved"], "needs vpp >= 2"),
        (["parallel.pipeline_schedule=gpipe"], "must be one of"),
    ],
)
def test_bad_schedule_choices_are_config_errors(overrides, rule):
    from megatron_lite.config import ConfigError, load_config
    from megatron_lite.validation import validate

    base = ["data.mock=true", "model.num_layers=4", "parallel.pp=2", "train.global_batch_size=8"]
    cfg = load_config(None, [*base, *overrides])
    with pytest.raises(ConfigError, match=rule) as err:
        validate(cfg, world_size=2)
    assert "parallel.pipeline_schedule=" in str(err.value) and "Fix:" in str(err.value)


def _torch_orders(cases):
    """PyTorch's pipeline_order of every rank, per (class name, pp, m) (a fake process group:
    building the schedule computes every rank's actions, nothing runs)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for cls, pp, m in cases:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
        stages = [PipelineStage(torch.nn.Linear(2, 2), s, 2 * pp, torch.device("cpu"))
                  for s in (0, 2 * pp - 1)]  # fmt: skip
        sched = getattr(torch_schedules, cls)(stages, n_microbatches=m)
        out[(cls, pp, m)] = [[str(a) for a in sched.pipeline_order[r] if a is not None]
                             for r in range(pp)]  # fmt: skip
        dist.destroy_process_group()
    return out


def test_zb_v_and_dualpipev_tables_are_pytorchs():
    """Our ZB-V and DualPipeV tables (compute order per rank) equal torch.distributed.pipelining's
    ScheduleZBVZeroBubble and ScheduleDualPipeV, an independent implementation of the papers'
    schedules, on pp 2-8 (PyTorch's full backward B = our B then W); and DualPipeV, simulated
    at F = B = W per chunk, idles what ZB-V does, pp - 1 chunk forwards a rank, holding 2·pp + 1
    chunk-microbatches on every rank."""
    from tests.dist_harness import run_alone
    from tests.unit.test_bench_pipeline import torch_actions

    ours = {"ScheduleZBVZeroBubble": "zb-v", "ScheduleDualPipeV": "dualpipev"}
    cases = [(cls, pp, m) for cls in ours for pp, m in ((2, 5), (4, 8), (4, 9), (8, 16))]
    for (cls, pp, m), orders in run_alone(_torch_orders, cases, timeout=120).items():
        for rank, order in enumerate(orders):
            mine = [a for a in get_schedule(pp, rank, m, 2, ours[cls]) if not a.is_comm]
            assert mine == torch_actions(order, pp), (cls, pp, m, rank, order)
    for pp in (2, 4, 8):
        for m in (2 * pp, 3 * pp + 1):
            how = simulate_options("dualpipev", 2)
            dual = simulate(get_schedule_table(pp, m, 2, "dualpipev"), 1, 2, weight_cost=1, **how)
            assert dual.peak_in_flight == (2 * pp + 1,) * pp, (pp, m, dual.peak_in_flight)
            assert dual.makespan == 2 * m * 3 + (pp - 1), (pp, m, dual.makespan)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_idle_against_deepseeks_closed_form(pp):
    """DeepSeek's DualPipe table gives DualPipeV (PP/2 - 1)(F&B + B - 3W) of bubble, PP being
    its 2·pp virtual stages; with the pair run in turn (F&B = F + B, as our engine and
    simulator do) that is (pp - 1)(F + 2B - 3W). The simulated table equals it at F = B = 2W
    on every rank and m; it never idles less than the warm-up bound (pp - 1)·F that any V
    placement has (the first input's trip to the last rank), which is all it idles at
    F = B = W, where the closed form says 0. (Elsewhere they differ either way: the closed form
    is DeepSeek's accounting, not a bound.)"""
    for m in (2 * pp, 2 * pp + 1, 4 * pp):
        for f, b, w in [*COSTS, (2, 2, 1), (4, 4, 2), (1, 3, 1)]:
            t = get_schedule_table(pp, m, 2, "dualpipev")
            idle = set(
                simulate(t, f, b + w, weight_cost=w, **simulate_options("dualpipev", 2)).idle
            )
            assert len(idle) == 1 and min(idle) >= (pp - 1) * f, (m, f, b, w, idle)
            if f == b == 2 * w:
                assert idle == {(pp - 1) * (f + 2 * b - 3 * w)}, (m, f, b, w, idle)
            if f == b == w:
                assert idle == {(pp - 1) * f}, (m, f, b, w, idle)
