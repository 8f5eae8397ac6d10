"""Pipeline schedules as data, checked by the simulator (no processes)."""

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

from megatron_lite.pipeline.schedules import (
    Action,
    comm_batches,
    get_schedule,
    get_schedule_table,
    interleaved_one_f_one_b,
    one_f_one_b,
    peer_of,
)
from megatron_lite.pipeline.simulate import (
    DeadlockError,
    ScheduleError,
    chrome_trace,
    simulate,
    timeline,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def F(mb, c=0):
    return Action("forward", mb, c)


def B(mb, c=0):
    return Action("backward", mb, c)


def rF(mb, c=0):
    return Action("recv_forward", mb, c)


def sF(mb, c=0):
    return Action("send_forward", mb, c)


def rB(mb, c=0):
    return Action("recv_backward", mb, c)


def sB(mb, c=0):
    return Action("send_backward", mb, c)


def valid_configs(pp):
    """All (vpp, m) with vpp <= 4, m <= 32 that the schedules accept for this pp."""
    for vpp in range(1, 5):
        for m in range(1, 33):
            if pp == 1 and vpp > 1 or m < pp or vpp > 1 and m % pp:
                continue
            yield vpp, m


@pytest.mark.parametrize("pp", range(1, 9))
def test_bubble_equals_megatron_formula_and_no_deadlock(pp):
    diverged = []
    for vpp, m in valid_configs(pp):
        result = simulate(get_schedule_table(pp, m, vpp))  # raises on deadlock / mismatch
        expected = Fraction(pp - 1, vpp * m)
        if result.bubble_fraction != expected or set(result.bubble_per_rank) != {expected}:
            diverged.append((vpp, m, result.bubble_fraction, expected))
        # Ideal time is m*vpp*(F+B) per rank; the bubble adds (pp-1)*(F+B).
        assert result.makespan == (vpp * m + pp - 1) * 3, (pp, vpp, m, result.makespan)
    assert not diverged, f"pp={pp}: (vpp, m, simulated, (pp-1)/(vpp*m)) differ: {diverged}"


@pytest.mark.parametrize("pp,m", [(1, 1), (1, 4), (2, 2), (4, 4), (4, 9), (8, 8), (8, 32)])
def test_one_f_one_b_peak_in_flight_is_pp_minus_rank(pp, m):
    peaks = simulate(get_schedule_table(pp, m)).peak_in_flight
    assert peaks == tuple(min(pp - r, m) for r in range(pp))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (3, 4, 9)])
def test_interleaved_peak_in_flight_is_warmup_plus_one(pp, vpp, m):
    peaks = simulate(get_schedule_table(pp, m, vpp)).peak_in_flight
    assert peaks == tuple(min((pp - r - 1) * 2 + (vpp - 1) * pp + 1, m * vpp) for r in range(pp))


def test_interleaved_with_m_equal_pp_runs_all_forwards_first():
    actions = interleaved_one_f_one_b(4, 1, 4, 2)
    kinds = [a.kind for a in actions if not a.is_comm]
    assert kinds == ["forward"] * 8 + ["backward"] * 8


def test_golden_one_f_one_b_pp2_m3():
    rank0 = [F(0), sF(0), F(1), sF(1), rB(0), B(0), F(2), sF(2), rB(1), B(1), rB(2), B(2)]
    rank1 = [rF(0), F(0), B(0), rF(1), sB(0), F(1), B(1), rF(2), sB(1), F(2), B(2), sB(2)]
    assert one_f_one_b(2, 0, 3) == rank0
    assert one_f_one_b(2, 1, 3) == rank1
    assert comm_batches(rank1)[:5] == [(rF(0),), F(0), B(0), (rF(1), sB(0)), F(1)]
    result = simulate([rank0, rank1])
    assert result.makespan == 12 and result.bubble_fraction == Fraction(1, 3)


def test_no_pipelining_is_gradient_accumulation():
    assert get_schedule(1, 0, 3) == [F(0), B(0), F(1), B(1), F(2), B(2)]
    assert simulate([get_schedule(1, 0, 3)]).bubble_fraction == 0


def test_peer_wraps_to_next_chunk_on_rank_0():
    # pp=4: rank 3 chunk 0 is virtual stage 3; stage 4 is rank 0 chunk 1.
    assert peer_of(sF(0, 0), 3, 4) == (0, 1)
    assert peer_of(rF(0, 1), 0, 4) == (3, 0)
    assert peer_of(sB(0, 1), 0, 4) == (3, 0)
    assert peer_of(rB(0, 0), 3, 4) == (0, 1)
    assert peer_of(sF(5, 1), 1, 4) == (2, 1)


def test_hand_made_deadlock_is_reported_with_rank_and_action():
    # Rank 0 waits for a gradient before sending the activation rank 1 waits for.
    rank0 = [F(0), (rB(0),), (sF(0),), B(0)]
    rank1 = [(rF(0),), F(0), B(0), (sB(0),)]
    with pytest.raises(DeadlockError) as err:
        simulate([rank0, rank1])
    assert {(w[0], w[1], w[2]) for w in err.value.waits} == {(0, 1, rB(0)), (1, 0, rF(0))}
    assert "rank 0 action 1 recv_backward(mb=0, chunk=0) waits for rank 1 action 3" in str(
        err.value
    )


