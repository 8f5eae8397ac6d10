"""Each autograd collective: forward and backward against single-process torch on 4 ranks."""

import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks


def _check_mappings(rank, world):
    from megatron_lite.parallel import mappings as m

    g = dist.group.WORLD
    torch.manual_seed(0)  # same full tensors on every rank
    full = torch.randn(8, 3, 12, dtype=torch.float64)
    gout = torch.randn(8, 3, 12, dtype=torch.float64)
    last = full.chunk(world, -1)[rank]
    seq = full.chunk(world, 0)[rank]
    errors = {}

    def run(name, fn, x, grad, want_y, want_gx):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        errors[name] = (float((y - want_y).abs().max()), float((x.grad - want_gx).abs().max()))

    run("copy", lambda x: m.copy_to_tensor_parallel_region(x, g), full, gout, full, gout * world)
    run(
        "reduce",
        lambda x: m.reduce_from_tensor_parallel_region(x, g),
        full,
        gout,
        full * world,
        gout,
    )
    # "keep my chunk": each rank's output grad is its chunk of gout, so the gathered grad is gout
    run(
        "scatter_last",
        lambda x: m.scatter_to_tensor_parallel_region(x, g),
        full,
        gout.chunk(world, -1)[rank],
        last,
        gout,
    )
    run(
        "gather_last",
        lambda x: m.gather_from_tensor_parallel_region(x, g),
        last,
        gout,
        full,
        gout.chunk(world, -1)[rank],
    )
    run(
        "scatter_seq",
        lambda x: m.scatter_to_sequence_parallel_region(x, g),
        full,
        gout.chunk(world, 0)[rank],
        seq,
        gout,
    )
    run(
        "gather_seq",
        lambda x: m.gather_from_sequence_parallel_region(x, g),
        seq,
        gout,
        full,
        (gout * world).chunk(world, 0)[rank],
    )
    run(
        "reduce_scatter_seq",
        lambda x: m.reduce_scatter_to_sequence_parallel_region(x, g),
        full,
        gout.chunk(world, 0)[rank],
        (full * world).chunk(world, 0)[rank],
        gout,
    )
    # all-to-all: [s/w, b, n] -> [s, b, n/w] is the Ulysses exchange
    want = full.chunk(world, -1)[rank]
    run(
        "all_to_all",
        lambda x: m.all_to_all(x, split_dim=2, concat_dim=0, group=g),
        seq,
        gout.chunk(world, -1)[rank],
        want,
        gout.chunk(world, 0)[rank],
    )
    return errors


def test_mappings_match_single_process_reference():
    for rank_errors in run_ranks(4, _check_mappings, timeout=60):
        for name, (ey, eg) in rank_errors.items():
            assert ey < 1e-12 and eg < 1e-12, f"{name}: forward err {ey}, grad err {eg}"


def _flat_all_reduce(rank, world):
    from megatron_lite.parallel import mappings as m
    from megatron_lite.training.memory_tracker import MemoryTracker

    chunk = 4096  # bytes: the largest tensor below is 4×, the small ones coalesce
    shapes = [(1024,), (7,), (3, 5), (200,), (2048,), (9,), (300,), (40, 40)]
    dtypes = [
        torch.float32,
        torch.float32,
        torch.float64,
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float32,
        torch.float32,
    ]

    def tensors(r):  # rank r's values: integers, so every dtype sums exactly
        g = torch.Generator().manual_seed(r)
        return [
            torch.randint(-8, 8, s, generator=g).to(d) for s, d in zip(shapes, dtypes, strict=True)
        ]

    with MemoryTracker() as tracker:  # the inputs made inside it: known, not counted twice
        mine = tensors(rank)
        mine.append(torch.ones(64, 64)[:, ::2])  # non-contiguous and large: coalesced alone
        before = tracker.total
        tracker.reset_peak()
        m.all_reduce_flat(mine, dist.group.WORLD, chunk_bytes=chunk)
        extra = tracker.peak.total - before
    want = [sum(ts) for ts in zip(*(tensors(r) for r in range(world)), strict=True)]
    errors = [
        float((a.double() - b.double()).abs().max()) for a, b in zip(mine, want, strict=False)
    ]
    errors.append(float((mine[-1] - world).abs().max()))
    return errors, extra, mine[-1].numel() * 4


def test_flat_all_reduce_sums_in_place_with_bounded_copies():
    """Large contiguous tensors reduce in place, the rest in coalesced copies of at most the
    chunk (the non-contiguous large one alone): the sum of every tensor exact, the bytes alive
    at once beyond the inputs at most max(chunk, that one tensor's copy) plus one earlier
    chunk (a finished collective's work object may still hold its buffer for a moment; the
    whole flat copy of the old code is 29,846 bytes)."""
    for rank, (errors, extra, lone) in enumerate(run_ranks(2, _flat_all_reduce, timeout=60)):
        assert max(errors) == 0, f"rank {rank}: {errors}"
        assert 0 < extra <= 4096 + max(4096, lone), f"rank {rank}: {extra} bytes of copies"


def _overlap(rank, world):
    from megatron_lite.parallel import mappings as m
    from megatron_lite.parallel.comm_stats import STATS

    g = dist.group.WORLD
    torch.manual_seed(rank)
    in_splits = [rank + 1] * world  # rank r sends r+1 rows to every rank
    out_splits = [r + 1 for r in range(world)]  # and receives r'+1 from each rank r'
    x = torch.randn(sum(in_splits), 5, dtype=torch.float64)
    grad = torch.randn(sum(out_splits), 5, dtype=torch.float64)
    a = x.clone().requires_grad_()
    want = m.all_to_all_uneven(a, out_splits, in_splits, g)
    want.backward(grad)
    b = x.clone().requires_grad_()
    started = STATS.calls["all_to_all"]
    w = torch.ones(5, dtype=torch.float64, requires_grad=True)

    def during():  # the exchange must already be launched when this runs
        return STATS.calls["all_to_all"] - started, (b * w).sum()

    got, (in_flight, side) = m.all_to_all_uneven_overlap(b, out_splits, in_splits, g, during)
    (got * grad).sum().add(side).backward()
    return (
        in_flight,
        float((got - want).abs().max()),
        float((b.grad - a.grad - w.detach()).abs().max()),  # side adds w to b's gradient
    )


def test_all_to_all_overlap_runs_between_start_and_wait():
    """all_to_all_uneven_overlap: the same rows and gradients as the blocking exchange, with
    `during` run after the exchange was launched (the MoE shared expert's overlap)."""
    for in_flight, out_err, grad_err in run_ranks(2, _overlap, timeout=60):
        assert in_flight == 1, "during() ran before the all-to-all was launched"
        assert out_err == 0 and grad_err < 1e-12, (out_err, grad_err)
