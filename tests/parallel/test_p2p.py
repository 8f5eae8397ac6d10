"""Pipeline p2p on forked gloo ranks: batched exchange, comm stats, tracing, timeouts."""

import pytest
import torch

from tests.dist_harness import run_ranks

SHAPE = (4, 2, 8)  # [s, b, h]


def _communicator(timeout_s: float, trace: bool | None = None):
    import torch.distributed as dist

    from megatron_lite.pipeline.p2p import P2PCommunicator

    ranks = list(range(dist.get_world_size()))
    return P2PCommunicator(
        dist.group.WORLD, ranks, SHAPE, torch.float32, torch.device("cpu"), timeout_s, trace=trace
    )


def _exchange(rank, world):
    import contextlib
    import io
    import os

    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.pipeline.p2p import TRACE_ENV
    from megatron_lite.pipeline.schedules import Action

    os.environ[TRACE_ENV] = "1"
    STATS.start_step(3)
    p2p, out = _communicator(timeout_s=30), io.StringIO()
    act = torch.arange(64, dtype=torch.float32).reshape(SHAPE)
    with contextlib.redirect_stdout(out):
        if rank == 0:  # stage 0 sends two activations, gets one gradient back mid-way
            p2p.exchange((Action("send_forward", 0),), {Action("send_forward", 0): act})
            batch = (Action("send_forward", 1), Action("recv_backward", 0))
            got = p2p.exchange(batch, {batch[0]: act + 1})[batch[1]]
        else:
            x0 = p2p.exchange((Action("recv_forward", 0),), {})[Action("recv_forward", 0)]
            batch = (Action("recv_forward", 1), Action("send_backward", 0))
            got = p2p.exchange(batch, {batch[1]: 2 * x0})[batch[0]]
    return got.tolist(), dict(STATS.calls), dict(STATS.bytes), out.getvalue()


def test_batched_exchange_moves_tensors_and_reports():
    (grad, calls0, bytes0, log0), (act1, calls1, _, log1) = run_ranks(2, _exchange, timeout=60)
    ref = torch.arange(64, dtype=torch.float32).reshape(SHAPE)
    assert torch.tensor(grad).equal(2 * ref), "rank 0 did not get 2x its activation as gradient"
    assert torch.tensor(act1).equal(ref + 1), "rank 1's 2nd recv_forward did not get microbatch 1"
    assert calls0 == {"p2p_send": 2, "p2p_recv": 1} and calls1 == {"p2p_send": 1, "p2p_recv": 2}
    assert bytes0["p2p_send"] == 2 * 64 * 4
    assert "[p2p] rank 0 step 3 send_forward mb 1 chunk 0 -> peer 1" in log0, log0
    assert "[p2p] rank 1 step 3 recv_forward mb 0 chunk 0 <- peer 0" in log1, log1
    assert "[p2p] rank 1 step 3 done [rF1.0 sB0.0]" in log1, log1


def _peer_never_sends(rank, world):
    import time

    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.pipeline.p2p import P2PError
    from megatron_lite.pipeline.schedules import Action

    STATS.start_step(7)
    p2p = _communicator(timeout_s=1.5, trace=False)
    if rank == 0:  # stage 0 computes forever: never posts its send
        time.sleep(4)
        return None
    start = time.monotonic()
    try:
        p2p.exchange((Action("recv_forward", 5, 0),), {})
    except P2PError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_recv_times_out_with_rank_step_action_and_peer():
    _, (message, elapsed) = run_ranks(2, _peer_never_sends, timeout=30)
    assert elapsed < 5, f"the receiver waited {elapsed:.1f}s for a 1.5s timeout"
    for part in ("rank 1 step 7", "recv_forward mb 5 chunk 0 <- peer 0", "timed out"):
        assert part in message, f"{part!r} missing from: {message}"


def _wrong_shape(rank, world):
    from megatron_lite.pipeline.schedules import Action

    p2p = _communicator(timeout_s=5, trace=False)
    with pytest.raises(ValueError, match=r"send_forward mb 0 chunk 0 has \(4, 2, 7\)"):
        p2p.exchange((Action("send_forward", 0),), {Action("send_forward", 0): torch.ones(4, 2, 7)})


def test_wrong_payload_shape_is_rejected_before_sending():
    run_ranks(1, _wrong_shape, timeout=30)


def _warm_up(rank, world, absent: int | None):
    import time

    import torch.distributed as dist

    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.pipeline.p2p import P2PError, warm_up

    if rank == absent:  # this stage never reaches the warm-up (stuck in its start-up)
        time.sleep(2.5)
        return None
    STATS.start_step(0)
    start = time.monotonic()
    try:
        warm_up(dist.group.WORLD, torch.device("cpu"), timeout_s=1.0)
    except P2PError as e:
        return str(e), time.monotonic() - start
    return "ok", time.monotonic() - start


def test_warm_up_exchanges_on_every_link_of_the_ring():
    for rank, (message, _) in enumerate(run_ranks(3, _warm_up, None, timeout=30)):
        assert message == "ok", f"rank {rank}: {message}"


def test_warm_up_names_rank_and_peer_when_a_peer_never_joins():
    """Ranks 1 and 2 wait for stage 0 (their previous and next stage) until the timeout."""
    results = run_ranks(3, _warm_up, 0, timeout=30)
    for rank in (1, 2):
        message, elapsed = results[rank]
        assert elapsed < 2.4, f"rank {rank} waited {elapsed:.1f}s for a 1s warm-up timeout"
        for part in (f"rank {rank} step 0: pipeline warm-up", "peer 0", "timed out after 1s"):
            assert part in message, f"rank {rank}: {part!r} missing from: {message}"


def _stuck_device_batch(rank, world):
    """A CUDA communicator's batch whose (stand-in) NCCL work never completes: NCCL's wait()
    with a timeout blocks the host and raises once it passes; without one it returns at once
    (it only orders the compute stream), which left a stuck send to NCCL's watchdog."""
    import time

    import torch.distributed as dist

    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.pipeline.p2p import P2PCommunicator, P2PError
    from megatron_lite.pipeline.schedules import Action

    waits = []

    class StuckNcclWork:
        def wait(self, timeout=None):
            waits.append(timeout)
            if timeout is None:
                return True
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SEND)")

    dist.batch_isend_irecv = lambda ops: [StuckNcclWork()]  # one work per batch, as NCCL's
    STATS.start_step(4)
    p2p = P2PCommunicator(
        dist.group.WORLD, [0, 1], SHAPE, torch.float32, torch.device("cuda"), 0.5, trace=False
    )
    send = Action("send_forward", 2, 0)
    try:
        p2p.exchange((send,), {send: torch.zeros(SHAPE)})
    except P2PError as e:
        return str(e), waits
    return "no error", waits


def test_a_stuck_nccl_batch_ends_in_a_timed_wait_naming_rank_step_op_and_peer():
    message, waits = run_ranks(2, _stuck_device_batch, timeout=30)[0]
    assert waits and all(w is not None for w in waits), f"untimed NCCL waits: {waits}"
    for part in ("rank 0 step 4", "send_forward mb 2 chunk 0 -> peer 1", "timed out after 0.5s"):
        assert part in message, f"{part!r} missing from: {message}"
