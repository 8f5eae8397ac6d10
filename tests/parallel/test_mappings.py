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