def test_one_batch_of_the_same_ops_does_not_deadlock():
    # Bare adjacent comm actions form one batch: both ops are posted together.
    rank0 = [F(0), rB(0), sF(0), B(0)]
    rank1 = [rF(0), F(0), B(0), sB(0)]
    assert simulate([rank0, rank1]).makespan == 6


def test_rendezvous_sends_in_separate_batches_deadlock():
    # Each rank sends before it receives, in separate batches: an eager send would hide this.
    rank0 = [F(0), (sF(0),), F(1), (sF(1),), (rB(0),), B(0), (rB(1),), B(1)]
    rank1 = [(rF(0),), F(0), B(0), (sB(0),), (rF(1),), F(1), B(1), (sB(1),)]
    with pytest.raises(DeadlockError) as err:
        simulate([rank0, rank1])
    assert {(w[0], w[2]) for w in err.value.waits} == {(0, sF(1)), (1, sB(0))}
    # The same ops with each exchange in one batch is 1F1B and runs.
    flat = [[a for step in t for a in (step if isinstance(step, tuple) else (step,))]
            for t in (rank0, rank1)]  # fmt: skip
    assert simulate(flat).makespan == 9


def test_out_of_order_receive_is_a_mismatch():
    rank0 = [F(0), F(1), sF(0), sF(1)] + [B(0), B(1)]
    rank1 = [rF(1), rF(0), F(0), F(1), B(0), B(1)]
    rank0[4:4] = [rB(0), rB(1)]
    rank1 += [sB(0), sB(1)]
    with pytest.raises(ScheduleError, match=r"link 0->1 message 0: .*send_forward\(mb=0.*mb=1"):
        simulate([rank0, rank1])


def test_receive_without_send_is_reported():
    rank0 = [F(0), sF(0), F(1), rB(0), B(0), rB(1), B(1)]  # never sends microbatch 1
    rank1 = [rF(0), F(0), B(0), sB(0), rF(1), F(1), B(1), sB(1)]
    with pytest.raises(
        ScheduleError, match=r"rank 1 action 4 recv_forward\(mb=1.*no matching send"
    ):
        simulate([rank0, rank1])


def test_backward_before_forward_is_rejected():
    with pytest.raises(ScheduleError, match="action 0 backward.*before its forward"):
        simulate([[B(0), F(0)]])


def test_missing_stage_work_is_rejected():
    with pytest.raises(ScheduleError, match="no forward of microbatch 1 on virtual stage 0"):
        simulate([[F(0), B(0), F(2), B(2)]])


@pytest.mark.parametrize(
    "pp,m,vpp,message",
    [
        (4, 6, 2, r"num_microbatches=6 must be a multiple of pp=4 .* use num_microbatches=4 or 8"),
        (4, 3, 1, r"num_microbatches=3 must be >= pp=4 for the 1F1B schedule"),
        (4, 2, 2, r"num_microbatches=2 must be >= pp=4"),
        (1, 4, 2, r"vpp=2 needs pp >= 2"),
        (2, 0, 1, r"num_microbatches=0 must be >= 1"),
    ],
)
def test_invalid_microbatch_counts_raise(pp, m, vpp, message):
    with pytest.raises(ValueError, match=message):
        get_schedule(pp, 0, m, vpp)


def test_invalid_rank_raises():
    with pytest.raises(ValueError, match=r"pp_rank=4 must be in \[0, pp=4\)"):
        one_f_one_b(4, 4, 8)


def test_timeline_spans_cover_all_compute_without_overlap():
    pp, m, vpp = 4, 8, 2
    spans = timeline(get_schedule_table(pp, m, vpp))
    for rank in range(pp):
        compute = [s for s in spans if s.rank == rank and s.kind in ("forward", "backward")]
        assert len(compute) == 2 * m * vpp
        assert all(a.end <= b.start for a, b in zip(compute, compute[1:], strict=False))
    trace = chrome_trace(spans)
    assert len(json.loads(json.dumps(trace))["traceEvents"]) == len(spans)


def test_comm_cost_adds_time_and_float_costs_give_floats():
    result = simulate(get_schedule_table(4, 8, 2), forward_cost=1.0, comm_cost=0.25)
    assert isinstance(result.bubble_fraction, float)
    assert result.bubble_fraction > 3 / 16


def test_cli_prints_bubble_and_peak():
    out = subprocess.run(
        [sys.executable, "tools/pipeline_bubble.py", "--pp", "4", "--vpp", "2", "-m", "8"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "bubble   3/16 = 0.1875 (simulated)" in out
    assert "   0               11" in out


def test_package_keeps_simulate_as_the_module_name():
    import megatron_lite.pipeline as pipeline
    import megatron_lite.pipeline.simulate as sim

    assert sim is pipeline.simulate and callable(sim.simulate)
